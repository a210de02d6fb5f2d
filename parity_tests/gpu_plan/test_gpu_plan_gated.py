"""Gated linear units keep their two projections only on the H100 plan.

``jaxmem.transform`` re-emits ``act(x W) * (x V)`` as :func:`jaxmem.selective.gated_product`
(see ``parity_tests/transform/test_transform_gated.py``). On XLA:GPU the recomputed product
must survive fusion and GEMM merging. XLA:GPU merges the gate and up projections of one
input into one GEMM and keeps its ``[g | u]`` output and the product ``h = silu(g) * u``
(the activation recomputed by fusion, not kept): 3 hidden-width arrays per layer. With
the gated product it keeps ``[g | u]`` alone: the compiled temp of a pre-norm SwiGLU stack
grows by at least one hidden-width array per layer less than with ``gated_products=False``
(slope between 2 and 4 layers; measured 4.0 MiB of 4.0 per layer), with or without
``fewbit=3``. The step's peak (the last layer's backward: its cotangents beside every
layer's ``[g | u]``) moves less."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gp_util import plan

from jaxmem.measure import slope
from jaxmem.transform import transform

B, T, D, F, LAYERS = 8, 256, 128, 512, 2


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def loss(params, x):
    for p in params:
        h = _rms(x, p["g"])
        x = x + (jax.nn.silu(h @ p["w"]) * (h @ p["v"])) @ p["u"]
    return jnp.sum(x ** 2)


def _params(layers):
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
    return [{"g": 1 + f(D) / 8, "w": f(D, F), "v": f(D, F), "u": f(F, D)}
            for _ in range(layers)]


@pytest.mark.parametrize("fewbit", [None, 3], ids=["exact", "fewbit3"])
def test_gated_units_keep_less_on_the_h100_plan(fewbit):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)

    def per_layer(**kw):
        g = jax.grad(transform(loss, fewbit=fewbit, **kw))
        return slope(lambda n: plan(g, _params(n), x).temp_bytes, LAYERS)

    hidden = B * T * F * 4
    on, off = per_layer(), per_layer(gated_products=False)
    assert off - on >= 0.9 * hidden, (off / 2**20, on / 2**20)


def test_recomputed_factors_are_read_from_the_merged_gemm_in_place(monkeypatch):
    """The backward recomputes ``silu(g)`` and ``h = silu(g) * u`` from the factors tied to
    the cotangent. XLA:GPU computes ``[g | u]`` as one merged GEMM; a barrier over a factor
    made XLA copy that slice out of it for every tie (two hidden-width copies at the last
    layer's backward, measured 4 MiB each). ``tie_elementwise`` holds a scalar in the
    barrier and reads the factors in place: the step keeps at least one hidden-width array
    less than with whole-array ties (measured 30.0 against 35.0 MiB)."""
    import jaxmem.selective._core as core
    from jaxmem._prims.ties import tie
    from jaxmem.selective import smooth

    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
    p = _params(LAYERS)
    lean = plan(jax.grad(transform(loss)), p, x).temp_bytes
    monkeypatch.setattr(core, "tie_elementwise", tie)
    monkeypatch.setattr(smooth, "tie_elementwise", tie)
    whole = plan(jax.grad(transform(loss)), p, x).temp_bytes
    assert whole - lean >= 0.9 * B * T * F * 4, (whole / 2**20, lean / 2**20)
