"""Pre-norm blocks with two residual dropouts, written the way users write them (LayerNorm
spelled out, ``where(bernoulli(key), y / keep, 0)``): the memory tests of
``jaxmem.selective.dropout`` under ``jaxmem.transform`` on XLA:CPU and the H100 plan."""
from __future__ import annotations

import jax
import jax.numpy as jnp

R, D, H = 512, 128, 512  # rows, residual width, MLP width


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def _drop(k, y):
    return jnp.where(jax.random.bernoulli(k, 0.9, y.shape), y / 0.9, 0)


def loss(ps, x, key):
    """``x + drop(gelu(ln(x) @ w1) @ w2)`` then ``x + drop(ln(x) @ w3)`` per block."""
    for (w1, w2, w3), k in zip(ps, jax.random.split(key, len(ps))):
        k1, k2 = jax.random.split(k)
        x = x + _drop(k1, jax.nn.gelu(_ln(x) @ w1) @ w2)
        x = x + _drop(k2, _ln(x) @ w3)
    return jnp.sum(x ** 2)


def args(depth):
    """Shapes of ``loss``'s arguments for ``depth`` blocks."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return [(s(D, H), s(H, D), s(D, D)) for _ in range(depth)], s(R, D), jax.random.key(0)
