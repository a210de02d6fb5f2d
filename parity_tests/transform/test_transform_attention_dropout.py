"""Attention dropout inside an attention subgraph -- Flax's ``P * (mask / keep)`` and the
``where(mask, P / keep, 0)`` of Equinox and hand-written JAX (one key, or one key per
example under ``vmap``): the mask's recipe is recognised and the memory-lean attention
regenerates the very same mask from the key (equal values and gradients)."""
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


def _fresh_key():
    return jax.random.key(int(np.random.default_rng().integers(1 << 30)))


def _dropout_inside_and_exact(f, *args, rtol=1e-5, atol=1e-6):
    """``transform(f)``: one attention row, converted with its dropout; the value and the
    gradients w.r.t. ``q, k, v`` those of ``f`` (the same mask), both sides in one compiled
    program. Returns the transform and its gradients."""
    g = transform(f)
    row, = g.report(*args).by_kind("attention")
    assert row.converted and "dropout" in row.matched
    (vg, gg), (vf, gf) = jax.jit(lambda *a: tuple(
        (fn(*a), jax.grad(fn, (0, 1, 2))(*a)) for fn in (g, f)))(*args)
    close(vg, vf, rtol=1e-5)
    close(gg, gf, rtol=rtol, atol=atol)
    return g, gg


@pytest.mark.parametrize("broadcast", [True, False])
def test_attention_dropout_regenerates_the_same_mask(broadcast):
    q, k, v = _qkv()

    def f(q, k, v, key):
        o = nn.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.2,
                                     deterministic=False, broadcast_dropout=broadcast)
        return jnp.sum(o ** 2)

    _dropout_inside_and_exact(f, q, k, v, _fresh_key(), rtol=1e-4, atol=1e-5)


def test_legacy_uint32_key_and_a_different_key_differ():
    q, k, v = _qkv()

    def f(q, k, v, key):
        return jnp.sum(nn.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.5,
                                                deterministic=False) ** 2)

    g = jax.jit(transform(f))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    close(g(q, k, v, k1), jax.jit(f)(q, k, v, k1), rtol=1e-5)
    assert not np.allclose(g(q, k, v, k1), g(q, k, v, k2))   # the mask follows the key


def _select_attention(q, k, v, key, keep=0.9, divisor=None, shape=None, mask=None):
    """Softmax attention with its weights dropped by ``where(bernoulli, p / keep, 0)``
    (``mask``: that mask given instead of drawn)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, axis=-1)
    if mask is None:
        mask = jax.random.bernoulli(key, keep, shape or p.shape)
    p = jnp.where(mask, p / (divisor or keep), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("shared", [False, True], ids=["per weight", "shared over b, h"])
def test_select_dropout_on_the_weights_is_inside_the_attention(shared):
    q, k, v = _qkv()
    w = normal((B, T, H, D))
    shape = (1, 1, T, T) if shared else None
    f = lambda q, k, v, key: jnp.sum(_select_attention(q, k, v, key, shape=shape) * w)
    key = _fresh_key()
    g, got = _dropout_inside_and_exact(f, q, k, v, key)
    assert not g.report(q, k, v, key).by_kind("dropout")     # not converted apart
    # against float64 autodiff of the same program (the mask drawn as in float32: under
    # x64, bernoulli draws float64 uniforms, other bits)
    mask = jax.random.bernoulli(key, 0.9, shape or (B, H, T, T))
    with jax.enable_x64(True):
        q64, k64, v64, w64 = (a.astype(jnp.float64) for a in (q, k, v, w))
        f64 = lambda q, k, v: jnp.sum(_select_attention(q, k, v, None, mask=mask) * w64)
        ref = jax.jit(jax.grad(f64, (0, 1, 2)))(q64, k64, v64)   # compiled: not op by op
    close(got, ref, rtol=1e-4, atol=1e-5)
    # no T x S residual: the weights and the mask are recomputed from q, k and the key
    assert (residual_bytes(g, q, k, v, key).activation_bytes
            < residual_bytes(f, q, k, v, key).activation_bytes / 2)


def test_one_mask_per_example_key_under_vmap():
    """Equinox's layout: the model runs per example under ``vmap`` with a batch of keys."""
    q, k, v = _qkv()
    keys = jax.random.split(_fresh_key(), B)
    w = normal((B, T, H, D))

    def one(q, k, v, key):
        return _select_attention(q[None], k[None], v[None], key)[0]

    f = lambda q, k, v, keys: jnp.sum(jax.vmap(one)(q, k, v, keys) * w)
    _dropout_inside_and_exact(f, q, k, v, keys)
    # each example's mask follows its own key
    other = keys.at[1].set(_fresh_key())
    run = jax.jit(jax.vmap(one))
    a, b = run(q, k, v, keys), run(q, k, v, other)
    assert np.allclose(a[0], b[0]) and not np.allclose(a[1], b[1])


def test_select_dropout_with_another_divisor_stays_as_written():
    """``where(bernoulli(key, 0.9), p / 0.8, 0)``: the core would regenerate the mask with
    keep 0.8; the attention is not matched (reported) and the program is unchanged."""
    q, k, v = _qkv()
    f = lambda q, k, v, key: jnp.sum(_select_attention(q, k, v, key, divisor=0.8) ** 2)
    key = _fresh_key()
    g = transform(f)
    assert not [r for r in g.report(q, k, v, key).by_kind("attention") if r.converted]
    got, want = jax.jit(lambda *a: (jax.grad(g, (0, 1, 2))(*a), jax.grad(f, (0, 1, 2))(*a)))(
        q, k, v, key)
    close(got, want, rtol=1e-5, atol=1e-6)
