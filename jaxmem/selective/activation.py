"""Piecewise-linear activations that keep a 1-bit packed mask for the backward pass.

For an activation ``y = phi(x)`` that is piecewise linear with slopes ``1`` (on a region
``M``) and ``c`` (elsewhere), ``dL/dx = g * where(M, 1, c)``: the region indicator ``M`` is
all the backward pass needs. It is stored packed, 8 elements per byte (1/8 B per element
instead of the 5 B ``jax.nn.relu`` keeps in f32), and only when ``x`` is differentiated.

The regions replicate ``jax.nn``'s derivative conventions at the kinks exactly (``relu``:
``x > 0``; ``leaky_relu``: ``x >= 0``; ``relu6``: ``0 < x < 6``; ``hard_tanh``:
``-1 <= x <= 1``; the table is in :mod:`jaxmem._prims.mask`).

One implementation serves the library (:mod:`jaxmem._prims.mask`): ``jaxmem.fewbit.relu``,
``relu6`` and ``hard_tanh`` are these very functions.  The mask residual is tagged
``jaxmem.selective.<name>.mask``.
"""
from __future__ import annotations

import numbers

import jax

from jaxmem._prims import mask as _mask
from jaxmem._prims.mask import hard_tanh, relu, relu6

__all__ = ["hard_tanh", "leaky_relu", "relu", "relu6"]


def leaky_relu(x: jax.Array, negative_slope: float = 1e-2) -> jax.Array:
    """``where(x >= 0, x, negative_slope * x)``; backward keeps ``pack_bits(x >= 0)``.

    ``negative_slope`` is a Python float here (a constant of the model); for a traced or
    per-channel slope use :func:`jaxmem.fewbit.leaky_relu`, the same op with array slopes.
    """
    if not isinstance(negative_slope, numbers.Real) or isinstance(negative_slope, bool):
        raise TypeError(f"leaky_relu: negative_slope must be a Python float, got "
                        f"{type(negative_slope).__name__} {negative_slope!r}")
    return _mask.leaky_relu(x, negative_slope)
