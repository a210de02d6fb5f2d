"""Few-bit codes for models nobody edits: ``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` /
``jaxmem.transform`` with ``fewbit=bits`` (and the deprecated ``jaxmem.scope``) code the smooth
activations they compute, inline calls included; the forward stays exact."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem.measure import residual_bytes


class LocalMLP(nn.Module):
    """A model we do not edit: activations called inline through the modules."""

    @nn.compact
    def __call__(self, x):
        x = jax.nn.silu(nn.Dense(32)(x))
        x = nn.gelu(nn.Dense(32)(x), approximate=False)
        return nn.Dense(1)(jnp.tanh(x))  # jnp.tanh is not a jax.nn attribute: untouched


def _fewbit(bits):
    """The few-bit part alone (no selective layers, no attention), as the deprecated scope."""
    return jaxmem.scope(selective=False, fewbit=bits, attention=False)


def _loss(model, params, x):
    return jnp.sum(model.apply(params, x) ** 2)


def _rel_err(a, b):
    """``||a - b|| / ||b||`` of one gradient leaf, in NumPy (op by op, JAX would compile each
    operation once per leaf shape)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def _codes(res):
    return [e for e in res.entries if str(e.dtype) == "uint8"]


@pytest.mark.filterwarnings("ignore::jaxmem.JaxmemDeprecationWarning")
def test_local_linen_model_gets_codes_of_its_inline_activations():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 5)), jnp.float32)
    p = jax.jit(LocalMLP().init)(jax.random.PRNGKey(0), x)

    def grad(model):  # a new jax.grad each call: traced afresh, under the scope or not
        return jax.jit(jax.grad(_loss, 1), static_argnums=0)(model, p, x)

    g_exact = grad(LocalMLP())
    conv = jaxmem.linen.convert(LocalMLP(), selective=False, fewbit=2, attention=False)
    g_conv = grad(conv)
    np.testing.assert_array_equal(np.asarray(conv.apply(p, x)),
                                  np.asarray(LocalMLP().apply(p, x)))  # forward exact
    rel = jax.tree.map(_rel_err, g_conv, g_exact)
    assert 0 < max(jax.tree.leaves(rel)) < 0.3  # approximate, and not far
    # silu and gelu keep 2-bit codes (8 x 32 elements each: 64 bytes)
    codes = _codes(residual_bytes(lambda p: _loss(conv, p, x), p))
    assert sorted(e.nbytes for e in codes)[:2] == [64, 64], codes
    with _fewbit(2):  # the deprecated scope: the same conversion of the Linen call
        g_scope = grad(LocalMLP())
    jax.tree.map(np.testing.assert_array_equal, g_scope, g_conv)
    jax.tree.map(np.testing.assert_array_equal, grad(LocalMLP()), g_exact)


def test_gpt_patched_without_editing():
    from jaxmem import models
    cfg = models.GPTConfig(vocab=64, ctx=16, d_model=32, n_head=2, n_layer=1)
    gpt = models.GPT(cfg)
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)))
    p = jax.jit(gpt.init)(jax.random.PRNGKey(0), tok)

    def loss(p):
        return -jnp.mean(jax.nn.log_softmax(gpt.apply(p, tok))[..., 0])

    r0 = residual_bytes(loss, p)
    g0 = jax.jit(jax.grad(loss))(p)
    with _fewbit(3):  # GELU is the GPT's one smooth activation
        r3 = residual_bytes(loss, p)
        g3 = jax.jit(jax.grad(loss))(p)
        l3 = jax.jit(loss)(p)
    # forward unchanged (compiled: op by op, the GPT's forward is a hundred small compiles)
    np.testing.assert_array_equal(np.asarray(l3), np.asarray(jax.jit(loss)(p)))
    hidden = 2 * 16 * 4 * 32  # per layer: batch x ctx x (mlp_ratio * d_model)
    packed = [e for e in r3.entries if e.dtype == "uint8" or str(e.dtype) == "uint8"]
    assert sum(e.nbytes for e in packed) == cfg.n_layer * hidden * 3 // 8
    assert r3.activation_bytes < r0.activation_bytes
    rel = jax.tree_util.tree_map(_rel_err, g3, g0)
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
    g1 = nnx.grad(loss)(jaxmem.nnx.convert(net, selective=False, fewbit=1, attention=False))
    a, b = np.asarray(g1.l1.kernel.value), np.asarray(g0.l1.kernel.value)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(g1.l2.kernel.value), np.asarray(g0.l2.kernel.value))


@pytest.mark.filterwarnings("ignore::jaxmem.JaxmemDeprecationWarning")
def test_scope_left_on_exception_and_bad_bits():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 5)), jnp.float32)
    p = LocalMLP().init(jax.random.PRNGKey(0), x)
    plain = str(jax.make_jaxpr(jax.grad(_loss, 1), static_argnums=0)(LocalMLP(), p, x))
    with pytest.raises(RuntimeError), _fewbit(3):
        raise RuntimeError("boom")
    assert str(jax.make_jaxpr(jax.grad(_loss, 1), static_argnums=0)(LocalMLP(), p, x)) == plain
    with pytest.raises(ValueError, match="fewbit must be None .* got 9"), _fewbit(9):
        pass
    with pytest.raises(ValueError, match="fewbit must be None or an int in 1..4"):
        jaxmem.transform(jnp.sin, fewbit=9)


def test_defaults_and_parameters_of_inline_activations():
    x = jnp.asarray(np.linspace(-4, 4, 16), jnp.float32)

    def grad(f):
        # 2 bits: the coarsest table whose error stays well inside the bound below (at most
        # 0.16 here); fitting a 16-level table costs several times more
        return jax.grad(jaxmem.transform(lambda x: jnp.sum(jnp.sin(f(x))), fewbit=2))(x)

    def exact(f):
        return jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)

    for f in (jax.nn.gelu, lambda x: jax.nn.elu(x, alpha=2.0), jax.nn.silu):
        err = float(jnp.max(jnp.abs(grad(f) - exact(f))))
        assert 0 < err < 0.3  # coded: approximate, close
    leaky = lambda x: jax.nn.leaky_relu(x, 0.3)  # the exact 1-bit mask
    np.testing.assert_allclose(np.asarray(grad(leaky)), np.asarray(exact(leaky)), rtol=1e-6)
    y_int = jaxmem.transform(jax.nn.relu, fewbit=4)(jnp.arange(-2, 3))  # integer: as written
    assert list(np.asarray(y_int)) == [0, 0, 0, 1, 2]
