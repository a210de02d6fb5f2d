"""Shared helpers for the rowconv tests (not a test module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem import rowconv as rc


def random_params(layers, shape, seed=0, dtype=jnp.float32):
    """init + a random perturbation so biases / BN stats / scales are not trivial."""
    params = rc.init(layers, jax.random.PRNGKey(seed), shape, dtype)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), max(1, len(leaves)))
    new = []
    for k, p in zip(keys, leaves):
        r = 0.2 * jax.random.normal(k, p.shape, p.dtype)
        new.append(p + r)
    params = jax.tree.unflatten(tree, new)
    return _fix_bn(layers, params)


def _fix_bn(layers, params):
    out = []
    for layer, p in zip(layers, params):
        if isinstance(layer, rc.BatchNorm):
            p = dict(p, var=jnp.abs(p["var"]) + 0.5)
        elif isinstance(layer, rc.Residual):
            p = {"branch": _fix_bn(layer.branch, p["branch"]),
                 "shortcut": _fix_bn(layer.shortcut or [], p["shortcut"])}
        out.append(p)
    return out


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

