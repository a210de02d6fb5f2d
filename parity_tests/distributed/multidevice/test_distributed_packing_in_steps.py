"""``train_step`` traces under its own mesh: packed residuals follow the step's sharding.

A tensor-parallel MLP with hidden 40 and 3-bit few-bit GELU codes (8 codes per 3 bytes) has
its hidden axis split 20 + 20 over 'model'.  The step packs the codes in blocks that end on the
shard boundary, so its compiled program has no more collectives than plain JAX's, with the
caller setting no mesh; gradients equal the one-device gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem._prims.bitpack import shard_axes
from jaxmem.models.transformer import MLPBlock

HIDDEN = 40


def _recording_sgd():
    """Optimizer state after one update = the gradient (parameters unchanged)."""
    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


@functools.cache
def _case():
    base = MLPBlock(HIDDEN, gelu_approximate=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4, 16))
    y = jax.random.normal(jax.random.PRNGKey(2), (8, 4, 16))
    params = jax.jit(base.init)(jax.random.PRNGKey(1), x)["params"]
    return base, jaxmem.linen.convert(base, fewbit=3), params, (x, y)


def _loss(model, p, batch):
    return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)


@functools.cache
def _compiled(which, mode="tp"):
    base, jm, params, batch = _case()
    model = base if which == "plain" else jm
    step = jd.train_step(functools.partial(_loss, model), _recording_sgd(),
                         jd.mesh(data=4, model=2), mode, donate=False)
    p, s = step.init(params)
    return step, step.lower(p, s, batch).compile(), (p, s, batch)


def test_tp_step_packs_per_shard_without_a_mesh_in_context():
    _, c_plain, _ = _compiled("plain")
    _, c_ours, args = _compiled("jaxmem")
    n_plain, n_ours = jd.collectives(c_plain.as_text()), jd.collectives(c_ours.as_text())
    assert n_ours <= n_plain, (n_ours.counts, n_plain.counts)
    # gradients equal the one-device gradients of the same model (default layout)
    _, jm, params, batch = _case()
    want = jax.jit(jax.grad(functools.partial(_loss, jm)))(params, batch)
    got = c_ours(*args)[1]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(w).max()))


def test_step_layout_ignores_the_callers_context():
    """The step sets its own mesh and feature axes: a caller's ``shard_axes()`` (which alone
    would keep the unblocked layout and make XLA gather the codes) changes nothing."""
    step, c_ours, args = _compiled("jaxmem")
    with shard_axes():
        again = step.lower(*args).compile()
    assert jd.collectives(again.as_text()).counts == jd.collectives(c_ours.as_text()).counts
    with shard_axes():
        grads = step.grads(args[0], args[2])[1]
    want = c_ours(*args)[1]
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_dp_step_keeps_the_unpadded_layout():
    """Under data parallelism features are never split: the codes keep one block (no padding),
    and the step adds no collectives."""
    _, c_plain, _ = _compiled("plain", "dp")
    _, c_ours, _ = _compiled("jaxmem", "dp")
    n_plain, n_ours = jd.collectives(c_plain.as_text()), jd.collectives(c_ours.as_text())
    assert n_ours <= n_plain, (n_ours.counts, n_plain.counts)


def _pool_grad(pool):
    return jax.grad(lambda x: jnp.sum(jnp.tanh(pool(x)) ** 2))


@pytest.mark.parametrize("window,channels", [((3, 3), 16), ((2, 2), 12)])
def test_max_pool_codes_stay_sharded_over_model(window, channels):
    """Channels split over 'model': the argmax codes are packed along the channel axis (in
    blocks when a shard's codes do not fill whole bytes: 2-bit codes, 6 channels a shard), so
    XLA gathers nothing, as for plain JAX's pooling."""
    import flax.linen as nn

    import jaxmem.selective as S

    m = jd.mesh(data=4, model=2)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 8, 8, channels))
    ours = _pool_grad(lambda v: S.max_pool(v, window, (2, 2), "SAME"))
    plain = _pool_grad(lambda v: nn.max_pool(v, window, (2, 2), "SAME"))
    sh = NamedSharding(m, P("data", None, None, "model"))
    xs = jax.device_put(x, sh)
    with jax.set_mesh(m):
        c_ours = jd.compiled_collectives(jax.jit(ours, in_shardings=sh, out_shardings=sh), xs)
        c_plain = jd.compiled_collectives(jax.jit(plain, in_shardings=sh, out_shardings=sh), xs)
        got = jax.jit(ours, in_shardings=sh, out_shardings=sh)(xs)
    assert c_ours <= c_plain, (c_ours.counts, c_plain.counts)
    assert c_ours.counts["all-gather"] == 0, c_ours.counts
    want = jax.jit(plain)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
