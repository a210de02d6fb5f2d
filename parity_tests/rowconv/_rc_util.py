"""Shared helpers for the rowconv tests (not a test module)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import rowconv as rc


def random_params(layers, shape, seed=0, dtype=jnp.float32):
    """Parameters distributed as ``rc.init``'s plus a N(0, 0.2^2) perturbation, so biases /
    BN stats / scales are not trivial: kernels N(0, 1/fan_in), scales 1, biases and means 0,
    BN variances |1 + noise| + 0.5 (positive).

    The tree (names, shapes, dtypes) is ``rc.init``'s, traced abstractly; the values are drawn
    with NumPy and put on the device, so no program is compiled per parameter shape."""
    tree = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(seed), shape, dtype))
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = path[-1].key
        if name == "kernel":
            base = rng.normal(size=s.shape) / math.sqrt(math.prod(s.shape[:-1]))
        elif name in ("scale", "var"):
            base = np.ones(s.shape)
        else:
            base = np.zeros(s.shape)
        v = base + 0.2 * rng.normal(size=s.shape)
        if name == "var":
            v = np.abs(v) + 0.5
        return jnp.asarray(np.asarray(v, s.dtype))

    return jax.tree_util.tree_map_with_path(leaf, tree)


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
