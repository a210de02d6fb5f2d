"""An Equinox transformer block (per-example modules under ``jax.vmap``, a batch of dropout
keys) and a raw-JAX MLP (no framework: a hand-written layer norm, ReLU, GELU, dropout) under
``jaxmem.transform``: loss and gradients equal the untouched ones, and the report accounts
for each layer."""
from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/transform")
from _util import close, key, normal, values_and_grads

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

H, T, B, FF = 32, 8, 2, 64


def _counts(rep):
    return collections.Counter((r.kind, r.converted) for r in rep)


@pytest.fixture(scope="module")
def eqx_case():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        ln2: eqx.nn.LayerNorm
        rms: eqx.nn.RMSNorm
        att: eqx.nn.MultiheadAttention
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self, k):
            k = jax.random.split(k, 3)
            self.ln1, self.ln2, self.rms = eqx.nn.LayerNorm(H), eqx.nn.LayerNorm(H), \
                eqx.nn.RMSNorm(H)
            self.att = eqx.nn.MultiheadAttention(4, H, dropout_p=0.1, key=k[0])
            self.up, self.down = eqx.nn.Linear(H, FF, key=k[1]), eqx.nn.Linear(FF, H, key=k[2])
            self.drop = eqx.nn.Dropout(0.1)

        def __call__(self, x, k, inference):
            k1, k2 = jax.random.split(k)
            h = jax.vmap(self.ln1)(x)
            x = x + self.att(h, h, h, key=k1, inference=inference)
            h = jax.nn.relu(jax.vmap(self.up)(jax.vmap(self.ln2)(x)))
            h = self.drop(jax.vmap(self.down)(h), key=k2, inference=inference)
            return jax.vmap(self.rms)(x + h)

    model = Block(key())
    # Equinox's norms start at scale 1, bias 0: fresh values so that both matter
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.tree_util.tree_map(lambda a: a + normal(a.shape, scale=0.1), params)

    def loss(p, x, keys, inference):
        m = eqx.combine(p, static)
        return jnp.mean(jnp.sin(jax.vmap(lambda a, k: m(a, k, inference))(x, keys)) ** 2)

    return loss, params


@pytest.mark.parametrize("inference", [False, True], ids=["train", "eval"])
def test_equinox_block(eqx_case, inference):
    loss, params = eqx_case
    x = normal((B, T, H))
    keys = jax.random.split(key(), B)
    f = lambda p, x: loss(p, x, keys, inference)
    g = transform(f)
    close(*values_and_grads([g, f], params, x))
    rep = g.report(params, x)
    n = _counts(rep)
    assert n["norm", True] == 3                       # ln1, ln2, rms (vmapped)
    assert n["dot", True] == 6 and not n["dot", False]      # q k v o, up, down
    assert n["activation", True] == 1                   # relu: 1-bit mask
    # the attention (per example and head, under vmap) is the exact memory-lean attention;
    # in train mode with Equinox's attention-weights dropout (a select, one mask per
    # example and head key) inside it, and the output dropout converted on its own
    att = rep.by_kind("attention")
    assert [r.converted for r in att] == [True]
    assert ("dropout" in att[0].matched) == (not inference)
    assert n["dropout", True] == (0 if inference else 1) and not n["dropout", False]
    assert all(r.reason for r in rep.unconverted())


def _ln(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * w + b


def _raw_loss(params, x, k):
    h = x
    for i, (w, b, s, t) in enumerate(params):
        h = _ln(h, s, t) @ w + b
        h = jax.nn.relu(h) if i % 2 == 0 else jax.nn.gelu(h)
        keep = jax.random.bernoulli(jax.random.fold_in(k, i), 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0)
    return jnp.mean(h ** 2)


def test_raw_jax_mlp():
    params = [(normal((H, H), scale=H ** -0.5), normal((H,), scale=0.1),
               normal((H,), scale=0.1) + 1.0, normal((H,), scale=0.1)) for _ in range(3)]
    x, k = normal((16, H)), key()
    g = transform(_raw_loss)
    close(*values_and_grads([g, _raw_loss], params, x, k))
    n = _counts(g.report(params, x, k))
    assert (n["norm", True], n["dot", True], n["dropout", True]) == (3, 3, 3)
    # relu: masks; gelu: input kept (exact); the loss's square stays
    assert n["activation", True] == 3 and n["activation", False] == 1
    assert (residual_bytes(g, params, x, k).activation_bytes
            < residual_bytes(_raw_loss, params, x, k).activation_bytes)
    n3 = _counts(transform(_raw_loss, fewbit=3).report(params, x, k))
    assert n3["activation", True] == 3             # relu masks + the gelu's code
