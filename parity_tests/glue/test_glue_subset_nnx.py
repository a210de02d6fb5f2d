"""Trainable subsets (errors, boxed parameters, has_aux, argnums) and jaxmem.nnx.convert."""
from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmem
from jaxmem import selective as S

X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)


class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        k = nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b"))
        x = nn.Dense(5, kernel_init=k)(x)
        k2 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("x", "y"))
        return nn.Dense(1, kernel_init=k2)(jnp.tanh(x))


def test_filter_matching_nothing_raises_with_paths():
    p = Boxed().init(jax.random.PRNGKey(0), X)["params"]
    loss = lambda p: jnp.sum(Boxed().apply({"params": p}, X) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"'Dense_9/kernel'.*Dense_0/kernel"):
        S.grad(loss, trainable="Dense_9/kernel")(p)
    with pytest.raises(ValueError, match="selects none"):
        S.train_step(loss, optax.sgd(0.1), trainable=lambda path, leaf: False).init(p)


def test_boxed_parameters_matched_by_layer_path():
    p = Boxed().init(jax.random.PRNGKey(0), X)["params"]
    loss = lambda p: jnp.sum(Boxed().apply({"params": p}, X) ** 2)  # noqa: E731
    g = S.grad(loss, trainable=r"Dense_0/kernel$")(p)
    full = jax.grad(loss)(p)
    np.testing.assert_allclose(np.asarray(g["Dense_0"]["kernel"].value),
                               np.asarray(full["Dense_0"]["kernel"].value), rtol=1e-6)
    assert g["Dense_1"]["kernel"].value is None and g["Dense_0"]["bias"] is None
    g = S.grad(loss, trainable=r"Dense_1/kernel$")(p)  # LogicallyPartitioned
    assert g["Dense_1"]["kernel"].value is not None


def test_train_step_has_aux_batch_stats():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x)))

    v = M().init(jax.random.PRNGKey(0), X)

    def loss(p, stats, x):
        y, upd = M().apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.mean(y ** 2), upd["batch_stats"]

    ts = S.train_step(loss, optax.sgd(0.1), trainable="BatchNorm", has_aux=True)
    st = ts.init(v["params"])
    p2, _, l, stats = ts.step(v["params"], st, v["batch_stats"], X)
    assert np.isfinite(float(l))
    assert not np.allclose(np.asarray(stats["BatchNorm_0"]["mean"]), 0.0)
    np.testing.assert_array_equal(np.asarray(p2["Dense_0"]["kernel"]),
                                  np.asarray(v["params"]["Dense_0"]["kernel"]))


def test_nnx_value_and_grad_argnums_and_deprecated_argnum():
    m = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    f = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    _, g = S.nnx_value_and_grad(f, argnums=0)(m, X)
    with pytest.warns(DeprecationWarning, match="argnums"):
        _, g2 = S.nnx_value_and_grad(f, argnum=0)(m, X)
    np.testing.assert_array_equal(np.asarray(g.kernel[...]), np.asarray(g2.kernel[...]))


class NNet(nnx.Module):
    def __init__(self, rngs, act: Callable = nnx.relu):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.ln = nnx.LayerNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)
        self.act = act

    def __call__(self, x):
        return self.l2(nnx.gelu(self.act(self.ln(self.l1(x)))))


def test_nnx_convert_copy_and_in_place_match():
    a = NNet(nnx.Rngs(0))
    kernel = a.l1.kernel
    b = jaxmem.nnx.convert(a)  # copy
    assert type(a) is NNet and isinstance(b, NNet) and b is not a and a.l1.kernel is kernel
    f = lambda m: jnp.sum(jnp.sin(m(X)))  # noqa: E731
    ga, gb = nnx.grad(f)(a), nnx.grad(f)(b)
    for u, v in zip(jax.tree.leaves(nnx.state(ga)), jax.tree.leaves(nnx.state(gb))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    c = jaxmem.nnx.convert(nnx.clone(a), copy=False)
    jaxpr = str(jax.make_jaxpr(lambda x: c(x))(X))
    assert "custom_vjp" in jaxpr  # the field relu and the layers were converted
    assert type(c.l1) is nnx.Linear and c.act is a.act  # layers and fields untouched
    rep = jaxmem.report(lambda x: c(x), X)
    acts = [e.reason for e in rep.by_kind("activation") if e.status == "converted"]
    # the field relu and the gelu after it are one elementwise function of the norm's
    # output: exact, its input kept and its derivative recomputed
    assert any("exact (input kept" in r for r in acts), str(rep)
    assert [e.status for e in rep.by_kind("dot")] == ["converted", "converted"]
    with pytest.raises(TypeError, match="nnx.Module"):
        jaxmem.nnx.convert(nn.Dense(3))
