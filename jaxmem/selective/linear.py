"""Differentiability-aware linear layers: dense, convolution, transposed convolution.

A layer ``z = f(x, W)`` that is bilinear in its input ``x`` and weight ``W`` has

    dL/dx = f(., W)^T g        (needs W only)
    dL/dW = f(x, .)^T g        (needs x only)

so the input ``x`` only has to be kept for the backward pass when ``W`` is differentiated,
and ``W`` only when ``x`` is. The primitives here are ``jax.custom_vjp`` functions with
``symbolic_zeros=True``: the forward rule sees which of ``x``/``W`` are perturbed (part of
the differentiation) and stores exactly the tensors the requested gradients need. Both
transposes are computed with ``jax.linear_transpose`` of the very same lax call, so the
gradients are those of JAX's own autodiff. A bias is added outside the custom rule: its
gradient ``sum(g)`` needs nothing stored.

``dot_general`` and ``conv_general_dilated`` have the exact signatures of their ``lax``
namesakes, so they can be handed to ``flax.linen.Dense(dot_general=...)`` /
``flax.linen.Conv(conv_general_dilated=...)``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem.selective._core import check_float, is_zero, struct, tag

__all__ = [
    "bilinear",
    "conv",
    "conv_general_dilated",
    "conv_transpose",
    "dense",
    "dot_general",
]


# ----------------------------------------------------------------------------- core
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _bilinear(fn, name, x_struct, w_struct, x, w):
    del name, x_struct, w_struct
    return fn(x, w)


def _bilinear_fwd(fn, name, x_struct, w_struct, x, w):
    del x_struct, w_struct
    y = fn(x.value, w.value)
    # keep x only if dL/dW is requested, W only if dL/dx is requested.
    res_x = tag(x.value, name + ".input") if w.perturbed else None
    res_w = w.value if x.perturbed else None
    return y, (res_x, res_w)


def _bilinear_bwd(fn, name, x_struct, w_struct, res, g):
    del name
    res_x, res_w = res
    if is_zero(g):
        return None, None
    dx = dw = None
    if res_w is not None:
        (dx,) = jax.linear_transpose(lambda x_: fn(x_, res_w), x_struct)(g)
    if res_x is not None:
        (dw,) = jax.linear_transpose(lambda w_: fn(res_x, w_), w_struct)(g)
    return dx, dw


_bilinear.defvjp(_bilinear_fwd, _bilinear_bwd, symbolic_zeros=True)


def bilinear(fn: Callable[[Any, Any], Any], x, w, *, name: str = "bilinear"):
    """Apply ``fn(x, w)``, bilinear in ``(x, w)``, storing only what requested grads need.

    ``fn`` must be linear in each argument separately (dense, convolution, einsum, ...).
    Residuals: ``x`` (tagged ``jaxmem.selective.<name>.input``) iff ``w`` is
    differentiated; ``w`` iff ``x`` is differentiated; nothing if neither.
    """
    return _bilinear(fn, name, struct(x), struct(w), x, w)


# ----------------------------------------------------------------------- lax-compatible
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
    """Drop-in for ``lax.dot_general`` with differentiability-aware residuals."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    fn = functools.partial(
        _dot_general_fn,
        dimension_numbers=_freeze(dimension_numbers),
        precision=precision,
        preferred_element_type=preferred_element_type,
        kwargs=tuple(sorted(kwargs.items())),
    )
    return bilinear(fn, lhs, rhs, name="dense")


def _dot_general_fn(x, w, *, dimension_numbers, precision, preferred_element_type, kwargs):
    return lax.dot_general(x, w, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **dict(kwargs))


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                         batch_group_count=1, precision=None, preferred_element_type=None,
                         **kwargs):
    """Drop-in for ``lax.conv_general_dilated`` with differentiability-aware residuals.

    Extra keyword arguments (e.g. ``out_sharding``) are passed through to lax; ``None``
    values are dropped."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    ndim_sp = jnp.ndim(lhs) - 2
    padding = _check_padding(padding, ndim_sp)
    fn = functools.partial(
        lax.conv_general_dilated,
        window_strides=tuple(window_strides),
        padding=padding,
        lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
        rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )
    return bilinear(fn, lhs, rhs, name="conv")


def _freeze(dn):
    (lc, rc), (lb, rb) = dn
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


_PAD_STRINGS = ("SAME", "VALID", "SAME_LOWER")


def _check_padding(padding, ndim_sp: int):
    if isinstance(padding, str):
        if padding.upper() not in _PAD_STRINGS:
            raise ValueError(
                f"padding must be one of {_PAD_STRINGS}, an int, or a sequence of {ndim_sp} "
                f"(low, high) pairs; got {padding!r}"
            )
        return padding.upper()
    if isinstance(padding, int) and not isinstance(padding, bool):
        return tuple((padding, padding) for _ in range(ndim_sp))
    try:
        pads = list(padding)
    except TypeError:
        raise ValueError(f"padding must be a string, an int or a sequence, got {padding!r}")
    if len(pads) != ndim_sp:
        raise ValueError(
            f"padding needs one entry per spatial dimension ({ndim_sp}), got {padding!r}"
        )
    out = []
    for p in pads:
        if isinstance(p, int) and not isinstance(p, bool):
            out.append((p, p))
        else:
            try:
                lo, hi = p
                out.append((int(lo), int(hi)))
            except (TypeError, ValueError):
                raise ValueError(
                    f"each padding entry must be an int or a (low, high) pair, got {p!r}"
                ) from None
    return tuple(out)


# ----------------------------------------------------------------------- friendly API
def _promote(x, w, b, name):
    check_float(f"{name}: x", x)
    check_float(f"{name}: w", w)
    if b is not None:
        check_float(f"{name}: b", b)
    dt = jnp.result_type(x, w) if b is None else jnp.result_type(x, w, b)
    x = jnp.asarray(x, dt)
    w = jnp.asarray(w, dt)
    b = None if b is None else jnp.asarray(b, dt)
    return x, w, b


def dense(x, w, b=None, *, precision=None):
    """``y = x @ w + b`` over the last axis of ``x``; ``w`` has shape ``(in, out)``.

    Stores ``x`` only if ``w`` is differentiated and ``w`` only if ``x`` is; ``b`` needs
    nothing.
    """
    x, w, b = _promote(x, w, b, "dense")
    if jnp.ndim(w) != 2:
        raise ValueError(f"dense: w must be 2-D (in, out), got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(
            f"dense: last axis of x {jnp.shape(x)} must equal w.shape[0] {jnp.shape(w)}")
    if b is not None and jnp.shape(b) != (jnp.shape(w)[1],):
        raise ValueError(f"dense: b must have shape ({jnp.shape(w)[1]},), got {jnp.shape(b)}")
    y = dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    if b is not None:
        y = y + b
    return y


def _tuple(v, n, what):
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    v = tuple(v)
    if len(v) != n or not all(isinstance(i, int) and i >= 1 for i in v):
        raise ValueError(f"{what} must be a positive int or {n} positive ints, got {v!r}")
    return v


def _conv_dn(nsp: int):
    sp = "DHW"[-nsp:] if nsp <= 3 else None
    if sp is None:
        raise ValueError(f"conv supports 1, 2 or 3 spatial dimensions, got {nsp}")
    return lax.conv_dimension_numbers(
        (1,) * (nsp + 2), (1,) * (nsp + 2), ("N" + sp + "C", sp + "IO", "N" + sp + "C"))


def conv(x, w, b=None, *, strides: int | Sequence[int] = 1, padding: Any = "SAME",
         dilation: int | Sequence[int] = 1, input_dilation: int | Sequence[int] = 1,
         feature_group_count: int = 1, precision=None):
    """N-D convolution (1/2/3 spatial dims) in Flax layout: ``x`` is ``(N, *spatial, Cin)``,
    ``w`` is ``(*kernel, Cin // groups, Cout)``, ``b`` is ``(Cout,)``.

    ``padding``: ``'SAME'``, ``'VALID'``, ``'SAME_LOWER'``, an int, or one int / ``(lo, hi)``
    pair per spatial dimension. Stores ``x`` only if ``w`` is differentiated and ``w`` only
    if ``x`` is.
    """
    x, w, b = _promote(x, w, b, "conv")
    nsp = jnp.ndim(x) - 2
    if nsp not in (1, 2, 3):
        raise ValueError(f"conv: x must be (N, *spatial, C) with 1-3 spatial dims, got shape "
                         f"{jnp.shape(x)}")
    if jnp.ndim(w) != nsp + 2:
        raise ValueError(f"conv: w must have {nsp + 2} dims (*kernel, Cin/groups, Cout), got "
                         f"{jnp.shape(w)}")
    if jnp.shape(x)[-1] != jnp.shape(w)[-2] * feature_group_count:
        raise ValueError(
            f"conv: x has {jnp.shape(x)[-1]} channels but w expects "
            f"{jnp.shape(w)[-2]} x feature_group_count={feature_group_count}")
    y = conv_general_dilated(
        x, w, _tuple(strides, nsp, "strides"), padding,
        lhs_dilation=_tuple(input_dilation, nsp, "input_dilation"),
        rhs_dilation=_tuple(dilation, nsp, "dilation"),
        dimension_numbers=_conv_dn(nsp), feature_group_count=feature_group_count,
        precision=precision)
    if b is not None:
        y = y + b
    return y


def conv_transpose(x, w, b=None, *, strides: int | Sequence[int] = 1, padding: Any = "SAME",
                   dilation: int | Sequence[int] = 1, transpose_kernel: bool = False,
                   precision=None):
    """Transposed convolution with the semantics of ``lax.conv_transpose`` (Flax layout).

    ``x`` is ``(N, *spatial, Cin)``, ``w`` is ``(*kernel, Cin, Cout)`` (or ``Cout, Cin`` when
    ``transpose_kernel``). Stores ``x`` only if ``w`` is differentiated, ``w`` only if ``x`` is.
    """
    x, w, b = _promote(x, w, b, "conv_transpose")
    nsp = jnp.ndim(x) - 2
    if nsp not in (1, 2, 3) or jnp.ndim(w) != nsp + 2:
        raise ValueError(f"conv_transpose: x must be (N, *spatial, C) with 1-3 spatial dims "
                         f"and w (*kernel, Cin, Cout); got {jnp.shape(x)} and {jnp.shape(w)}")
    padding = _check_padding(padding, nsp)
    if padding == "SAME_LOWER":
        raise ValueError("conv_transpose: padding must be 'SAME', 'VALID' or explicit pairs")
    cin = jnp.shape(w)[-1] if transpose_kernel else jnp.shape(w)[-2]
    if jnp.shape(x)[-1] != cin:
        raise ValueError(f"conv_transpose: x has {jnp.shape(x)[-1]} channels, w expects {cin}")
    fn = functools.partial(
        lax.conv_transpose,
        strides=_tuple(strides, nsp, "strides"),
        padding=padding,
        rhs_dilation=_tuple(dilation, nsp, "dilation"),
        dimension_numbers=_conv_dn(nsp),
        transpose_kernel=transpose_kernel,
        precision=precision,
    )
    y = bilinear(fn, x, w, name="conv_transpose")
    if b is not None:
        y = y + b
    return y
