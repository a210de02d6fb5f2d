"""Max pooling that keeps the packed argmax position inside each window.

``y[o] = max_{k in window} xp[s * o + k]`` (``xp``: ``x`` padded with ``-inf``). The
gradient sends ``g[o]`` to the first (row-major) window position ``k*(o)`` that attains the
maximum -- the same tie-breaking as XLA's ``select_and_scatter_add`` that JAX's autodiff uses:

    dL/dxp[i] = sum_{o, k : s * o + k = i, k = k*(o)} g[o]

So the backward pass needs ``k*(o)``, an integer below ``prod(window)``, per *output*
element, instead of the whole input that JAX keeps. It is stored packed along the channel
axis (:mod:`jaxmem._prims.bitpack`) in the fewest of 1/2/4/8 bits that hold it (4 bits for a
3x3 window: 1/32 B per input element at stride 2, versus 4 B for the f32 input).  The packed
codes keep the output's leading axes and, under a mesh in context, are packed in
``blocks = shard_blocks(C, bits)`` blocks of the channel axis, so channels split over devices
pack and unpack on their own shard (no collective); ``blocks`` is fixed when the op is called.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxmem._prims.bitpack import pack, shard_blocks, unpack
from jaxmem.selective._core import as_int, check_float, int_tuple, is_zero, tag

__all__ = ["max_pool"]


def _nbits(positions: int) -> int:
    for b in (1, 2, 4, 8):
        if positions <= 2**b:
            return b
    raise ValueError(f"max_pool: windows with more than 256 positions are not supported "
                     f"(got {positions})")


def _reduce(x, window, strides, pads):
    # ``-inf`` as a Python float: ``lax.reduce_window`` recognises a constant identity and
    # uses ``reduce_window_max`` (differentiable, so grad-of-grad works under ``jit``); a
    # ``jnp`` array is a tracer under ``jit`` and selects the generic, non-differentiable
    # ``reduce_window``.
    return lax.reduce_window(x, -jnp.inf, lax.max, (1,) + window + (1,), (1,) + strides + (1,),
                             ((0, 0),) + pads + ((0, 0),))


def _window_slices(xp, window, strides, out_sp):
    """Yield (flat index, strided slice of xp aligned with the output) per window offset."""
    for idx, off in enumerate(itertools.product(*[range(w) for w in window])):
        start = (0,) + off + (0,)
        limit = (xp.shape[0],) + tuple(
            o + s * (n - 1) + 1 for o, s, n in zip(off, strides, out_sp)) + (xp.shape[-1],)
        yield idx, off, lax.slice(xp, start, limit, (1,) + strides + (1,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _max_pool(window, strides, pads, blocks, x):
    return _reduce(x, window, strides, pads)


def _max_pool_fwd(window, strides, pads, blocks, x):
    xv = x.value
    y = _reduce(xv, window, strides, pads)
    if not x.perturbed:
        return y, (None, None)
    if y.size == 0:  # nothing to route: the gradient is zero
        return y, (jnp.zeros((0,), jnp.uint8), _Shape((xv.shape, xv.dtype, y.shape)))
    xp = jnp.pad(xv, ((0, 0),) + pads + ((0, 0),), constant_values=-jnp.inf)
    positions = math.prod(window)
    code = jnp.zeros(y.shape, jnp.uint8)
    hits = list(_window_slices(xp, window, strides, y.shape[1:-1]))
    for idx, _, sl in reversed(hits):  # reversed: the first matching position wins
        code = jnp.where(sl == y, jnp.uint8(idx), code)
    packed = tag(pack(code, _nbits(positions), blocks), "max_pool.argmax")
    return y, (packed, _Shape((xv.shape, xv.dtype, y.shape)))


class _Shape:
    def __init__(self, v):
        self.v = v


jax.tree_util.register_pytree_node(_Shape, lambda s: ((), s.v), lambda v, _: _Shape(v))


def _max_pool_bwd(window, strides, pads, blocks, res, g):
    packed, meta = res
    if packed is None or is_zero(g):
        return (None,)
    x_shape, x_dtype, y_shape = meta.v
    if math.prod(y_shape) == 0:
        return (jnp.zeros(x_shape, x_dtype),)
    code = unpack(packed, _nbits(math.prod(window)), y_shape, blocks)
    nsp = len(window)
    out_sp = y_shape[1:-1]
    xp_sp = tuple(n + lo + hi for n, (lo, hi) in zip(x_shape[1:-1], pads))
    # Stride-phase decomposition: padded position p = s*o + k lies in phase a = k mod s at
    # phase index q = o + k // s. Each phase's gradient is a sum of output-sized arrays
    # shifted by k // s (plain pads, which XLA fuses); interleaving the phases gives dxp.
    qlen = tuple(-(-L // st) for L, st in zip(xp_sp, strides))
    zero = jnp.zeros((), g.dtype)
    phases = {}
    for idx, off in enumerate(itertools.product(*[range(w) for w in window])):
        contrib = jnp.where(code == idx, g, zero)
        cfg = [(0, 0, 0)]
        for k, st, n, q in zip(off, strides, out_sp, qlen):
            cfg.append((k // st, q - n - k // st, 0))
        cfg.append((0, 0, 0))
        ph = tuple(k % st for k, st in zip(off, strides))
        term = lax.pad(contrib, zero, cfg)
        phases[ph] = term if ph not in phases else phases[ph] + term
    full = (y_shape[0],) + qlen + (y_shape[-1],)
    grid = {}
    for ph in itertools.product(*[range(st) for st in strides]):
        grid[ph] = phases.get(ph, jnp.zeros(full, g.dtype))
    # interleave: stack phase axes right after each spatial axis, then merge them.
    def build(prefix):
        d = len(prefix)
        if d == nsp:
            return grid[prefix]
        parts = [build(prefix + (a,)) for a in range(strides[d])]
        return jnp.stack(parts, axis=2 + d)
    inter = build(())
    dxp = inter.reshape((y_shape[0],) + tuple(q * st for q, st in zip(qlen, strides))
                        + (y_shape[-1],))
    start = (0,) + tuple(lo for lo, _ in pads) + (0,)
    dx = lax.slice(dxp, start, tuple(a + n for a, n in zip(start, x_shape)))
    return (dx.astype(x_dtype),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd, symbolic_zeros=True)


def _pads(padding, x_shape, window, strides):
    """``padding`` as one ``(lo, hi)`` int pair per spatial axis (strings resolved)."""
    nsp = len(window)
    msg = (f"max_pool: padding must be 'SAME', 'VALID' or {nsp} (lo, hi) int pairs, got "
           f"{padding!r}")
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(msg)
        return tuple(tuple(int(v) for v in p) for p in
                     lax.padtype_to_pads(x_shape[1:-1], window, strides, padding.upper()))
    try:
        pairs = [tuple(p) for p in padding]
    except TypeError:
        raise ValueError(msg) from None
    pads = tuple(tuple(as_int(v) for v in p) for p in pairs)
    if len(pads) != nsp or any(len(p) != 2 or None in p for p in pads):
        raise ValueError(msg)
    for n, (lo, hi) in zip(x_shape[1:-1], pads):
        if n + lo + hi < 0:
            raise ValueError(f"max_pool: padding {padding!r} crops more than the spatial size "
                             f"{tuple(x_shape[1:-1])} (padded sizes must be >= 0)")
    return pads


def max_pool(x: ArrayLike, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = "VALID") -> jax.Array:
    """Max pooling with Flax semantics: ``x`` is ``(N, *spatial, C)``, the window covers the
    spatial axes, ``strides`` default to 1 (as ``flax.linen.max_pool``); ``padding`` is
    ``'VALID'``, ``'SAME'`` or one ``(lo, hi)`` pair per spatial axis (padded with ``-inf``;
    negative values crop). Backward keeps only the packed argmax positions.
    """
    check_float("max_pool: x", x)
    x = jnp.asarray(x)
    nsp = x.ndim - 2
    if nsp < 1:
        raise ValueError(f"max_pool: x must be (N, *spatial, C), got shape {x.shape}")
    window = int_tuple("max_pool", "window_shape", window_shape, nsp)
    # flax: ``strides = strides or (1,) * n`` (so ``None`` and ``()`` mean stride 1)
    strides = (1,) * nsp if strides is None or (not isinstance(strides, int) and not
                                                  len(tuple(strides))) else strides
    strides = int_tuple("max_pool", "strides", strides, nsp)
    pads = _pads(padding, x.shape, window, strides)
    _nbits(math.prod(window))
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        # a negative pad crops: pad / crop outside the custom rule (``lax.pad``'s gradient is
        # a slice and stores nothing), then pool the padded array without padding.
        cfg = ((0, 0, 0),) + tuple((lo, hi, 0) for lo, hi in pads) + ((0, 0, 0),)
        x = lax.pad(x, jnp.array(-jnp.inf, x.dtype), cfg)
        pads = ((0, 0),) * nsp
    blocks = shard_blocks(x.shape[-1], _nbits(math.prod(window)))
    return _max_pool(window, strides, pads, blocks, x)
