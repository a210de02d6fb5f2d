"""BatchNorm with ``axis_name`` (cross-replica statistics) is converted and equals Flax's
BatchNorm -- values, running statistics and gradients -- under ``vmap(axis_name=...)`` and
``shard_map``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import selective as S


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * 2 + 0.5, jnp.float32)


class Net(nn.Module):
    fast: bool = True
    groups: tuple | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="dev",
                         axis_index_groups=self.groups, use_fast_variance=self.fast,
                         momentum=0.9)(x)
        return nn.Dense(2)(jnp.tanh(x))


def _step(model, v, xs, train=True):
    """Per-device loss under vmap(axis_name='dev'); grads of the summed losses."""
    def local(p, x):
        y, upd = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x, train,
                             mutable=["batch_stats"])
        return jnp.sum(jnp.sin(y)), (y, upd)

    def total(p, xs):
        losses, aux = jax.vmap(local, in_axes=(None, 0), axis_name="dev")(p, xs)
        return jnp.sum(losses), aux

    (_, aux), g = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(v["params"], xs)
    return aux, g


@pytest.mark.parametrize("fast,groups,train", [(True, None, True), (False, None, True),
                                               (True, None, False)])
def test_vmap_axis_name_equals_flax(fast, groups, train):
    xs = _x(0, (4, 5, 3))  # 4 "devices", 5 examples each
    model = Net(fast=fast, groups=groups)

    @jax.jit  # one compiled program, not one per eager op
    def init(xs):
        v = jax.vmap(lambda x: model.init(jax.random.PRNGKey(0), x), axis_name="dev")(xs)
        v = jax.tree.map(lambda a: a[0], v)
        # running statistics away from their initial 0 / 1 (eval mode normalises with them)
        return dict(v, batch_stats=jax.tree.map(lambda a: a * 1.5 + 0.25, v["batch_stats"]))

    v = init(xs)
    conv = jaxmem.linen.convert(model)
    step = jax.jit(_step, static_argnums=(0, 3))
    (y0, u0), g0 = step(model, v, xs, train)
    (y1, u1), g1 = step(conv, v, xs, train)
    for a, b in zip(jax.tree.leaves((y1, u1, g1)), jax.tree.leaves((y0, u0, g0))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)
    rep = jaxmem.report(lambda xs: _step(conv, v, xs), xs)
    assert [e.status for e in rep.by_kind("dot")] == ["converted", "converted"], str(rep)
    # the training step's statistics go through lax.pmean: the norm becomes jaxmem's batch
    # norm with the same axis name
    norms = [(e.status, "pooled over axis 'dev'" in e.target) for e in rep.by_kind("norm")]
    assert norms == [("converted", True)], str(rep)


def test_batch_norm_function_axis_name_float64_and_residuals():
    with jax.enable_x64(True):
        xs = _x(1, (3, 4, 2, 5)).astype(jnp.float64)
        scale = jnp.linspace(0.5, 1.5, 5, dtype=jnp.float64)
        bias = jnp.linspace(-1, 1, 5, dtype=jnp.float64)

        def ref(x, s, b):  # flax's formula, written out
            mu = jax.lax.pmean(jnp.mean(x, (0, 1)), "d")
            var = jnp.maximum(0.0, jax.lax.pmean(jnp.mean(x * x, (0, 1)), "d") - mu * mu)
            return (x - mu) * jax.lax.rsqrt(var + 1e-5) * s + b

        def ours(x, s, b):
            return S.batch_norm(x, s, b, train=True, axis_name="d")[0]

        def grads(f):
            def tot(xs, s, b):
                return jnp.sum(jnp.sin(jax.vmap(f, (0, None, None), axis_name="d")(xs, s, b)))
            return jax.jit(jax.grad(tot, (0, 1, 2)))(xs, scale, bias)

        for a, b in zip(grads(ours), grads(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="axis_index_groups"):
        jax.vmap(lambda x: S.batch_norm(x, train=True, axis_name="d",
                                        axis_index_groups=3)[0], axis_name="d")(xs)


@pytest.mark.slow
def test_shard_map_four_devices_in_subprocess():
    """shard_map over a 'data' axis of 4 devices: fast and two-pass variance, train and
    eval mode, gradients of the parameters and the input equal Flax's."""
    code = textwrap.dedent('''
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
        from jax.sharding import Mesh, PartitionSpec as P
        import jaxmem
        class Net(nn.Module):
            fast: bool = True
            @nn.compact
            def __call__(self, x, train: bool = True):
                x = nn.BatchNorm(use_running_average=not train, axis_name="data",
                                 use_fast_variance=self.fast, momentum=0.9)(jnp.sin(x) * 3.0)
                return jnp.tanh(x)
        mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 3)), jnp.float32)
        for fast in (True, False):
            m = Net(fast)
            v = jax.shard_map(lambda x: m.init(jax.random.PRNGKey(0), x), mesh=mesh,
                              in_specs=P("data"), out_specs=P())(x)
            stats = jax.tree.map(lambda a: a + 0.25, v["batch_stats"])
            for train in (True, False):
                def loss(model, p, x):
                    def local(p, x):
                        y, upd = model.apply({"params": p, "batch_stats": stats}, x,
                                             train=train, mutable=["batch_stats"])
                        return jax.lax.psum(jnp.sum(jnp.sin(y) * x[:, :1]), "data"), (y, upd)
                    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")),
                                         out_specs=(P(), (P("data"), P())))(p, x)
                conv = jaxmem.linen.convert(m)
                # jitted: one compiled program per model instead of one per eager op
                step = jax.jit(jax.grad(loss, (1, 2), has_aux=True), static_argnums=0)
                r0 = step(m, v["params"], x)
                r1 = step(conv, v["params"], x)
                for a, b in zip(jax.tree.leaves(r1), jax.tree.leaves(r0)):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                               atol=2e-6, err_msg=f"fast={fast} train={train}")
        print("OK", len(jax.devices()))
    ''')
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=False,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 4" in out.stdout
