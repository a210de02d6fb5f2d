"""The conversions keep their promises at the edges: jit's cache never outlives a scope (or
a transformation's options), the report lists every computation once (also under a
profiler), BatchNorm keeps float64, effects in a scan body run as often as in plain JAX,
converted modules pickle, and ``convert`` works inline in a ``@nn.compact`` method."""
from __future__ import annotations

import cProfile
import pickle
import sys
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem


def _x(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


# ------------------------------------------------------------- 1. jit keys on the options
class _GeluNet(nn.Module):
    """No parameters; its GELU feeds a sine, not a product: few-bit coded under fewbit."""

    @nn.compact
    def __call__(self, x):
        return jnp.sum(jnp.sin(nn.gelu(x)))


_NET = _GeluNet()


def _net_grad(model, x):
    return jax.jit(jax.grad(lambda x: model.apply({}, x)))(x)


def _approx(x, bits):
    """The defined few-bit gradient: the same model converted with ``fewbit=bits``."""
    return _net_grad(jaxmem.linen.convert(_NET, fewbit=bits), x)


pytestmark = pytest.mark.filterwarnings("ignore::jaxmem.JaxmemDeprecationWarning")


def test_jit_inside_scope_called_outside_is_exact_and_inside_again_fewbit():
    x = _x(0, (4, 16))
    exact = _net_grad(_NET, x)
    approx = _approx(x, 2)
    assert float(jnp.max(jnp.abs(approx - exact))) > 1e-3  # the two really differ
    f = jax.jit(jax.grad(lambda x: _NET.apply({}, x)))
    with jaxmem.scope(fewbit=2):
        np.testing.assert_allclose(f(x), approx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f(x), exact, rtol=1e-6, atol=1e-6)
    with jaxmem.scope(fewbit=2):
        np.testing.assert_allclose(f(x), approx, rtol=1e-6, atol=1e-6)


def test_jit_nested_scopes_each_get_their_own_trace():
    x = _x(1, (3, 8))
    f = jax.jit(jax.grad(lambda x: _NET.apply({}, x)))
    exact = _net_grad(_NET, x)
    with jaxmem.scope(fewbit=1):
        np.testing.assert_allclose(f(x), _approx(x, 1), rtol=1e-6, atol=1e-6)
        with jaxmem.scope(fewbit=None):  # inner exact scope: exact gradient
            np.testing.assert_allclose(f(x), exact, rtol=1e-6, atol=1e-6)
            with jaxmem.scope(fewbit=3):
                np.testing.assert_allclose(f(x), _approx(x, 3), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(f(x), _approx(x, 1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f(x), exact, rtol=1e-6, atol=1e-6)


def test_jit_traced_in_a_scope_in_one_thread_is_exact_in_another():
    x = _x(2, (4, 8))
    f = jax.jit(jax.grad(lambda x: _NET.apply({}, x)))
    exact = _net_grad(_NET, x)
    want = _approx(x, 2)
    inside = threading.Event()
    done = threading.Event()
    out = {}

    def scoped():
        with jaxmem.scope(fewbit=2):
            out["scoped"] = f(x)
            inside.set()
            done.wait(30)

    t = threading.Thread(target=scoped)
    t.start()
    assert inside.wait(60)
    out["plain"] = f(x)  # this thread has no scope, while the other one is still in its
    done.set()
    t.join(60)
    np.testing.assert_allclose(out["scoped"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["plain"], exact, rtol=1e-6, atol=1e-6)


def test_jit_of_a_transformed_function_keys_on_its_options():
    x = _x(19, (4, 16))
    loss = lambda x: _NET.apply({}, x)
    f2 = jax.jit(jax.grad(jaxmem.transform(loss, fewbit=2)))
    f0 = jax.jit(jax.grad(jaxmem.transform(loss)))
    np.testing.assert_allclose(f2(x), _approx(x, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f0(x), _net_grad(_NET, x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f2(x), _approx(x, 2), rtol=1e-6, atol=1e-6)


def test_report_sees_the_calls_of_a_function_jitted_before():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(3)(x)))

    x = _x(3, (2, 4))
    model = jaxmem.linen.convert(MLP())
    params = model.init(jax.random.key(0), x)
    inner = jax.jit(model.apply)
    inner(params, x)  # traced and cached before the report
    for _ in range(2):  # and a report does not hide the calls from the next one
        rep = jaxmem.report(lambda p, x: inner(p, x), params, x)
        assert sorted((e.path, e.kind, e.status) for e in rep.entries) == [
            ("", "activation", "converted"), ("Dense_0", "bias", "converted"),
            ("Dense_0", "dot", "converted"), ("Dense_1", "bias", "converted"),
            ("Dense_1", "dot", "converted")], str(rep)


# ------------------------------------------------------------------------ 3. the report
def test_report_lists_an_unconverted_nnx_subclass():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.LoRALinear(4, 3, lora_rank=2, rngs=rngs)
            self.b = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    net = Net(nnx.Rngs(0))
    x = _x(4, (2, 4))
    conv = jaxmem.nnx.convert(net)
    np.testing.assert_allclose(conv(x), net(x), rtol=1e-6, atol=1e-6)
    rep = jaxmem.report(conv, x)
    # the LoRA layer is converted by what it computes: its two products and its base
    # product, like the plain Linear after it
    assert [e.status for e in rep.by_kind("dot")] == ["converted"] * 4, str(rep)
    assert not rep.unconverted(), str(rep)


def test_report_lists_linen_self_attention_once():
    m = nn.SelfAttention(num_heads=2, qkv_features=8)
    x = _x(5, (2, 5, 8))
    params = m.init(jax.random.key(0), x)
    conv = jaxmem.linen.convert(m)
    np.testing.assert_allclose(conv.apply(params, x), m.apply(params, x), rtol=1e-5,
                               atol=1e-5)
    rep = jaxmem.report(conv.apply, params, x)
    att = rep.by_kind("attention")
    assert [(e.technique, e.status) for e in att] == [("attention", "converted")], str(rep)


def test_linen_subclass_calling_super_is_reported_once():
    class Wrapped(nn.Dense):
        def __call__(self, x):
            return super().__call__(x) * 2.0

    m = Wrapped(3)
    x = _x(6, (2, 4))
    params = m.init(jax.random.key(0), x)
    rep = jaxmem.report(jaxmem.linen.convert(m).apply, params, x)
    assert [(e.kind, e.status) for e in rep.entries] == [("dot", "converted"),
                                                         ("bias", "converted")], str(rep)


def test_report_works_under_cprofile_and_leaves_it_running():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(3)(x)))

    x = _x(7, (2, 4))
    model = jaxmem.linen.convert(MLP())
    params = model.init(jax.random.key(0), x)
    expected = jaxmem.report(model.apply, params, x).to_dict()
    def called_after_report():
        return None

    prof = cProfile.Profile()
    prof.enable()
    try:
        rep = jaxmem.report(model.apply, params, x)
        called_after_report()
    finally:
        prof.disable()
    assert rep.to_dict()["entries"] == expected["entries"]
    # the profiler saw report and kept running after it (Python 3.12's cProfile uses
    # sys.monitoring, so sys.getprofile() is no witness there)
    names = {getattr(s.code, "co_name", "") for s in prof.getstats()}
    assert {"report", "called_after_report"} <= names, sorted(names)[:20]


def test_report_chains_a_python_profile_function():
    seen = []

    def prof(frame, event, arg):
        seen.append(event)

    x = _x(8, (2, 4))
    sys.setprofile(prof)
    try:
        rep = jaxmem.report(lambda x: nn.relu(x), x)
        after = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert after is prof and seen
    assert [(e.kind, e.status) for e in rep.entries] == [("activation", "fallback")]


def test_report_of_untouched_code_traces_it_once():
    """What jaxmem.transform would do is read from the one trace of the untouched code."""
    calls = []

    def loss(w, x):
        calls.append(1)
        return jnp.sum(nn.gelu(x @ w) ** 2)

    rep = jaxmem.report(loss, _x(1, (4, 3)), _x(2, (2, 4)))
    assert len(calls) == 1
    assert {(e.kind, e.status) for e in rep.entries} >= {("dot", "fallback"),
                                                         ("activation", "fallback")}


# ------------------------------------------------------------------ 4. BatchNorm float64
def test_batchnorm_x64_statistics_and_gradients_match_flax():
    with jax.enable_x64(True):
        x = _x(9, (6, 5), jnp.float64)
        w = _x(10, (6, 5), jnp.float64)
        for pdt in (jnp.float32, jnp.float64):
            m = nn.BatchNorm(use_running_average=False, param_dtype=pdt)
            v = jax.jit(m.init)(jax.random.key(0), x)
            conv = jaxmem.linen.convert(m)
            # each side one compiled program (compared by tolerance)
            y0, s0 = jax.jit(lambda v, x, m=m: m.apply(v, x, mutable=["batch_stats"]))(v, x)
            y1, s1 = jax.jit(lambda v, x, m=conv: m.apply(v, x, mutable=["batch_stats"]))(v, x)
            assert jax.tree.map(lambda a: a.dtype, s1) == jax.tree.map(lambda a: a.dtype, s0)
            np.testing.assert_allclose(y1, y0, rtol=1e-13, atol=1e-13)
            for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s0)):
                np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
            for stats in (v["batch_stats"], s0["batch_stats"]):
                ev = nn.BatchNorm(use_running_average=True, param_dtype=pdt)

                def loss(p, x, mod, stats=stats):
                    y = mod.apply({"params": p, "batch_stats": stats}, x)
                    return jnp.sum(jnp.sin(y) * w)

                grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
                g0 = grad(v["params"], x, ev)
                g1 = grad(v["params"], x, jaxmem.linen.convert(ev))
                for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
                    assert a.dtype == b.dtype
                    tol = 1e-12 if a.dtype == jnp.float64 else 1e-6  # float32 parameters
                    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# ----------------------------------------------------------------- 5. effects in a scan
def _scan_with_callback(count):
    def body(c, x):
        jax.debug.callback(lambda c: count.append(1), c)
        h = jnp.tanh(c * x)
        return h, h * 2.0

    def loss(c, xs):
        h, ys = jax.lax.scan(body, c, xs)
        return jnp.sum(h) + jnp.sum(ys)

    return loss


def test_scan_body_with_effects_runs_them_as_often_as_plain_jax():
    c, xs = _x(11, (3,)), _x(12, (5, 3))
    plain_count, converted_count = [], []
    g0 = jax.grad(_scan_with_callback(plain_count))(c, xs)
    jax.effects_barrier()
    g1 = jax.grad(jaxmem.transform(_scan_with_callback(converted_count)))(c, xs)
    jax.effects_barrier()
    assert len(plain_count) == 5
    assert len(converted_count) == len(plain_count)
    np.testing.assert_allclose(g1, g0, rtol=1e-6, atol=1e-6)
    rep = jaxmem.report(jax.grad(jaxmem.transform(_scan_with_callback([]))), c, xs)
    scans = [e for e in rep.entries if e.target == "scan"]
    assert scans and "effects" in scans[0].reason and "no scan policy" in scans[0].reason, \
        str(rep)


def test_scan_body_without_effects_runs_under_the_scan_policy():
    rep = jaxmem.report(jax.grad(jaxmem.transform(lambda c, xs: jnp.sum(jax.lax.scan(
        lambda c, x: (jnp.tanh(c * x), None), c, xs)[0]))), _x(13, (3,)), _x(14, (4, 3)))
    scans = [e for e in rep.entries if e.target == "scan"]
    assert [e.status for e in scans] == ["converted"]
    assert "scan_policy" in scans[0].reason


# ------------------------------------------------------------------------- 7. pickling
class _PickleMLP(nn.Module):
    hidden: int = 4

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.gelu(nn.Dense(self.hidden)(x)))


class _PickleNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 3, rngs=rngs)
        self.n = nnx.LayerNorm(3, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.n(self.a(x)))


def test_converted_linen_module_pickles():
    x = _x(15, (2, 4))
    conv = jaxmem.linen.convert(_PickleMLP(hidden=5), fewbit=2)
    params = jax.jit(conv.init)(jax.random.key(0), x)
    back = pickle.loads(pickle.dumps(conv))
    assert type(back) is type(conv) and back.hidden == 5
    assert jaxmem.linen.options_of(back) == jaxmem.linen.options_of(conv)
    # compiled (op by op, each operation is a compile of its own): one program per module
    np.testing.assert_array_equal(jax.jit(back.apply)(params, x), jax.jit(conv.apply)(params, x))
    loss = lambda mod: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(mod.apply(p, x)))))(params)
    for a, b in zip(jax.tree.leaves(loss(back)), jax.tree.leaves(loss(conv))):
        np.testing.assert_array_equal(a, b)


def test_converted_nnx_module_pickles():
    x = _x(16, (2, 4))
    conv = jaxmem.nnx.convert(_PickleNet(nnx.Rngs(0)), fewbit=3)
    back = pickle.loads(pickle.dumps(conv))
    assert type(back) is type(conv) and jaxmem.nnx.is_converted(back)
    fwd = nnx.jit(lambda m: m(x))  # compiled: op by op, each operation is a compile of its own
    np.testing.assert_array_equal(fwd(back), fwd(conv))
    g = lambda mod: nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(mod)
    for a, b in zip(jax.tree.leaves(nnx.state(g(back))), jax.tree.leaves(nnx.state(g(conv)))):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------- 8. convert inside @nn.compact
class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


class _Outer(nn.Module):
    convert: bool

    @nn.compact
    def __call__(self, x):
        wrap = jaxmem.linen.convert if self.convert else (lambda m: m)
        x = wrap(_Block())(x)
        x = wrap(_Block(name="named"))(x)
        return wrap(_Block())(x)


def test_convert_inline_in_compact_method_same_tree_and_values():
    x = _x(17, (2, 3))
    plain = _Outer(convert=False)
    conv = _Outer(convert=True)
    v0 = plain.init(jax.random.key(0), x)
    v1 = conv.init(jax.random.key(0), x)
    assert jax.tree.structure(v1) == jax.tree.structure(v0)
    for a, b in zip(jax.tree.leaves(v1), jax.tree.leaves(v0)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(conv.apply(v0, x), plain.apply(v0, x), rtol=1e-6, atol=1e-6)
    rep = jaxmem.report(conv.apply, v0, x)
    assert sorted({e.status for e in rep.by_kind("dot")}) == ["converted"], str(rep)


def test_convert_of_a_submodule_already_called_is_refused_clearly():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            b = _Block()
            x = b(x)
            return jaxmem.linen.convert(b)(x)

    with pytest.raises(ValueError, match="already"):
        Outer().init(jax.random.key(0), _x(18, (2, 3)))
