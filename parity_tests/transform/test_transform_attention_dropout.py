"""Flax's attention dropout inside an attention subgraph: the mask's recipe is recognised
and the memory-lean attention regenerates the very same mask from the key (equal values
and gradients)."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

B, T, H, D = 2, 32, 2, 4


def _qkv():
    return normal((B, T, H, D)), normal((B, T, H, D)), normal((B, T, H, D))


@pytest.mark.parametrize("broadcast", [True, False])
def test_attention_dropout_regenerates_the_same_mask(broadcast):
    q, k, v = _qkv()

    def f(q, k, v, key):
        o = nn.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.2,
                                     deterministic=False, broadcast_dropout=broadcast)
        return jnp.sum(o ** 2)

    key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
    g = transform(f)
    row, = g.report(q, k, v, key).by_kind("attention")
    assert row.converted and "dropout" in row.matched
    close(jax.jit(g)(q, k, v, key), jax.jit(f)(q, k, v, key), rtol=1e-5)
    close(jax.jit(jax.grad(g, (0, 1, 2)))(q, k, v, key),
          jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v, key), rtol=1e-4, atol=1e-5)


def test_legacy_uint32_key_and_a_different_key_differ():
    q, k, v = _qkv()

    def f(q, k, v, key):
        return jnp.sum(nn.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.5,
                                                deterministic=False) ** 2)

    g = jax.jit(transform(f))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    close(g(q, k, v, k1), jax.jit(f)(q, k, v, k1), rtol=1e-5)
    assert not np.allclose(g(q, k, v, k1), g(q, k, v, k2))   # the mask follows the key
