"""Normalisations whose statistics go through a collective -- Flax's
``BatchNorm(axis_name=...)`` (``lax.pmean``: a ``psum`` and a division) under
``vmap(axis_name=...)``, ``shard_map`` and ``pmap``, hand-written ``psum`` spellings, and
``LayerNorm`` / ``RMSNorm(axis_name=...)`` -- become ``jaxmem.selective.normalize`` with the
same axis name (and ``axis_index_groups``):
values, gradients and updated batch statistics equal the untouched model's, the report
names the axis, and a training step keeps fewer bytes.  A spelling that pools something
else stays, with a reason; an unbound axis name fails as it does in JAX."""
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
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmem.measure import compiled_memory
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal


class ConvNet(nn.Module):
    """``depth`` times Conv -> BatchNorm (statistics over ``axis``) -> tanh, then Dense."""
    fast: bool = True
    axis: str = "batch"
    depth: int = 1

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.Conv(8, (3, 3))(x)
            x = jnp.tanh(nn.BatchNorm(use_running_average=False, axis_name=self.axis,
                                      momentum=0.9, use_fast_variance=self.fast)(x))
        return nn.Dense(3)(x)


def _perturbed(tree):
    """Flax's init (ones / zeros) with fresh noise, so scale, bias and statistics matter
    (added in NumPy: no compile per leaf shape)."""
    def noisy(a):
        a = np.asarray(a)
        return jnp.asarray(a + np.asarray(normal(a.shape, scale=0.3), a.dtype))
    return jax.tree_util.tree_map(noisy, tree)


def _variables(model, x):
    """Parameters and batch statistics (initialised for one replica under a bound axis),
    perturbed; one compiled init (op by op it compiles each initialiser op)."""
    v = jax.jit(jax.vmap(lambda x: model.init(jax.random.key(0), x),
                         axis_name=model.axis))(x[None])
    v = jax.tree_util.tree_map(lambda a: np.asarray(a)[0], v)
    return _perturbed(v["params"]), _perturbed(v["batch_stats"])


def _local(model, stats):
    """One replica's loss and its updated batch statistics."""
    def f(p, x):
        y, new = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.sum(jnp.sin(y) * y), new["batch_stats"]
    return f


def _vmap_steps(*fs):
    """Per function of ``fs``: values, updated statistics and gradients (parameters,
    inputs) of the loss summed over the replicas of ``vmap(axis_name="batch")``; one
    compiled program for all of them."""
    def total(f):
        def tot(p, xs):
            losses, new = jax.vmap(f, (None, 0), axis_name="batch")(p, xs)
            return jnp.sum(losses), new
        return jax.value_and_grad(tot, (0, 1), has_aux=True)
    return jax.jit(lambda p, xs: tuple(total(f)(p, xs) for f in fs))


def _rows(g, p, xs, axis="batch"):
    """``g``'s report rows of kind ``norm``, traced for one replica under
    ``vmap(axis_name=axis)``."""
    out = []
    jax.eval_shape(jax.vmap(lambda x: out.append(g.report(p, x).by_kind("norm")) or x,
                            axis_name=axis), xs)
    return out[0]


def _replica_sum(fn, axis="r"):
    """``fn(p, x)`` summed over the replicas of ``vmap(axis_name=axis)`` (``x`` batched)."""
    return lambda p, xs: jnp.sum(jax.vmap(fn, (None, 0), axis_name=axis)(p, xs))


def _pooled_grads_match(f, g, p, xs):
    """Values and gradients (parameters, inputs) of ``g`` summed over replicas equal
    ``f``'s in float64 (one compiled program for both)."""
    got, want = jax.jit(lambda p, xs: tuple(jax.value_and_grad(_replica_sum(fn), (0, 1))(
        p, xs) for fn in (g, f)))(p, xs)
    close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-variance", "two-pass"])
def test_linen_batch_norm_under_vmap_axis_name(fast):
    model = ConvNet(fast=fast)
    xs = normal((3, 4, 5, 5, 2), scale=2.0) + 0.5     # 3 replicas of 4 examples
    xs = xs * jnp.arange(1.0, 4.0)[:, None, None, None, None]  # replicas differ in scale
    p, stats = _variables(model, xs[0])
    f = _local(model, stats)
    g = transform(f)
    ((lg, ng), gg), ((lf, nf), gf) = _vmap_steps(g, f)(p, xs)
    close(lg, lf)
    close(ng, nf)          # running mean / variance from the pooled statistics
    close(gg, gf)
    # pooled, not per replica: the replicas' running means agree, unlike their own means
    assert np.allclose(nf["BatchNorm_0"]["mean"][0], nf["BatchNorm_0"]["mean"][1])
    rows = _rows(g, p, xs)
    assert [(r.converted, r.became) for r in rows] == [(True, "jaxmem.selective.normalize")]
    assert rows[0].matched.startswith("batch norm")
    assert "pooled over axis 'batch'" in rows[0].matched and "mu, var" in rows[0].matched
    assert rows[0].name_stack == "ConvNet/BatchNorm_0"
    assert "test_transform_sync_norm.py" in rows[0].where


def test_linen_batch_norm_in_shard_map():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    model = ConvNet(axis="data")
    x = normal((6, 5, 5, 2), scale=1.5) + 0.3
    p, stats = _variables(model, x)
    local = _local(model, stats)

    def f(p, x):
        loss, new = local(p, x)
        return jax.lax.psum(loss, "data"), new

    f = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    g = transform(f)
    close(*jax.jit(lambda p, x: tuple(jax.value_and_grad(fn, (0, 1), has_aux=True)(p, x)
                                      for fn in (g, f)))(p, x))
    rows = g.report(p, x).by_kind("norm")
    assert [(r.converted, r.path) for r in rows] == [(True, "shard_map")]
    assert "pooled over axis 'data'" in rows[0].matched


def test_nnx_batch_norm_under_vmap_axis_name():
    bn = nnx.BatchNorm(4, axis_name="batch", momentum=0.8, rngs=nnx.Rngs(0))
    bn.scale[...] = 1.0 + normal((4,), scale=0.3)
    bn.bias[...] = normal((4,), scale=0.3)
    gdef, params, stats = nnx.split(bn, nnx.Param, nnx.BatchStat)
    xs = normal((3, 5, 4), scale=2.0) + jnp.arange(3.0)[:, None, None]

    def f(params, x):
        m = nnx.merge(gdef, *jax.tree_util.tree_map(lambda a: a, (params, stats)))
        y = m(x, use_running_average=False)
        return jnp.sum(jnp.cos(y) * jnp.arange(4.0)), nnx.state(m, nnx.BatchStat)

    g = transform(f)
    close(*_vmap_steps(g, f)(params, xs))
    rows = _rows(g, params, xs)
    assert [r.converted for r in rows] == [True] and "axis 'batch'" in rows[0].matched


def _psum_count(w, b, x):  # sums and a psum'd count
    n = jax.lax.psum(jnp.asarray(x.shape[0], x.dtype), "r")
    mu = jax.lax.psum(jnp.sum(x, 0), "r") / n
    var = jax.lax.psum(jnp.sum((x - mu) ** 2, 0), "r") / n
    return jnp.sum(jnp.sin((x - mu) / jnp.sqrt(var + 1e-5) * w + b))


def _pmean(w, b, x):  # pmean of the moments, ``1 / sqrt``, a count from psum(1)
    m1 = jax.lax.pmean(jnp.mean(x, 0), "r")
    m2 = jax.lax.psum(jnp.mean(x * x, 0), "r") / jax.lax.psum(1, "r")
    return jnp.sum(jnp.sin(w * (x - m1) / jnp.sqrt(m2 - m1 * m1 + 1e-3) + b))


def _within(w, b, x):  # pooled mean, but each replica's variance around its own mean
    m = jnp.mean(x, 0)
    mu = jax.lax.pmean(m, "r")
    var = jax.lax.pmean(jnp.mean((x - m) ** 2, 0), "r")
    return jnp.sum(jnp.sin((x - mu) * jax.lax.rsqrt(var + 1e-5) * w + b))


@pytest.mark.parametrize("spelling", [_psum_count, _pmean, _within],
                         ids=["psum-count", "pmean", "within-replica-variance"])
def test_hand_written_spellings_float64(spelling):
    with jax.enable_x64(True):
        xs = normal((4, 6, 5), jnp.float64, 2.0) + normal((4, 1, 5), jnp.float64)
        w, b = normal((5,), jnp.float64, 0.3) + 1.0, normal((5,), jnp.float64)
        g = transform(spelling)

        def grads(fn, *args):
            tot = lambda w, b, xs: jnp.sum(jax.vmap(fn, (None, None, 0), axis_name="r")(
                w, b, xs))
            return jax.value_and_grad(tot, (0, 1, 2))(*args)

        # one compiled program for both sides
        got, want = jax.jit(lambda *a: (grads(g, *a), grads(spelling, *a)))(w, b, xs)
        close(got, want, rtol=1e-10, atol=1e-10)
        out = []
        jax.eval_shape(jax.vmap(lambda x: out.append(g.report(w, b, x).by_kind("norm")) or x,
                                axis_name="r"), xs)
        rows = out[0]
    if spelling is _within:   # not a batch norm of the pooled batch: left, with a reason
        assert rows and not any(r.converted for r in rows) and all(r.reason for r in rows)
    else:
        assert [r.converted for r in rows] == [True]
        assert "pooled over axis 'r'" in rows[0].matched


class _SeqNorms(nn.Module):
    """Dense -> LayerNorm -> tanh -> Dense -> RMSNorm with statistics pooled over ``axis``
    (Flax's ``axis_name`` on ``LayerNorm`` / ``RMSNorm``: sequence- or tensor-parallel
    normalisation), fast or two-pass variance."""
    fast: bool = True
    axis: str = "r"

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6)(x)
        x = jnp.tanh(nn.LayerNorm(axis_name=self.axis, use_fast_variance=self.fast)(x))
        x = nn.Dense(5)(x)
        return nn.RMSNorm(axis_name=self.axis)(x)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-variance", "two-pass"])
def test_layer_and_rms_norm_pooled_over_a_named_axis(fast):
    """``nn.LayerNorm(axis_name=...)`` and ``nn.RMSNorm(axis_name=...)`` under
    ``vmap(axis_name=...)``: both become :func:`jaxmem.selective.normalize` with the same
    axis name (statistics pooled over the replicas); values and gradients equal Flax's in
    float64, and the step keeps fewer residual bytes than the untouched one."""
    from jaxmem.measure import residual_bytes

    model = _SeqNorms(fast=fast)
    with jax.enable_x64(True):
        xs = normal((4, 3, 7), jnp.float64, 2.0) + normal((4, 1, 7), jnp.float64)
        # one compiled init (float64, op by op it compiles each initialiser op)
        v = jax.jit(jax.vmap(lambda x: model.init(jax.random.key(0), x), axis_name="r"))(xs)
        p = _perturbed(jax.tree_util.tree_map(lambda a: np.asarray(a)[0], v)["params"])
        f = lambda p, x: jnp.sum(jnp.sin(model.apply({"params": p}, x)) ** 2)
        g = transform(f)
        _pooled_grads_match(f, g, p, xs)
        rows = _rows(g, p, xs, "r")
        assert [r.converted for r in rows] == [True, True], rows
        assert all("pooled over axis 'r'" in r.matched for r in rows)
        kept = [residual_bytes(_replica_sum(fn), p, xs).activation_bytes for fn in (f, g)]
    assert kept[1] < kept[0], kept


def test_group_norm_pooled_over_a_named_axis():
    """``nn.GroupNorm(axis_name=...)`` under ``vmap(axis_name=...)``: re-emitted as
    :func:`jaxmem.selective.group_norm` with the same axis name; float64 values and
    gradients equal Flax's."""
    gn = nn.GroupNorm(num_groups=2, axis_name="r")
    with jax.enable_x64(True):
        xs = normal((3, 2, 4, 4, 6), jnp.float64, 2.0) + normal((3, 2, 1, 1, 6), jnp.float64)
        v = jax.jit(jax.vmap(lambda x: gn.init(jax.random.key(0), x), axis_name="r"))(xs)
        p = _perturbed(jax.tree_util.tree_map(lambda a: np.asarray(a)[0], v))
        f = lambda p, x: jnp.sum(jnp.sin(gn.apply(p, x)) ** 2)
        g = transform(f)
        _pooled_grads_match(f, g, p, xs)
        rows = _rows(g, p, xs, "r")
    assert [(r.converted, r.became) for r in rows] == [(True, "jaxmem.selective.group_norm")]
    assert "pooled over axis 'r'" in rows[0].matched


def test_axis_index_groups_under_pmap():
    """``pmap`` over the available devices with one group of all of them (the
    multi-device case with two groups: :func:`test_pmap_groups_in_subprocess`)."""
    n = jax.local_device_count()
    bn = nn.BatchNorm(use_running_average=False, axis_name="b",
                      axis_index_groups=[list(range(n))])
    xs = normal((n, 6, 3), scale=2.0) + 1.0
    v = jax.jit(bn.init)(jax.random.key(0), xs[0])
    p, stats = _perturbed(v["params"]), _perturbed(v["batch_stats"])
    f = _local(bn, stats)
    g = transform(f)
    step = lambda fn: jax.pmap(jax.value_and_grad(fn, (0, 1), has_aux=True), axis_name="b",
                               in_axes=(None, 0))(p, xs)
    close(step(g), step(f))
    out = []
    jax.eval_shape(jax.pmap(lambda x: out.append(g.report(p, x).by_kind("norm")) or x,
                            axis_name="b"), xs)
    assert [r.converted for r in out[0]] == [True]
    assert "axis_index_groups" in out[0][0].matched


@pytest.mark.slow
def test_pmap_groups_in_subprocess():
    """Four host devices in two groups of two: the statistics pooled per group (the check
    simulates a group's replicas), values, gradients and running statistics equal Flax's."""
    code = textwrap.dedent('''
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
        from jaxmem.transform import transform
        bn = nn.BatchNorm(use_running_average=False, axis_name="b", momentum=0.9,
                          axis_index_groups=[[0, 2], [1, 3]])
        rng = np.random.default_rng()
        x = jnp.asarray(rng.normal(size=(4, 5, 3)) * 2 + rng.normal(size=(4, 1, 3)),
                        jnp.float32)
        v = bn.init(jax.random.key(0), x[0])
        def f(p, x):
            y, u = bn.apply({"params": p, "batch_stats": v["batch_stats"]}, x,
                            mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y) * x), u
        g = transform(f)
        run = lambda fn: jax.pmap(jax.value_and_grad(fn, (0, 1), has_aux=True),
                                  axis_name="b", in_axes=(None, 0))(v["params"], x)
        got, want = run(g), run(f)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        mean = np.asarray(want[0][1]["batch_stats"]["mean"])
        assert np.allclose(mean[0], mean[2]) and not np.allclose(mean[0], mean[1])
        rows = []
        jax.eval_shape(jax.pmap(lambda x: rows.append(g.report(v["params"], x)) or x,
                                axis_name="b"), x)
        (row,) = rows[0].by_kind("norm")
        assert row.converted and "[[0, 2], [1, 3]]" in row.matched, row
        print("OK", jax.local_device_count())
    ''')
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         check=False, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 4" in out.stdout


def test_unbound_axis_name_fails_as_in_jax():
    bn = nn.BatchNorm(use_running_average=False, axis_name="batch")
    x = normal((4, 3))
    v = nn.BatchNorm(use_running_average=False).init(jax.random.key(0), x)
    f = lambda v, x: bn.apply(v, x, mutable=["batch_stats"])
    errors = []
    for fn in (f, transform(f)):
        with pytest.raises(NameError, match="unbound axis name: batch") as e:
            jax.jit(fn)(v, x)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


@pytest.mark.xla_cpu
def test_compiled_step_keeps_fewer_bytes_under_vmap_axis_name():
    """XLA:CPU's plan (``xla_cpu``: compiled for the CPU wherever the test runs). XLA:GPU's
    plan of this small ``vmap(axis_name=...)`` conv step keeps no fewer bytes with the norms
    converted (H100 plan: 478496 vs 476184 B without them) and more than the untouched step
    (373528 B): a miss at this size (12 x 12, 8 channels). Per part (H100 plan, jax 0.10.2):
    the ReLU masks alone 522520 B, 374040 B with the ties' optimization barriers removed (so
    the barriers cost the 148 KB here); the norms alone 450080 B with or without them; the
    products alone 474392 B. Without the norms (conv -> ReLU twice, same sizes) the masks
    keep 0.76x of the untouched step's temporaries vmapped or not, while the converted
    convolutions lose theirs under ``vmap`` (0.76x unbatched, 1.00x vmapped), with or
    without the barriers. A Dense -> BatchNorm stack across devices keeps the saving:
    ``parity_tests/gpu_plan/test_gpu_plan_sync_norm.py``."""
    model = ConvNet(depth=2)
    xs = normal((2, 8, 12, 12, 3))      # 2 replicas of 8 examples
    p, stats = _variables(model, xs[0])
    f = _local(model, stats)

    def step(fn):
        loss = lambda p, xs: jnp.sum(jax.vmap(fn, (None, 0), axis_name="batch")(p, xs)[0])
        return compiled_memory(jax.grad(loss), p, xs).temp_bytes

    untouched, no_norms, converted = step(f), step(transform(f, norms=False)), step(
        transform(f))
    act = xs.size // 3 * 8 * 4          # bytes of one conv output (all replicas)
    assert converted < untouched, (converted, untouched)
    # the converted batch norms account for half an activation or more of it
    assert no_norms - converted >= act // 2, (converted, no_norms, act)
