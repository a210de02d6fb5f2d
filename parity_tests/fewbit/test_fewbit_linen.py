"""Flax drop-in: ``jaxmem.scope(fewbit=bits)`` switches inline nn.gelu / jax.nn.silu /
nnx.gelu calls to the few-bit ops while tracing, and restores them on exit."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem import fewbit
from jaxmem.measure import residual_bytes


class LocalMLP(nn.Module):
    """A model we do not edit: activations called inline through the modules."""

    @nn.compact
    def __call__(self, x):
        x = jax.nn.silu(nn.Dense(32)(x))
        x = nn.gelu(nn.Dense(32)(x), approximate=False)
        return nn.Dense(1)(jnp.tanh(x))  # jnp.tanh is not a jax.nn attribute: untouched


class HandWritten(nn.Module):
    """The same model written with the few-bit ops by hand (the reference)."""

    bits: int

    @nn.compact
    def __call__(self, x):
        x = fewbit.silu(nn.Dense(32)(x), bits=self.bits)
        x = fewbit.gelu(nn.Dense(32)(x), bits=self.bits, approximate=False)
        return nn.Dense(1)(jnp.tanh(x))


def _fewbit(bits):
    """The few-bit part alone (no selective layers, no attention)."""
    return jaxmem.scope(selective=False, fewbit=bits, attention=False)


def _loss(model, params, x):
    return jnp.sum(model.apply(params, x) ** 2)


def test_local_linen_model_equals_hand_written_fewbit():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 5)), jnp.float32)
    p = LocalMLP().init(jax.random.PRNGKey(0), x)
    g_exact = jax.grad(_loss, 1)(LocalMLP(), p, x)
    g_hand = jax.jit(jax.grad(_loss, 1), static_argnums=0)(HandWritten(2), p, x)
    with _fewbit(2) as opts:
        assert opts.fewbit == 2 and jax.nn.silu is not fewbit.linen._ORIG["silu"]
        g_patch = jax.jit(jax.grad(_loss, 1), static_argnums=0)(LocalMLP(), p, x)
        y_patch = LocalMLP().apply(p, x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, g_patch, g_hand)
    np.testing.assert_array_equal(np.asarray(y_patch), np.asarray(LocalMLP().apply(p, x)))
    diff = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_patch, g_exact)
    assert max(jax.tree_util.tree_leaves(diff)) > 0  # the patch was active
    # restored afterwards
    assert jax.nn.gelu is fewbit.linen._ORIG["gelu"] and nn.gelu is jax.nn.gelu
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           jax.grad(_loss, 1)(LocalMLP(), p, x), g_exact)


def test_gpt_patched_without_editing():
    import jaxmem.models as models
    cfg = models.GPTConfig(vocab=64, ctx=16, d_model=32, n_head=2, n_layer=2)
    gpt = models.GPT(cfg)
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)))
    p = gpt.init(jax.random.PRNGKey(0), tok)

    def loss(p):
        return -jnp.mean(jax.nn.log_softmax(gpt.apply(p, tok))[..., 0])

    r0 = residual_bytes(loss, p)
    g0 = jax.grad(loss)(p)
    with _fewbit(3):  # GELU is the GPT's one smooth activation
        r3 = residual_bytes(loss, p)
        g3 = jax.jit(jax.grad(loss))(p)
        l3 = loss(p)
    np.testing.assert_array_equal(np.asarray(l3), np.asarray(loss(p)))  # forward unchanged
    hidden = 2 * 16 * 4 * 32  # per layer: batch x ctx x (mlp_ratio * d_model)
    packed = [e for e in r3.entries if e.dtype == "uint8" or str(e.dtype) == "uint8"]
    assert sum(e.nbytes for e in packed) == cfg.n_layer * hidden * 3 // 8
    assert r3.activation_bytes < r0.activation_bytes
    rel = jax.tree_util.tree_map(
        lambda a, b: float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)), g3, g0)
    assert 0 < max(jax.tree_util.tree_leaves(rel)) < 0.2


def test_nnx_inline_gelu():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.gelu(self.l1(x)))

    net = Net(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(6, 4)), jnp.float32)

    def loss(m):
        return jnp.sum(m(x) ** 2)

    g0 = nnx.grad(loss)(net)
    with _fewbit(1):
        g1 = nnx.grad(loss)(net)
    h = net.l1(x)
    dh_ref = np.asarray(jax.vjp(lambda h: fewbit.gelu(h, bits=1, approximate=True), h)[1](
        jnp.ones_like(h))[0])
    assert dh_ref.shape == h.shape
    a, b = np.asarray(g1.l1.kernel.value), np.asarray(g0.l1.kernel.value)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(g1.l2.kernel.value), np.asarray(g0.l2.kernel.value))


def test_restore_on_exception_nested_and_errors():
    orig = jax.nn.gelu
    with pytest.raises(RuntimeError), _fewbit(3):
        assert jax.nn.gelu is not orig
        raise RuntimeError("boom")
    assert jax.nn.gelu is orig and nn.gelu is orig and nnx.gelu is orig
    x = jnp.linspace(-3.0, 3.0, 16)

    def dgelu():
        return np.asarray(jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))(x))

    def dgelu_bits(bits):
        return np.asarray(jax.grad(lambda x: jnp.sum(fewbit.gelu(x, bits=bits, approximate=True)))(x))

    with _fewbit(3):
        np.testing.assert_array_equal(dgelu(), dgelu_bits(3))
        with _fewbit(1):  # inner overrides outer
            np.testing.assert_array_equal(dgelu(), dgelu_bits(1))
        np.testing.assert_array_equal(dgelu(), dgelu_bits(3))
    assert jax.nn.gelu is orig
    with pytest.raises(ValueError, match="fewbit must be None .* got 9"), _fewbit(9):
        pass
    assert jax.nn.gelu is orig


def test_patched_defaults_and_parameters():
    x = jnp.asarray(np.linspace(-4, 4, 16), jnp.float32)
    with _fewbit(4):
        # jax.nn.gelu's default approximate=True is kept
        g_default = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))(x)
        g_elu2 = jax.grad(lambda x: jnp.sum(jax.nn.elu(x, alpha=2.0)))(x)
        g_leaky = jax.grad(lambda x: jnp.sum(jax.nn.leaky_relu(x, 0.3)))(x)
        y_int = jax.nn.relu(jnp.arange(-2, 3))  # non-float input: original function
    g_tanh = jax.grad(lambda x: jnp.sum(fewbit.gelu(x, bits=4, approximate=True)))(x)
    np.testing.assert_array_equal(np.asarray(g_default), np.asarray(g_tanh))
    g_elu2_exact = jax.grad(lambda x: jnp.sum(jax.nn.elu(x, alpha=2.0)))(x)
    assert 0 < float(jnp.max(jnp.abs(g_elu2 - g_elu2_exact))) < 0.3
    np.testing.assert_allclose(np.asarray(g_leaky), np.where(np.asarray(x) >= 0, 1.0, 0.3),
                               rtol=1e-7)
    assert list(np.asarray(y_int)) == [0, 0, 0, 1, 2]
