"""Dropout outside attention (Flax's ``nn.Dropout``, shared along axes or not, and a
hand-written ``where(bernoulli(key, keep), x / keep, 0)``) becomes
``jaxmem.selective.dropout``: the same outputs and gradients (the mask is regenerated from
the key), no boolean mask kept.  A select on other random bits, or a mask also used
elsewhere, stays as it was, with a reason."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, key, normal


def _flax(rate, bdims=()):
    d = nn.Dropout(rate, broadcast_dims=bdims)
    return lambda x, k: d.apply({}, x, deterministic=False, rngs={"dropout": k})


def _by_hand(x, k):
    keep = jax.random.bernoulli(k, 0.75, x.shape)
    return jnp.where(keep, x / 0.75, 0.0)


CASES = {"flax 0.1": _flax(0.1), "flax 0.4 shared along axis 1": _flax(0.4, (1,)),
         "by hand": _by_hand}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dropout_is_exact_and_keeps_the_key(name):
    drop = CASES[name]
    w = normal((16, 16), scale=0.3)
    x = normal((4, 6, 16))
    k = key()

    def f(w, x, k):
        return jnp.sum(jnp.tanh(drop(x @ w, k)) ** 2)

    g = transform(f)
    # the transformed function op by op, as written; the untouched reference compiled
    close(g(w, x, k), jax.jit(f)(w, x, k))
    close(jax.grad(g, (0, 1))(w, x, k), jax.jit(jax.grad(f, (0, 1)))(w, x, k))
    rows = g.report(w, x, k).by_kind("dropout")
    assert [r.converted for r in rows] == [True]
    assert ("shared along (1,)" in rows[0].matched) == ("shared" in name)
    assert "test_transform_dropout" in rows[0].where or "linen" in rows[0].where
    bools = lambda fn: [e for e in residual_bytes(fn, w, x, k, argnums=(0, 1)).entries
                        if str(e.dtype) == "bool"]
    assert bools(f) and not bools(g)


def test_mask_used_elsewhere_or_other_bits_are_left():
    x = normal((8, 16))
    k = key()

    def reused(x, k):
        keep = jax.random.bernoulli(k, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, x / 0.5, 0.0) ** 2) + jnp.sum(keep)

    def uniform_gate(x, k):  # a select on uniform values, not a dropout recipe
        keep = jax.random.uniform(k, x.shape) < jnp.tanh(x) ** 2
        return jnp.sum(jnp.where(keep, x / 0.5, 0.0) ** 2)

    g = transform(reused)
    close(jax.grad(g)(x, k), jax.jit(jax.grad(reused))(x, k))   # reference compiled
    rows = g.report(x, k).by_kind("dropout")
    assert [r.converted for r in rows] == [False] and "used elsewhere" in rows[0].reason
    g = transform(uniform_gate)
    close(jax.grad(g)(x, k), jax.jit(jax.grad(uniform_gate))(x, k))
    assert not [r for r in g.report(x, k).by_kind("dropout") if r.converted]


@pytest.mark.parametrize("threshold", ["computed", "literal"])
def test_a_keep_probability_other_than_the_divisor_is_left(threshold):
    """``where(bernoulli(k, 0.8), x / 0.9, 0)``: regenerating the mask with the divisor's
    keep probability would give other bits (a wrong gradient); the select stays as written.
    The threshold computed from constants is Equinox's ``1 - stop_gradient(p)``."""
    x = normal((32, 32))
    k = key()

    def f(x, k):
        p = 1 - jax.lax.stop_gradient(0.2) if threshold == "computed" else 0.8
        keep = jax.random.bernoulli(k, p, x.shape)
        return jnp.sum(jnp.sin(jnp.where(keep, x / 0.9, 0.0)))

    g = transform(f)
    close(jax.grad(g)(x, k), jax.jit(jax.grad(f))(x, k), rtol=1e-5, atol=1e-6)
    rows = g.report(x, k).by_kind("dropout")
    assert not [r for r in rows if r.converted]
    if threshold == "computed":
        assert rows and "is not the divisor" in rows[0].reason


def test_dropout_option_off():
    x = normal((4, 16))
    f = lambda x, k: jnp.sum(_by_hand(x, k) ** 2)
    assert not transform(f, dropout=False).report(x, key()).by_kind("dropout")



def test_closed_over_typed_key_is_a_constant_like_any_other():
    """A loss that closes over its dropout key (a typed ``jax.random.key``, of an extended
    dtype that numpy refuses): the user-style LM with ``nn.remat`` blocks, whose recomputed
    bodies get the key as a constant next to their LayerNorms. The key is a constant like
    any other; the gradients are the untouched ones."""
    from jaxmem.bench.flax_models import linen_lm_remat
    case = linen_lm_remat(depth=1, batch_size=2, d_model=16)
    assert jax.dtypes.issubdtype(case.rng.dtype, jax.dtypes.extended)
    f, params = case.loss_of_params(True)     # closes over case.rng

    def loss(p):
        return f(p)[0]

    g = transform(loss)
    # one compiled program for both sides
    got, want = jax.jit(lambda p: (jax.grad(g)(p), jax.grad(loss)(p)))(params)
    close(got, want, rtol=1e-5, atol=1e-6)
    rep = g.report(params)
    assert rep.by_kind("norm") and all(r.converted for r in rep.by_kind("norm"))
