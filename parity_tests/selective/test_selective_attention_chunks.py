"""The attention core query chunk by query chunk (``query_chunk``).

:func:`jaxmem.selective.attention` / ``AttentionSpec(query_chunk=c)`` run both passes ``c``
query rows at a time (:mod:`jaxmem.selective.attention_chunks`). Exact: outputs and gradients
equal the whole core's (and a float64 reference) for every bias, mask and causal layout,
with a chunk that does not divide ``T`` (a remainder chunk), with attention dropout (the same
bits as the whole draw), under ``vmap``, ``lax.scan`` + ``jax.checkpoint``, in bf16. The bytes
are asserted on the H100 plan in ``parity_tests/gpu_plan/test_gpu_plan_attention_chunks.py``."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.selective import attention
from jaxmem.selective.attention import AttentionSpec, attention_core

B, T, S, H, D = 2, 23, 19, 3, 8
RNG = np.random.default_rng()


def _rand(shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def _loss(spec, mask=None, key=None):
    """A sum of positive terms (``exp(sin(o))`` is in ``[1/e, e]``), so the loss is as well
    conditioned as its terms: a sum that can cancel to near zero (``o cos o``) is compared
    at its own tiny magnitude, where summation order alone exceeds ``rtol``."""
    def f(q, k, v, bias):
        o = attention_core(q, k, v, bias=bias, mask=mask, rng=key, spec=spec)
        return jnp.sum(jnp.exp(jnp.sin(o)))
    return f


def _close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=rtol, atol=rtol * scale)


LAYOUTS = {
    "plain": (None, None, None),
    "bias rows": ((B, 1, T, S), None, None),        # a per-row bias: its gradient by rows
    "bias per key": ((1, H, 1, S), None, None),     # no query axis: summed over chunks
    "padding mask": (None, (B, 1, 1, S), None),
    "full mask + causal": (None, (B, H, T, S), "bottom_right"),
    "bias + top-left causal": ((B, H, T, S), None, "top_left"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("chunk", [4, 7, 22])
def test_chunks_equal_the_whole_core(layout, chunk):
    bshape, mshape, causal = LAYOUTS[layout]
    q, k, v = _rand((B, T, H, D)), _rand((B, S, H, D)), _rand((B, S, H, D))
    bias = None if bshape is None else _rand(bshape)
    mask = None if mshape is None else jnp.asarray(RNG.random(mshape) > 0.3)
    whole = AttentionSpec(scale=D ** -0.5, causal=causal)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    args = (q, k, v, bias)
    got = jax.jit(jax.value_and_grad(
        _loss(dataclasses.replace(whole, query_chunk=chunk), mask), argnums))(*args)
    want = jax.jit(jax.value_and_grad(_loss(whole, mask), argnums))(*args)
    _close(got, want)
    with jax.enable_x64():
        args64 = tuple(None if a is None else a.astype(jnp.float64) for a in args)
        ref = jax.value_and_grad(_loss(whole, mask), argnums)(*args64)
    _close(got, jax.tree.map(lambda a: a.astype(jnp.float32), ref), rtol=1e-4)


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "per-head"])
def test_dropout_draws_the_same_bits(broadcast):
    q, k, v = _rand((B, T, H, D)), _rand((B, S, H, D)), _rand((B, S, H, D))
    key = jax.random.key(int(RNG.integers(1 << 30)))
    whole = AttentionSpec(scale=D ** -0.5, dropout_rate=0.3, broadcast_dropout=broadcast)
    got = jax.value_and_grad(_loss(dataclasses.replace(whole, query_chunk=5), key=key),
                             (0, 1, 2))(q, k, v, None)
    want = jax.value_and_grad(_loss(whole, key=key), (0, 1, 2))(q, k, v, None)
    _close(got, want)


def test_public_attention_vmap_scan_checkpoint_bf16():
    q, k, v = _rand((2, B, T, H, D)), _rand((2, B, T, H, D)), _rand((2, B, T, H, D))

    def loss(chunk):
        def one(q, k, v):
            return attention(q, k, v, causal=True, query_chunk=chunk)

        def layer(x, qkv):
            return x + jnp.sum(jax.vmap(one)(*qkv) ** 2), None
        return lambda q, k, v: jax.lax.scan(jax.checkpoint(layer), 0.0, (q, k, v))[0]

    args = (q, k, v)
    _close(jax.jit(jax.grad(loss(6), (0, 1, 2)))(*args),
           jax.jit(jax.grad(loss(None), (0, 1, 2)))(*args))
    half = tuple(a.astype(jnp.bfloat16) for a in args)
    got = jax.grad(loss(6), (0, 1, 2))(*half)
    want = jax.grad(loss(None), (0, 1, 2))(*half)
    assert all(a.dtype == jnp.bfloat16 for a in got)
    _close(got, want, rtol=3e-2)


def test_bad_chunks_are_refused():
    q = _rand((B, T, H, D))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="query_chunk must be None or an int >= 1"):
            attention(q, q, q, query_chunk=bad)
