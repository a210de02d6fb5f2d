"""The attention core in query chunks forms ``(..., H, c, S)`` at a time on the H100 plan.

Unchunked, the exact core keeps no ``T x S`` array between the passes, but each pass forms
several at once (scores, weights, their cotangents): at ``T = S = 1024``, 2 x 4 heads, float32,
each is 32 MiB and the compiled temp of the core's gradient is two of them (three with
dropout). With ``query_chunk=128`` (:mod:`jaxmem.selective.attention_chunks`) the temp is at
most a third of that, with and without attention dropout (whose per-chunk rows of the whole
draw must not bring a whole ``T x S`` mask back); measured 66.0 -> 16.6 MiB and
106.0 -> 17.6 MiB."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from _gp_util import plan

from jaxmem.selective.attention import AttentionSpec, attention_core

B, T, H, D = 2, 1024, 4, 64


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_query_chunks_bound_the_working_set(dropout):
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    mask = jax.ShapeDtypeStruct((B, 1, 1, T), jnp.bool_)
    whole = AttentionSpec(scale=D ** -0.5, dropout_rate=dropout, broadcast_dropout=False)

    def temp(spec):
        def loss(q, k, v, m):
            o = attention_core(q, k, v, mask=m, rng=jax.random.key(0), spec=spec)
            return jnp.sum(o ** 2)
        return plan(jax.grad(loss, (0, 1, 2)), x, x, x, mask).temp_bytes

    scores = B * H * T * T * 4
    unchunked = temp(whole)
    chunked = temp(dataclasses.replace(whole, query_chunk=128))
    assert unchunked >= 2 * scores, unchunked / 2**20
    assert chunked <= unchunked / 3, (chunked / 2**20, unchunked / 2**20)
