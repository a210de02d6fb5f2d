"""``jaxmem.models.TorchBatchNorm`` reproduces ``torch.nn.BatchNorm2d`` exactly, including the
running-variance update with the *unbiased* batch variance (where ``flax.linen.BatchNorm``
uses the biased one)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _assert import assert_tree_close

from jaxmem.models import TorchBatchNorm


def _torch_steps(bn_t, xs, train):
    ys = []
    bn_t.train(train)
    for x in xs:
        t = torch.as_tensor(np.transpose(x, (0, 3, 1, 2)) if x.ndim == 4 else x)
        y = bn_t(t).detach().numpy()
        ys.append(np.transpose(y, (0, 2, 3, 1)) if x.ndim == 4 else y)
    return ys


@pytest.mark.parametrize("shape", [(4, 5, 3, 6), (7, 6)])
def test_three_train_steps_then_eval_match_torch_float64(shape):
    rng = np.random.default_rng(0)
    c = shape[-1]
    with jax.enable_x64(True):
        xs = [rng.standard_normal(shape) * (1 + i) + i for i in range(3)]
        x_eval = rng.standard_normal(shape)
        bn_t = (torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d)(c).double()
        with torch.no_grad():
            bn_t.weight.copy_(torch.as_tensor(rng.uniform(0.5, 1.5, c)))
            bn_t.bias.copy_(torch.as_tensor(rng.standard_normal(c)))
        variables = {
            "params": {"scale": jnp.asarray(bn_t.weight.detach().numpy()),
                       "bias": jnp.asarray(bn_t.bias.detach().numpy())},
            "batch_stats": {"mean": jnp.zeros(c, jnp.float64), "var": jnp.ones(c, jnp.float64)},
        }
        bn = TorchBatchNorm()
        ys_t = _torch_steps(bn_t, xs, True)
        for x, y_t in zip(xs, ys_t):
            y, upd = bn.apply(variables, jnp.asarray(x), True, mutable=["batch_stats"])
            variables = {**variables, **upd}
            np.testing.assert_allclose(np.asarray(y), y_t, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(variables["batch_stats"]["mean"]),
                                   bn_t.running_mean.numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(variables["batch_stats"]["var"]),
                                   bn_t.running_var.numpy(), rtol=1e-12, atol=1e-14)
        y_eval = bn.apply(variables, jnp.asarray(x_eval), False)
        (y_eval_t,) = _torch_steps(bn_t, [x_eval], False)
        np.testing.assert_allclose(np.asarray(y_eval), y_eval_t, rtol=1e-12, atol=1e-12)


def test_running_var_is_unbiased_where_flax_batchnorm_is_biased():
    """One train step from var=1: torch/ours store 0.9 + 0.1 * s2 * n/(n-1), flax 0.9 + 0.1 * s2."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 2, 4)) * 2.0
    n = 3 * 2 * 2
    s2 = jnp.var(x, axis=(0, 1, 2))
    v0 = TorchBatchNorm().init(jax.random.PRNGKey(1), x, False)
    _, ours = TorchBatchNorm().apply(v0, x, True, mutable=["batch_stats"])
    fl = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)
    _, theirs = fl.apply(fl.init(jax.random.PRNGKey(1), x), x, mutable=["batch_stats"])
    np.testing.assert_allclose(ours["batch_stats"]["var"], 0.9 + 0.1 * s2 * n / (n - 1), rtol=1e-5)
    np.testing.assert_allclose(theirs["batch_stats"]["var"], 0.9 + 0.1 * s2, rtol=1e-5)
    bn_t = torch.nn.BatchNorm2d(4).train()
    bn_t(torch.as_tensor(np.array(x).transpose(0, 3, 1, 2).copy()))
    np.testing.assert_allclose(ours["batch_stats"]["var"], bn_t.running_var.numpy(), rtol=1e-5)


def test_init_does_not_update_statistics_and_eval_leaves_them():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 3)) + 5.0
    v = TorchBatchNorm().init(jax.random.PRNGKey(1), x, True)
    np.testing.assert_array_equal(v["batch_stats"]["mean"], np.zeros(3))
    np.testing.assert_array_equal(v["batch_stats"]["var"], np.ones(3))
    _, upd = TorchBatchNorm().apply(v, x, False, mutable=["batch_stats"])
    np.testing.assert_array_equal(upd["batch_stats"]["mean"], np.zeros(3))


def test_bad_input():
    v = TorchBatchNorm().init(jax.random.PRNGKey(1), jnp.ones((2, 3)), False)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        TorchBatchNorm().apply(v, jnp.ones((1, 3)), True, mutable=["batch_stats"])
    with pytest.raises(ValueError, match="momentum"):
        TorchBatchNorm(momentum=1.5).init(jax.random.PRNGKey(1), jnp.ones((2, 3)), False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_float32_statistics(dtype):
    x = (jax.random.normal(jax.random.PRNGKey(0), (8, 4)) * 3 + 1).astype(dtype)
    v = TorchBatchNorm().init(jax.random.PRNGKey(1), x, False)
    y, upd = TorchBatchNorm().apply(v, x, True, mutable=["batch_stats"])
    assert y.dtype == dtype
    assert upd["batch_stats"]["var"].dtype == jnp.float32
    y32, upd32 = TorchBatchNorm().apply(v, x.astype(jnp.float32), True, mutable=["batch_stats"])
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(upd["batch_stats"]["var"], upd32["batch_stats"]["var"], rtol=1e-6)


def test_selective_conversion_handles_the_twin_batchnorm():
    """``jaxmem.linen.convert`` converts ``TorchBatchNorm`` (the transformation recognises its
    normalisation) and keeps its values, statistics and gradients."""
    import jaxmem

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return TorchBatchNorm(name="bn")(nn.Dense(4, name="fc")(x), train)

    x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    m = Net()
    v = jax.jit(m.init, static_argnums=2)(jax.random.PRNGKey(1), x, False)

    def loss(model, p):
        y, upd = model.apply({**v, "params": p}, x, True, mutable=["batch_stats"])
        return jnp.sum(jnp.sin(y)), upd

    conv = jaxmem.linen.convert(m)
    rep = jaxmem.report(lambda p: jax.grad(lambda p: loss(conv, p)[0])(p), v["params"])
    assert [(e.kind, e.status) for e in rep.entries if e.path == "bn"] == [
        ("norm", "converted")], str(rep)
    (l0, u0), g0 = jax.jit(jax.value_and_grad(lambda p: loss(m, p), has_aux=True))(v["params"])
    (l1, u1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(conv, p), has_aux=True))(
        v["params"])
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    # fc's bias gradient is zero in exact arithmetic (BatchNorm removes the mean): what is
    # left is fp32 rounding of terms of the gradient's scale, so atol scales with the tree
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(g0))
    assert_tree_close((u1, g1), (u0, g0), rtol=1e-5, atol=1e-6 * max(1.0, scale))
