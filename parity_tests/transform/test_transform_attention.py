"""Attention subgraphs (Flax's ``dot_product_attention``, hand-written einsum + softmax,
scale / bias / mask, either operand order of the last product) become the exact
memory-lean attention: equal values and gradients, no ``T x S`` residual."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

B, T, H, D = 2, 32, 2, 4


def _qkv():
    return normal((B, T, H, D)), normal((B, T, H, D)), normal((B, T, H, D))


def _mask():
    m = np.random.default_rng().random((B, 1, T, T)) < 0.7
    m[..., 0] = True
    return jnp.asarray(m)


def flax_plain(q, k, v):
    return nn.dot_product_attention(q, k, v)


def flax_mask_bias(q, k, v, mask, bias):
    return nn.dot_product_attention(q, k, v, mask=mask, bias=bias)


def einsum_scaled(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def causal_where(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.5
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhts,bshd->bhtd", jax.nn.softmax(s, axis=-1), v)


def manual_softmax(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k)
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    p = e / e.sum(-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def head_factor(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k)
    p = jax.nn.softmax(s, axis=-1) * jnp.array([1.0, 0.0])[None, :, None, None]
    return jnp.einsum("bhts,bshd->bthd", p, v)


def head_mask_einsum(q, k, v):
    p = nn.dot_product_attention_weights(q, k)
    p = jnp.einsum("...hqk,h->...hqk", p, jnp.array([1, 0], jnp.int32))
    return jnp.einsum("...hqk,...khd->...qhd", p, v)


def subtracted_mask(q, k, v):
    """DistilBERT's spelling: heads first, ``q`` scaled before ``q @ k^T``, the padding mask
    subtracted as ``1e30 (1 - mask)``."""
    pad = np.ones((B, 1, 1, T), np.float32)
    pad[0, ..., T // 2:] = 0.0
    q, k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))
    s = jnp.matmul(q / np.sqrt(D), jnp.transpose(k, (0, 1, 3, 2)))
    s = s - 1e30 * (1.0 - jnp.asarray(pad))
    return jnp.matmul(jax.nn.softmax(s, axis=-1), v)


def _both_grads(g, f, *args):
    """``grad(g)(*args), grad(f)(*args)``: one compiled program."""
    return jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(f)(*a)))(*args)


CASES = [flax_plain, flax_mask_bias, einsum_scaled, causal_where, manual_softmax,
         head_factor, head_mask_einsum, subtracted_mask]


@pytest.mark.parametrize("chunk", [None, 12], ids=["whole", "chunks"])
@pytest.mark.parametrize("att", CASES, ids=[c.__name__ for c in CASES])
def test_attention_is_matched_and_exact(att, chunk):
    """Whole, and with ``attention_chunk=12`` of ``T = 32`` rows: two query chunks and a
    remainder (the default, 512, leaves ``T = 32`` whole)."""
    q, k, v = _qkv()
    extra = (_mask(), normal((B, H, T, T), scale=0.1)) if att is flax_mask_bias else ()

    def f(q, k, v, *extra):
        return jnp.sum(att(q, k, v, *extra) ** 2)

    g = transform(f) if chunk is None else transform(f, attention_chunk=chunk)
    row, = g.report(q, k, v, *extra).by_kind("attention")
    assert row.converted and "attention_core" in row.became
    assert ("12 of 32 query rows at a time" in row.became) == (chunk == 12), row
    # values and gradients of both sides: one compiled program
    (vg, gg), (vf, gf) = jax.jit(lambda *a: tuple(
        (fn(*a), jax.grad(fn, (0, 1, 2))(*a)) for fn in (g, f)))(q, k, v, *extra)
    close(vg, vf, rtol=1e-5)
    close(gg, gf, rtol=1e-4, atol=1e-5)
    res = residual_bytes(g, q, k, v, *extra, argnums=(0, 1, 2))
    # nothing T x T computed is kept by autodiff: only the bias given (its own size) and
    # boolean masks at their source shape (1 byte, no batch / head axes unless given so)
    tt = [e for e in res.entries if e.shape[-2:] == (T, T) and e.dtype != np.bool_]
    assert sum(e.nbytes for e in tt) == (extra[1].nbytes if extra else 0), tt


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_bias_gradient_is_exact(sign):
    q, k, v = _qkv()
    bias = normal((1, H, T, T), scale=0.1)

    def f(bias, q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k)
        s = s + bias if sign > 0 else s - bias          # ``s - b`` is matched as ``s + (-b)``
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v) ** 2)

    g = transform(f)
    row, = g.report(bias, q, k, v).by_kind("attention")
    assert row.converted and "bias" in row.matched
    close(*_both_grads(g, f, bias, q, k, v), rtol=1e-4, atol=1e-5)


def test_weights_used_elsewhere_are_not_matched():
    q, k, v = _qkv()

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), axis=-1)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", p, v)) + jnp.sum(p ** 3)

    g = transform(f)
    row, = g.report(q, k, v).by_kind("attention")
    assert not row.converted and "used elsewhere" in row.reason
    close(*_both_grads(g, f, q, k, v), rtol=1e-4, atol=1e-5)


def test_attention_in_bfloat16():
    q, k, v = (a.astype(jnp.bfloat16) for a in _qkv())

    def f(q, k, v):
        return jnp.sum(einsum_scaled(q, k, v).astype(jnp.float32) ** 2)

    g = transform(f)
    assert g.report(q, k, v).by_kind("attention")[0].converted
    close(*_both_grads(g, f, q, k, v), rtol=5e-2, atol=5e-2)



def test_attention_chunk_is_checked():
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="attention_chunk must be None or an int >= 1"):
            transform(lambda x: x, attention_chunk=bad)
