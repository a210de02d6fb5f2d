"""jaxmem.scope: re-entrant, thread-safe, the order rule, inline functions, the report and
the nothing-converted warning."""
from __future__ import annotations

import threading
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem import fewbit
from jaxmem import selective as S
from jaxmem._glue import report as _report
from jaxmem.measure import residual_bytes


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _jaxpr(fn, *a):
    return str(jax.make_jaxpr(fn)(*a))


def _dgrad(fn, x):
    return np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x))))(x))


X = _x(0, (4, 16))


def test_reentrant_inner_overrides_outer_and_restored():
    before = (jax.nn.relu, nn.gelu, nnx.max_pool, jax.nn.softmax)
    plain = _jaxpr(jax.nn.gelu, X)
    with jaxmem.scope(fewbit=3):
        np.testing.assert_array_equal(_dgrad(nn.gelu, X),
                                      _dgrad(lambda x: fewbit.gelu(x, bits=3,
                                                                   approximate=True), X))
        with jaxmem.scope(fewbit=None):  # inner overrides outer: exact gelu
            assert _jaxpr(nn.gelu, X) == plain
            with jaxmem.scope(fewbit=1):
                np.testing.assert_array_equal(
                    _dgrad(jax.nn.gelu, X),
                    _dgrad(lambda x: fewbit.gelu(x, bits=1, approximate=True), X))
            assert _jaxpr(nn.gelu, X) == plain
        np.testing.assert_array_equal(_dgrad(nn.gelu, X),
                                      _dgrad(lambda x: fewbit.gelu(x, bits=3,
                                                                   approximate=True), X))
    assert (jax.nn.relu, nn.gelu, nnx.max_pool, jax.nn.softmax) == before
    assert _jaxpr(nn.gelu, X) == plain


def test_order_rule_relu_exact_mask_smooth_fewbit():
    """ReLU family: selective's exact 1-bit mask even with fewbit set; gelu: fewbit codes
    only when fewbit is set."""
    with jaxmem.scope(fewbit=2):
        relu_jaxpr = _jaxpr(jax.nn.relu, X)
        rep = jaxmem.report(lambda x: jnp.sum(nnx.relu(x) + nnx.gelu(x)), X)
    assert relu_jaxpr == _jaxpr(S.relu, X)
    tech = {e.target: (e.technique, e.status) for e in rep.entries}
    assert tech["flax.nnx.relu"] == ("selective", "converted")
    assert tech["flax.nnx.gelu"] == ("fewbit", "converted")
    with jaxmem.scope(selective=False, fewbit=2):  # no selective: fewbit's exact mask
        np.testing.assert_array_equal(_dgrad(jax.nn.relu, X),
                                      _dgrad(lambda x: jnp.maximum(x, 0), X))
        rep = jaxmem.report(lambda x: jnp.sum(jax.nn.relu(x)), X)
    assert [(e.technique, e.status) for e in rep.entries] == [("fewbit", "converted")]
    with jaxmem.scope():
        rep = jaxmem.report(lambda x: jnp.sum(jax.nn.gelu(x)), X)
    assert [e.status for e in rep.entries] == ["approximate-not-allowed"]
    assert rep.unconverted() == rep.entries


def test_thread_without_scope_gets_plain_jax():
    plain = _jaxpr(jax.nn.relu, X)
    inside, started, done = {}, threading.Event(), threading.Event()
    outside = {}

    def scoped():
        with jaxmem.scope():
            started.set()
            inside["jaxpr"] = _jaxpr(lambda x: jax.nn.relu(x), X)
            done.wait(60)

    def plain_thread():
        started.wait(60)
        outside["jaxpr"] = _jaxpr(lambda x: jax.nn.relu(x), X)
        done.set()

    ts = [threading.Thread(target=scoped), threading.Thread(target=plain_thread)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert outside["jaxpr"] == plain
    assert inside["jaxpr"] == _jaxpr(S.relu, X) != plain


def test_pools_max_converted_avg_nothing_to_save():
    x = _x(1, (2, 8, 8, 3))
    f_max = lambda x: jnp.sum(jnp.sin(nnx.max_pool(jnp.sin(x), (2, 2), (2, 2))))  # noqa: E731
    f_avg = lambda x: jnp.sum(jnp.sin(nn.avg_pool(x, (2, 2), (2, 2))))  # noqa: E731
    f_avg_nnx = lambda x: jnp.sum(jnp.sin(nnx.avg_pool(x, (2, 2), (2, 2))))  # noqa: E731
    r0 = residual_bytes(f_max, x)
    g0 = jax.grad(f_max)(x)
    with jaxmem.scope():
        r1 = residual_bytes(f_max, x)
        g1 = jax.grad(f_max)(x)
        rep = jaxmem.report(lambda x: f_avg(x) + f_avg_nnx(x) + f_max(x), x)
        ra = residual_bytes(lambda x: jnp.sum(nn.avg_pool(x * 2.0, (2, 2), (2, 2)) * 3.0), x)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-6)
    assert r1.activation_bytes < r0.activation_bytes
    assert [(e.target, e.status) for e in rep.entries] == [
        ("flax.linen.avg_pool", "nothing-to-save"), ("flax.nnx.avg_pool", "nothing-to-save"),
        ("flax.nnx.max_pool", "converted")]
    assert ra.activation_bytes == 0  # avg_pool's backward keeps no residual


def test_report_lists_modules_functions_and_data():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.Dense(8)(x))
            x = nn.BatchNorm(use_running_average=True)(x, mask=x > 0)
            x = nn.PReLU()(x)
            return jnp.sum(nn.softmax(nn.relu(x)))

    m = M()
    v = m.init(jax.random.PRNGKey(0), X)
    rep = jaxmem.report(lambda p: jax.grad(lambda p: jaxmem.linen.convert(m).apply(p, X))(p),
                        v)
    rows = [(e.path, e.kind, e.status) for e in rep.entries]
    assert ("Dense_0", "dot", "converted") in rows
    assert ("LayerNorm_0", "norm", "converted") in rows
    assert ("", "activation", "converted") in rows  # relu: the 1-bit mask
    # eval-mode BatchNorm (mask=) and PReLU compute no normalisation / activation to convert
    assert not [e for e in rep.entries if e.path.startswith(("BatchNorm_0", "PReLU_0"))
                and e.status == "converted"]
    d = rep.to_dict()
    assert d["counts"]["converted"] == len(rep.converted()) >= 3
    assert len(d["entries"]) == len(rep.entries)
    text = str(rep)
    assert "LayerNorm_0" in text and "1-bit mask" in text
    # outside any scope: listed as fallback
    rep = jaxmem.report(lambda p: m.apply(p, X), v)
    assert {e.status for e in rep.entries} == {"fallback", "unsupported"}


def test_nothing_converted_warns_once():
    _report._warned.clear()
    x = jnp.arange(6.0)
    with pytest.warns(jaxmem.NothingConvertedWarning, match="converted none"):
        with jaxmem.scope():
            jax.make_jaxpr(lambda x: jnp.sum(jax.nn.gelu(x)))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", jaxmem.JaxmemDeprecationWarning)  # scope's own
        with jaxmem.scope():  # once only
            jax.make_jaxpr(lambda x: jnp.sum(jax.nn.gelu(x)))(x)
        with jaxmem.scope():  # something converted: no warning
            jax.make_jaxpr(lambda x: jnp.sum(jax.nn.relu(x)))(x)
    assert issubclass(jaxmem.NothingConvertedWarning, UserWarning)


def test_bad_options():
    with pytest.raises(ValueError, match="fewbit"):
        with jaxmem.scope(fewbit=0):
            pass
    with pytest.raises(TypeError, match="selective"):
        with jaxmem.scope(selective="yes"):
            pass
    with pytest.raises(TypeError, match="callable"):
        jaxmem.report(3)
