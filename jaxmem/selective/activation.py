"""Piecewise-linear activations that keep a 1-bit packed mask for the backward pass.

For an activation ``y = phi(x)`` that is piecewise linear with slopes ``a`` (on a region
``M``) and ``c`` (elsewhere), ``dL/dx = g * where(M, a, c)``: the region indicator ``M`` is
all the backward pass needs. It is stored packed, 8 elements per byte (``bits.pack_bits``,
1/8 B per element instead of the 5 B ``jax.nn.relu`` keeps in f32), and only when ``x`` is
differentiated.

The regions replicate ``jax.nn``'s derivative conventions at the kinks exactly:

==============  ======================  ============================
function        ``M`` (slope 1)         slope outside ``M``
==============  ======================  ============================
relu            ``x > 0``               0
leaky_relu      ``x >= 0``              ``negative_slope``
relu6           ``0 < x < 6``           0
hard_tanh       ``-1 <= x <= 1``        0
==============  ======================  ============================
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from jaxmem.selective._core import check_float, is_zero, tag
from jaxmem.selective.bits import pack_bits, unpack_bits

__all__ = ["hard_tanh", "leaky_relu", "relu", "relu6"]

# The originals, bound at import: the Flax glue patches jax.nn.relu & co. inside its scope.
_jnn_relu, _jnn_relu6, _jnn_hard_tanh = jax.nn.relu, jax.nn.relu6, jax.nn.hard_tanh


def _region(kind: str, x):
    if kind == "relu":
        return x > 0
    if kind == "leaky_relu":
        return x >= 0
    if kind == "relu6":
        return (x > 0) & (x < 6)
    if kind == "hard_tanh":
        return (x >= -1) & (x <= 1)
    raise AssertionError(kind)


def _apply(kind: str, slope, x):
    if kind == "relu":
        return _jnn_relu(x)
    if kind == "leaky_relu":
        return jnp.where(x >= 0, x, slope * x).astype(x.dtype)
    if kind == "relu6":
        return _jnn_relu6(x)
    if kind == "hard_tanh":
        return _jnn_hard_tanh(x)
    raise AssertionError(kind)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _masked(kind, slope, x):
    return _apply(kind, slope, x)


def _masked_fwd(kind, slope, x):
    y = _apply(kind, slope, x.value)
    res = tag(pack_bits(_region(kind, x.value)), kind + ".mask") if x.perturbed else None
    return y, (res,)


def _masked_bwd(kind, slope, res, g):
    (packed,) = res
    if packed is None or is_zero(g):
        return (None,)
    m = unpack_bits(packed, g.shape)
    other = jnp.zeros((), g.dtype) if kind != "leaky_relu" else g * jnp.asarray(slope, g.dtype)
    return (jnp.where(m, g, other),)


_masked.defvjp(_masked_fwd, _masked_bwd, symbolic_zeros=True)


def _call(kind, x, slope=0.0):
    check_float(f"{kind}: x", x)
    return _masked(kind, slope, jnp.asarray(x))


def relu(x):
    """``max(x, 0)``; backward keeps ``pack_bits(x > 0)`` (1/8 B per element)."""
    return _call("relu", x)


def leaky_relu(x, negative_slope: float = 1e-2):
    """``where(x >= 0, x, negative_slope * x)``; backward keeps ``pack_bits(x >= 0)``."""
    if not isinstance(negative_slope, numbers.Real) or isinstance(negative_slope, bool):
        raise TypeError(f"leaky_relu: negative_slope must be a Python float, got "
                        f"{type(negative_slope).__name__} {negative_slope!r}")
    return _call("leaky_relu", x, float(negative_slope))


def relu6(x):
    """``min(max(x, 0), 6)``; backward keeps ``pack_bits(0 < x < 6)``."""
    return _call("relu6", x)


def hard_tanh(x):
    """``clip(x, -1, 1)``; backward keeps ``pack_bits(-1 <= x <= 1)``."""
    return _call("hard_tanh", x)
