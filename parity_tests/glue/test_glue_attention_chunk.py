"""``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` with ``attention_chunk``: the exact
attention run a few query rows at a time keeps the untouched model's loss and gradients,
holds fewer bytes in its backward, is part of what ``jit`` caches on, and rejects bad values."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem.measure import compiled_memory
from jaxmem.models import gpt


def _case(seed=0):
    m = gpt(n_layer=2, d_model=64, n_head=4, ctx=64)
    tok = jax.random.randint(jax.random.key(seed), (4, 64), 0, 256)
    return m, tok, m.init(jax.random.key(seed + 1), tok)


def _loss(model):
    def loss(v, tok):
        lg = model.apply(v, tok)
        return -jnp.mean(jax.nn.log_softmax(lg)[..., 0])
    return loss


def _max_rel(a, b):
    """Largest gradient difference over the largest gradient entry (a leaf whose exact
    gradient is zero, such as an attention key bias, is compared at that scale too)."""
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(a))
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b))) / scale


@pytest.mark.parametrize("chunk", [24])   # two chunks of 24 rows and a remainder of 16
def test_linen_attention_chunk_exact(chunk):
    m, tok, v = _case()
    tok2 = jax.random.randint(jax.random.key(7), tok.shape, 0, 256)
    l0, g0 = jax.jit(jax.value_and_grad(_loss(m)))(v, tok2)
    conv = jaxmem.linen.convert(m, attention_chunk=chunk)
    l1, g1 = jax.jit(jax.value_and_grad(_loss(conv)))(v, tok2)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert _max_rel(g0, g1) < 1e-5


def test_linen_attention_chunk_keeps_fewer_bytes():
    m, tok, v = _case()
    whole = compiled_memory(jax.grad(_loss(jaxmem.linen.convert(m, attention_chunk=None))),
                            v, tok).temp_bytes
    chunked = compiled_memory(jax.grad(_loss(jaxmem.linen.convert(m, attention_chunk=8))),
                              v, tok).temp_bytes
    # the (4, 4, 64, 64) float32 scores and their cotangent (256 KiB each) are formed 8 rows
    # at a time instead
    assert chunked < whole


def test_attention_chunk_is_part_of_the_jit_key():
    m, tok, v = _case()
    a = jaxmem.linen.convert(m, attention_chunk=None)
    b = jaxmem.linen.convert(m, attention_chunk=16)
    ja = jax.jit(jax.grad(_loss(a))).lower(v, tok).as_text()
    jb = jax.jit(jax.grad(_loss(b))).lower(v, tok).as_text()
    assert "while" not in ja and "while" in jb   # the chunks run as a scan


def test_nnx_attention_chunk_exact():
    rngs = nnx.Rngs(0)
    attn = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32,
                                  decode=False, rngs=rngs)
    x = jax.random.normal(jax.random.key(3), (2, 48, 32))

    def loss(mod, x):
        return jnp.sum(jnp.tanh(mod(x, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))))

    g0 = nnx.grad(loss)(attn, x)
    conv = jaxmem.nnx.convert(attn, attention_chunk=16)
    g1 = nnx.grad(loss)(conv, x)
    assert _max_rel(nnx.state(g0, nnx.Param), nnx.state(g1, nnx.Param)) < 1e-5


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_bad_attention_chunk(bad):
    m, _, _ = _case()
    with pytest.raises(ValueError, match="attention_chunk must be None or an int >= 1"):
        jaxmem.linen.convert(m, attention_chunk=bad)
