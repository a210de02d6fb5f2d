"""2-D convolution whose backward is written as *canonical* NHWC/HWIO convolutions.

Why: XLA:CPU runs a convolution fast (Eigen) only in its canonical form
``b01f_01io->b01f``. Outside loops a canonicalisation pass rewrites the transposed
convolutions autodiff emits; inside a ``while`` body (our tile loops) it does not, and the
backward convolutions fall back to a naive kernel: measured 15-60x slower per tile
(see README.md (rowconv section)). So the VJP is spelled out here, per spatial dim with stride ``s``,
dilation ``d``, kernel ``k``, padding ``(lo, hi)``, input size ``n`` and output size ``m``:

    y[j]  = sum_t x[j*s - lo + t*d] . K[t]
    dx    = conv(g dilated by s, flip(K) with I<->O, rhs_dilation d,
                 pad (d(k-1) - lo,  n - 1 + lo - (m-1)*s))
    dK    = conv(lhs = x with (C as batch, B as feature), rhs = g as (H, W, B, O),
                 window_strides d, rhs_dilation s, pad (lo, (k-1)*d - lo + (m-1)*s - n + 1))

(feature groups: ``feature_group_count`` for dx after regrouping the kernel,
``batch_group_count`` for dK). Negative pads crop rows that no output row reads.
The result equals ``jax.vjp`` of ``lax.conv_general_dilated`` up to summation order.

Inside ``shard_map`` a kernel replicated over an axis the input varies over (data
parallelism) is cast to varying first, as ``lax.conv_general_dilated`` does implicitly:
the cast transposes to a ``psum``, so ``dK`` is the summed gradient, typed like ``K``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem._prims.ties import vary_like

__all__: list[str] = []  # internal to rowconv: its layers call _conv2d

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, k, strides, pads, dil, groups, lhs_dil=(1, 1), batch_groups=1):
    return lax.conv_general_dilated(
        x, k, tuple(strides), tuple(tuple(p) for p in pads), lhs_dilation=tuple(lhs_dil),
        rhs_dilation=tuple(dil), dimension_numbers=_DN, feature_group_count=groups,
        batch_group_count=batch_groups)


def _conv2d(x, k, strides, pads, dil, groups):
    """``lax.conv_general_dilated`` (NHWC, HWIO) with a loop-friendly backward."""
    return _conv2d_vjp(vary_like(x, k), vary_like(k, x), strides, pads, dil, groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _conv2d_vjp(x, k, strides, pads, dil, groups):
    return _conv(x, k, strides, pads, dil, groups)


def _fwd(x, k, strides, pads, dil, groups):
    return _conv(x, k, strides, pads, dil, groups), (x, k)


def _bwd(strides, pads, dil, groups, res, g):
    x, k = res
    kh, kw, cin_g, cout = k.shape
    n = x.shape[1:3]
    m = g.shape[1:3]
    ks = (kh, kw)
    # ---- dx
    G = groups
    kf = k[::-1, ::-1]
    kf = kf.reshape(kh, kw, cin_g, G, cout // G)
    kf = jnp.transpose(kf, (0, 1, 4, 3, 2)).reshape(kh, kw, cout // G, G * cin_g)
    pads_dx = [(dil[a] * (ks[a] - 1) - pads[a][0],
                n[a] - 1 + pads[a][0] - (m[a] - 1) * strides[a]) for a in range(2)]
    dx = _conv(g, kf.astype(g.dtype), (1, 1), pads_dx, dil, G, lhs_dil=strides)
    # ---- dK
    lhs = jnp.transpose(x, (3, 1, 2, 0))  # (C, H, W, B): channels as batch
    rhs = jnp.transpose(g, (1, 2, 0, 3)).astype(x.dtype)  # (Ho, Wo, B, O) as HWIO
    pads_dk = [(pads[a][0], (ks[a] - 1) * dil[a] - pads[a][0] + (m[a] - 1) * strides[a]
                - n[a] + 1) for a in range(2)]
    dk = lax.conv_general_dilated(
        lhs, rhs, tuple(dil), [tuple(p) for p in pads_dk], rhs_dilation=tuple(strides),
        dimension_numbers=_DN, batch_group_count=G)  # (cin_g, kh, kw, O)
    dk = jnp.transpose(dk, (1, 2, 0, 3)).astype(k.dtype)
    return dx.astype(x.dtype), dk


_conv2d_vjp.defvjp(_fwd, _bwd)
