"""Flax Linen/NNX wrappers keep parameters and match the untiled Flax modules (no torch
needed; the torch comparisons are in ``test_rowconv_torch.py``)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from _lazy import once
from flax import nnx

from jaxmem import rowconv as rc
from jaxmem.rowconv.flax import NNXRowSequential, RowSequential, RowVGGFeatures

X = once(lambda: jax.random.normal(jax.random.PRNGKey(1), (1, 64, 16, 3)))


def test_linen_row_sequential_same_params_and_grads():
    mods = [nn.Conv(4, (3, 3)), nn.relu, rc.Pool("max", 2),
            nn.Conv(5, (3, 3), strides=2, padding=((1, 0), (1, 1))), nn.tanh]
    seq = nn.Sequential(mods)
    v = jax.jit(seq.init)(jax.random.PRNGKey(0), X())
    # each stack's output and gradient from one compiled program (compared by tolerance)
    y1, g1 = _out_and_grad(seq, v)
    for mode in rc.MODES:
        r = RowSequential(mods, rows=4, mode=mode)
        vr = jax.eval_shape(r.init, jax.random.PRNGKey(0), X())
        assert jax.tree.map(jnp.shape, vr) == jax.tree.map(jnp.shape, v)
        y2, g2 = _out_and_grad(r, v)
        np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-5)
        assert_tree_close(g2, g1, rtol=1e-4, atol=1e-4)


def _out_and_grad(module, v):
    """``module.apply(v, X())`` and the gradient of ``sum(apply ** 2)`` w.r.t. ``v``."""
    return jax.jit(lambda v, x: (module.apply(v, x), jax.grad(
        lambda v: jnp.sum(module.apply(v, x) ** 2))(v)))(v, X())


def test_linen_rejects_non_elementwise_callable():
    mods = [nn.Conv(4, (3, 3)), lambda x: nn.max_pool(x, (2, 2), (2, 2))]
    with pytest.raises(TypeError, match="only elementwise"):
        RowSequential(mods, rows=2).init(jax.random.PRNGKey(0), X())


def test_vgg_features_twin():
    from jaxmem.models.vgg import VGGFeatures
    cfg = (4, 4, "M", 8, "M")
    f = VGGFeatures(cfg=cfg)
    v = jax.jit(f.init)(jax.random.PRNGKey(0), X())
    r = RowVGGFeatures(cfg=cfg, rows=4, mode="share")
    assert jax.tree.map(jnp.shape, jax.eval_shape(r.init, jax.random.PRNGKey(0), X())) == \
        jax.tree.map(jnp.shape, v)
    y1, g1 = _out_and_grad(f, v)
    y2, g2 = _out_and_grad(r, v)
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-5)
    assert_tree_close(g2, g1, rtol=1e-4, atol=1e-4)


def test_nnx_wrapper():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.c1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.c2 = nnx.Conv(4, 2, (5, 5), rngs=rngs)

        def __call__(self, x):
            return self.c2(nnx.relu(self.c1(x)))

    m = M(nnx.Rngs(0))
    w = NNXRowSequential(m.c1, nnx.relu, m.c2, rows=4, mode="share")

    @nnx.jit
    def out_and_grad(mod, x):  # one compiled program per module (compared by tolerance)
        return mod(x), nnx.grad(lambda mm: jnp.sum(mm(x) ** 2))(mod)

    (ya, ga), (yb, gb) = out_and_grad(m, X()), out_and_grad(w, X())
    np.testing.assert_allclose(yb, ya, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb.layers[0].kernel[...], ga.c1.kernel[...], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gb.layers[2].bias[...], ga.c2.bias[...], rtol=1e-4, atol=1e-4)
