"""Flax glue (Linen convert/scope, NNX convert) on the zoo models and trainable subsets."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assert import assert_tree_close, assert_tree_norm_close
from _lazy import once
from flax import nnx

import jaxmem
import jaxmem.selective as S
from jaxmem import models

#: the selective part alone (no attention; few-bit is off by default)
_convert = functools.partial(jaxmem.linen.convert, attention=False)
_nnx_convert = functools.partial(jaxmem.nnx.convert, attention=False, copy=False)

# test inputs drawn with NumPy (``jax.random`` op by op compiles a program per shape)
X = once(lambda: jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 16, 3)), jnp.float32))
# BatchNorm needs several values per channel in the last stage (n=2 makes the normalised
# output +-1 and its input gradient pure rounding noise).
X4 = once(lambda: jnp.asarray(np.random.default_rng(1).normal(size=(4, 32, 32, 3)),
                              jnp.float32))
# Per leaf ||a - b|| <= tol * ||b|| (assert_tree_norm_close): deep BN nets accumulate f32
# rounding differences of a few 1e-5 relative per leaf between two exact-in-math
# implementations; its atol is an absolute slack per element, for leaves ~0 in exact math.


@pytest.mark.parametrize("name", ["resnet", "convchain", "mlp"])
def test_linen_convert_zoo_same_outputs_and_grads(name):
    # resnet: the zoo ResNet (BasicBlock, imagenet stem) with stages (1, 1): one identity
    # block and one strided block with a projection shortcut -- every kind of ResNet-18 block,
    # at a third of its compile cost.
    # float64: a width-1/8 ResNet in train-mode BatchNorm at batch 4 amplifies f32
    # rounding differences between two exact-in-math implementations to ~1e-4 relative
    # (machine- and backend-dependent), so the tight comparison is made in float64
    with jax.enable_x64(True):
        model, x = {
            "resnet": (models.ResNet("basic", (1, 1), width=0.125, num_classes=5), X4()),
            "vgg11_bn": (models.vgg11(width=0.125, batch_norm=True, num_classes=5), X4()),
            "convchain": (models.ConvChain(depth=3, channels=3), X()),
            "mlp": (models.MLP(features=(16, 8)), X().reshape(2, -1)),
        }[name]
        x = jnp.asarray(x, jnp.float64)
        has_bn = name in ("resnet", "vgg11_bn")
        v = jax.jit(functools.partial(model.init, **({"train": False} if has_bn else {})))(
            jax.random.key(1), x)
        v = jax.tree.map(lambda a: a.astype(jnp.float64), v)
        sm = _convert(model)

        def loss(m, params, x):
            rest = {k: t for k, t in v.items() if k != "params"}
            if has_bn:
                y, upd = m.apply({"params": params, **rest}, x, train=True,
                                 mutable=["batch_stats"])
            else:
                y, upd = m.apply({"params": params}, x), {}
            return jnp.sum(jnp.sin(y)), upd

        def grads(m):  # ((parameter grads, input grad), updated statistics): one backward
            return jax.jit(jax.grad(lambda p, x: loss(m, p, x), (0, 1), has_aux=True))(
                v["params"], x)

        (gp0, gx0), u0 = grads(model)
        (gp1, gx1), u1 = grads(sm)
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves((gp1, gx1)))
        assert_tree_norm_close(gp0, gp1, tol=1e-9, atol=1e-12)
        assert_tree_norm_close(gx0, gx1, tol=1e-9, atol=1e-12)
        assert_tree_close(u0, u1, rtol=1e-12, atol=1e-12)  # running statistics updated identically
        assert jax.tree.structure(jax.eval_shape(lambda x: sm.init(jax.random.key(1), x, **(
            {"train": False} if has_bn else {})), x)) == jax.tree.structure(v)


def test_linen_convert_flax_builtin_norms_and_dropout():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            x = nn.GroupNorm(num_groups=4)(x)
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = nn.LayerNorm()(x)
            x = nn.RMSNorm()(x)
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(4)(x.reshape(x.shape[0], -1))

    net = Net()
    v = jax.jit(net.init, static_argnums=2)(jax.random.key(0), X(), False)
    rngs = {"dropout": jax.random.key(3)}

    def loss(m, p):
        y, upd = m.apply({"params": p, "batch_stats": v["batch_stats"]}, X(), True,
                         mutable=["batch_stats"], rngs=rngs)
        return jnp.sum(y ** 2), upd
    g0 = jax.jit(jax.grad(lambda p: loss(net, p), has_aux=True))(v["params"])
    g1 = jax.jit(jax.grad(lambda p: loss(_convert(net), p), has_aux=True))(v["params"])
    assert_tree_close(g0, g1, rtol=1e-4, atol=1e-5)


def test_transform_converts_inline_relus_and_patches_nothing():
    before = (jax.nn.relu, nn.relu, nn.max_pool)
    x = jnp.linspace(-1.0, 1.0, 8)

    def traced(fn):
        return str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x)))))(x))

    plain = traced(jax.nn.relu)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(S.relu(x))))(x)
    for relu in (jax.nn.relu, nn.relu):
        conv = jaxmem.transform(relu, attention=False)
        assert traced(conv) != plain  # the 1-bit mask, not JAX's own residuals
        np.testing.assert_array_equal(jax.grad(lambda x, c=conv: jnp.sum(jnp.sin(c(x))))(x), want)
    assert (jax.nn.relu, nn.relu, nn.max_pool) == before
    assert traced(jax.nn.relu) == plain


def test_converters_reject_wrong_models():
    with pytest.raises(TypeError, match="flax.linen.Module"):
        _convert(object())
    with pytest.raises(TypeError, match="nnx.Module"):
        _nnx_convert(models.ConvChain(depth=1, channels=3))


def test_nnx_convert_shares_variables_and_matches():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.c = nnx.Conv(3, 8, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.ln = nnx.LayerNorm(8, rngs=rngs)
            self.l = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.bn(self.c(x), use_running_average=False))
            return self.l(self.ln(h))

    a = Net(nnx.Rngs(0))
    b = nnx.clone(a)
    kernel = b.c.kernel
    _nnx_convert(b)
    assert b.c.kernel is kernel
    f = lambda m: jnp.sum(jnp.sin(m(X())))
    ga = nnx.jit(nnx.grad(f))(a)   # the batch-norm statistics are updated through nnx.jit
    gb = nnx.jit(nnx.grad(f))(b)
    # the conv bias feeds a train-mode batch norm: its gradient is 0 in exact math and
    # f32 rounding noise of a few 1e-5 in both implementations
    assert_tree_norm_close(nnx.state(ga), nnx.state(gb), tol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a.bn.mean[...], b.bn.mean[...], rtol=1e-6)
    vg = S.nnx_value_and_grad(f, nnx.All(nnx.Param, nnx.PathContains("l")))
    _, g = vg(b)
    assert set(nnx.to_pure_dict(nnx.state(g))) == {"l"}


# --------------------------------------------------------------------- trainable subsets
def test_partition_combine_and_filters():
    p = {"a": {"kernel": jnp.ones(2), "bias": jnp.zeros(2)}, "b": {"kernel": jnp.ones(3)}}
    t, f = S.partition(p, r"^(a/kernel|b/)")
    assert t["a"]["bias"] is None and f["a"]["kernel"] is None
    assert jax.tree.structure(S.combine(t, f)) == jax.tree.structure(p)
    m = S.trainable_mask(p, {"a": False, "b": True})
    assert m == {"a": {"kernel": False, "bias": False}, "b": {"kernel": True}}
    with pytest.raises(TypeError, match="bool"):
        S.trainable_mask(p, lambda path, leaf: 1)
    with pytest.raises(ValueError, match="trainable"):
        S.trainable_mask(p, {"a": True})


def test_value_and_grad_and_train_step_match_optax_masked():
    model = models.MLP(features=(16, 16, 4))
    x = X().reshape(2, -1)
    params = model.init(jax.random.key(1), x)["params"]
    loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
    flt = lambda path, leaf: S.path_str(path).startswith("dense_2")
    val, g = S.value_and_grad(loss, trainable=flt)(params, x)
    ref_val, ref_g = jax.jit(jax.value_and_grad(loss))(params, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-6)
    np.testing.assert_allclose(g["dense_2"]["kernel"], ref_g["dense_2"]["kernel"], rtol=1e-6)
    assert g["dense_0"]["kernel"] is None
    # one optimiser step equals optax.masked freezing
    opt = optax.adam(1e-2)
    ts = S.train_step(loss, opt, flt)
    p1, _, _ = ts.step(params, ts.init(params), x)
    mask = S.trainable_mask(params, flt)
    ref = optax.multi_transform({True: opt, False: optax.set_to_zero()}, mask)

    @jax.jit
    def ref_step(params, x):
        upd, _ = ref.update(jax.grad(loss)(params, x), ref.init(params), params)
        return optax.apply_updates(params, upd)

    p2 = ref_step(params, x)
    assert_tree_close(p1, p2, rtol=1e-6, atol=1e-7)
