"""Dropout that stores only its PRNG key for the backward pass.

``y = where(m, x / p, 0)`` with ``m ~ Bernoulli(p)``, ``p = 1 - rate`` (Flax's arithmetic,
``jax.random.bernoulli(key, p, shape)``). ``dL/dx = where(m, g / p, 0)``: the mask is a
deterministic function of the key, so the backward pass regenerates it from the key (a few
bytes) instead of keeping a mask or the scaled input. In the backward pass the key is tied
(``ties.tie``) to the cotangent, so XLA does not merge that draw with the forward's (which
would keep the forward's mask after all). Known costs on XLA:CPU: a chain of dropouts
separated by elementwise ops only satisfies the tie early (it reads one element) and keeps
8 B per element per layer; with a convolution between them XLA:CPU draws every layer's
forward bits at the start of the step (8 B per element per layer; tying the forward's key to
the input removed that but cost scanned models 2 points of their CPU plan).
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxmem._prims.ties import tie
from jaxmem.selective._core import check_float, is_zero, tag

__all__ = ["dropout"]


def _mask(key, keep, shape, bshape):
    return jnp.broadcast_to(jax.random.bernoulli(key, p=keep, shape=bshape), shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dropout(keep, bshape, key, x):
    m = _mask(key, keep, x.shape, bshape)
    return lax.select(m, x / keep, jnp.zeros_like(x))


def _dropout_fwd(keep, bshape, key, x):
    m = _mask(key.value, keep, x.value.shape, bshape)
    y = lax.select(m, x.value / keep, jnp.zeros_like(x.value))
    res = tag(key.value, "dropout.key") if x.perturbed else None
    return y, (res,)


def _dropout_bwd(keep, bshape, res, g):
    (key,) = res
    if key is None or is_zero(g):
        return None, None
    # the key tied to ``g``: left untied, the regenerated mask is the very computation of the
    # forward's, and XLA (CPU and GPU) merges the two (CSE), keeping the forward's mask alive
    # until the backward pass (1 B/element: measured, 8 such masks in an HF GPT-2 step's peak)
    m = _mask(tie(key, g), keep, g.shape, bshape)
    return None, lax.select(m, g / keep, jnp.zeros_like(g))


_dropout.defvjp(_dropout_fwd, _dropout_bwd, symbolic_zeros=True)


def dropout(key: jax.Array, x: ArrayLike, rate: float, *, deterministic: bool = False,
            broadcast_dims: Sequence[int] = ()) -> jax.Array:
    """Inverted dropout of ``x`` with drop probability ``rate`` (Flax ``nn.Dropout`` math).

    ``broadcast_dims``: axes along which the same mask is shared. With
    ``deterministic=True`` or ``rate == 0`` this is the identity; ``rate == 1`` gives zeros.
    """
    check_float("dropout: x", x)
    if (not isinstance(rate, numbers.Real) or isinstance(rate, (bool, np.bool_))
            or not 0.0 <= rate <= 1.0):
        raise ValueError(f"dropout: rate must be a Python float in [0, 1], got {rate!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"dropout: deterministic must be a Python bool (it selects the code "
                        f"path at trace time), got {deterministic!r}")
    x = jnp.asarray(x)
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    bshape = list(x.shape)
    for d in broadcast_dims:
        if not isinstance(d, int) or not -x.ndim <= d < x.ndim:
            raise ValueError(f"dropout: broadcast_dims must be axes of x (ndim {x.ndim}), got "
                             f"{tuple(broadcast_dims)!r}")
        bshape[d] = 1
    return _dropout(1.0 - float(rate), tuple(bshape), key, x)
