"""A ReLU of a norm's output is recomputable from the norm's residuals (``_prims.recipes.then``).

``conv -> batch_norm(train) -> relu -> conv`` with every parameter trained: the second
convolution's kernel gradient reads ``relu(bn(.))``; it now recomputes that input in the
backward pass from what the norm keeps anyway instead of keeping it, so one input-sized array
less is kept per unit, with bit-identical gradients (the recomputation is the forward's own
elementwise function of the same arrays)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem._prims.mask as mask_mod
import jaxmem.selective as S
from jaxmem._prims import recipes
from jaxmem.measure import residual_bytes

SHAPE = (4, 8, 8, 8)


def _params(depth):
    rng = np.random.default_rng(0)
    return [(jnp.asarray(rng.normal(size=(3, 3, 8, 8)) * 0.2, jnp.float32),
             jnp.asarray(1.0 + 0.1 * rng.normal(size=(8,)), jnp.float32),
             jnp.asarray(0.1 * rng.normal(size=(8,)), jnp.float32)) for _ in range(depth)]


def _loss(act):
    def loss(ps, x):
        for w, s, b in ps:
            x = act(S.batch_norm(S.conv(x, w), s, b, train=True)[0])
        return jnp.sum(x * x)
    return loss


def _without_recipe(monkeypatch):
    monkeypatch.setattr(mask_mod, "then", lambda *a: None)


ACTS = {"relu": S.relu, "relu6": S.relu6, "leaky_relu": lambda a: S.leaky_relu(a, 0.1)}


@pytest.mark.parametrize("name", sorted(ACTS))
def test_gradients_bit_identical(name, monkeypatch):
    ps = _params(3)
    x = jnp.asarray(np.random.default_rng(1).normal(size=SHAPE), jnp.float32)
    loss = _loss(ACTS[name])
    with_recipe = jax.jit(jax.grad(loss, argnums=(0, 1)))(ps, x)
    _without_recipe(monkeypatch)
    without = jax.jit(jax.grad(loss, argnums=(0, 1)))(ps, x)
    for a, b in zip(jax.tree.leaves(with_recipe), jax.tree.leaves(without)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_input_sized_array_less_per_unit(monkeypatch):
    ps = _params(3)
    x = jnp.ones(SHAPE, jnp.float32)
    per = int(np.prod(SHAPE)) * 4
    kept = residual_bytes(_loss(S.relu), ps, x, argnums=0).activation_bytes
    _without_recipe(monkeypatch)
    before = residual_bytes(_loss(S.relu), ps, x, argnums=0).activation_bytes
    # the conv after each of the first two units no longer keeps its f32 input (the shared
    # per-channel statistics it keeps instead are counted: a few bytes per channel)
    assert 2 * per - 256 <= before - kept <= 2 * per, (before, kept)


def test_recipe_only_for_recorded_inputs():
    x = jnp.ones((4, 8))
    y = S.relu(x)
    assert recipes.recipe(y) is None
    z, _, _ = S.batch_norm(x, jnp.ones((8,)), jnp.zeros((8,)), train=True)
    r = recipes.recipe(S.relu(z))
    assert r is not None
    fn, args, kept_if = r
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(jax.nn.relu(z)))
    assert kept_if == recipes.recipe(z)[2]
