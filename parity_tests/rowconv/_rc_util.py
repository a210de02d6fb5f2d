"""Shared helpers for the rowconv tests (not a test module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import rowconv as rc


def normal(shape, seed=1, dtype=jnp.float32):
    """A standard-normal array drawn with NumPy (no compiled program per shape)."""
    return jnp.asarray(np.asarray(np.random.default_rng(seed).normal(size=shape), dtype))


def loss_fn(layers, rows, mode, rows_bp=None, rng=None):
    """A weighted sum of the stack's output, and the output (``has_aux``)."""
    def loss(params, x):
        y = rc.apply(layers, params, x, rows=rows, mode=mode, rows_bp=rows_bp, rng=rng)
        w = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37)
        return jnp.sum(y * w), y
    return loss


def value_and_grads(layers, params, x, rows, mode="overlap", rows_bp=None, rng=None):
    """``(y, (loss, (param grads, input grad)))`` from one jitted program (one compile)."""
    f = jax.jit(jax.value_and_grad(loss_fn(layers, rows, mode, rows_bp, rng), (0, 1),
                                   has_aux=True))
    (loss, y), grads = f(params, x)
    return y, (loss, grads)
