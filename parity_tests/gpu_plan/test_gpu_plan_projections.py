"""Queries, keys and values recomputed from their projection (H100 plan).

``jaxmem.transform(..., projections=True)`` (the default) lets the exact attention core keep
the layer norm's residuals and the projection weights instead of ``q, k, v``. On XLA:GPU the
recomputation must survive fusion and GEMM merging (XLA merges the three projections of one
input into one GEMM): the stored bytes of a three-layer pre-LN attention stack drop by at
least half of ``q, k, v`` per layer (measured: 31.3 -> 28.3 MiB with three projections,
27.7 -> 21.7 MiB with one split three ways)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gp_util import plan

from jaxmem.transform import transform

B, T, D, HEADS, LAYERS = 8, 256, 64, 4, 3


def _ln(x, g, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _loss(fused):
    def loss(params, x):
        for p in params:
            h = _ln(x, p["g"], p["b"])
            if fused:
                q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
            else:
                q, k, v = (h @ p["w" + n] + p["b" + n] for n in "qkv")
            q, k, v = (a.reshape(B, T, HEADS, -1) for a in (q, k, v))
            q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
            s = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, D) @ p["wo"]
        return jnp.sum(x ** 2)
    return loss


def _params():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / 8, jnp.float32)
    def one():
        p = {"g": 1 + f(D), "b": f(D), "wqkv": f(D, 3 * D), "wo": f(D, D)}
        for n in "qkv":
            p["w" + n], p["b" + n] = f(D, D), f(D)
        return p
    return [one() for _ in range(LAYERS)]


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_q_k_v_not_kept_on_the_h100_plan(fused):
    loss, params = _loss(fused), _params()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
    on = plan(jax.grad(transform(loss)), params, x).temp_bytes
    off = plan(jax.grad(transform(loss, projections=False)), params, x).temp_bytes
    qkv = 3 * B * T * D * 4
    assert off - on >= LAYERS * qkv / 2, (off / 2**20, on / 2**20)
