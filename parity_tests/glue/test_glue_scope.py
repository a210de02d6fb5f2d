"""The deprecated ``jaxmem.scope``: a Flax method interceptor over the lifted
``jaxmem.transform`` (nothing patched). Linen calls traced inside run as
``jaxmem.linen.convert`` runs them; nested scopes, threads, code it does not convert (raw
functions, NNX) and its warning."""
from __future__ import annotations

import functools
import threading
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem

pytestmark = pytest.mark.filterwarnings("ignore::jaxmem.JaxmemDeprecationWarning")


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


X = _x(0, (4, 16))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
        return nn.Dense(16)(nn.relu(h)) + x


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.silu(_Block()(x))  # read by a norm: few-bit coded under fewbit
        return jnp.sum(jnp.tanh(x))


NET = _Net()


@functools.cache
def _params():
    """The untouched network's variables (made on first use, not when the suite collects)."""
    return jax.jit(NET.init)(jax.random.key(0), X)  # one compiled program, not one per op


def _grad(model):
    # jitted: traced where it is called (inside or outside a scope), one compiled program
    return jax.jit(jax.grad(lambda p: model.apply(p, X)))(_params())


def _jaxpr(model):
    return str(jax.make_jaxpr(jax.grad(lambda p: model.apply(p, X)))(_params()))


# Few-bit tests use 2 bits throughout: the first trace at a new width fits the activations'
# tables (seconds), later ones reuse them.
@functools.cache
def _converted_jaxpr(fewbit):
    """The reference: ``_jaxpr`` of ``jaxmem.linen.convert(NET, fewbit=fewbit)``, traced once
    and shared by the tests."""
    return _jaxpr(jaxmem.linen.convert(NET, fewbit=fewbit))


@functools.cache
def _plain_jaxpr():
    """``_jaxpr(NET)`` outside any scope, traced once."""
    return _jaxpr(NET)


def _same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("fewbit", [None, 2])
def test_linen_calls_inside_run_as_linen_convert(fewbit):
    want = _grad(jaxmem.linen.convert(NET, fewbit=fewbit))
    with jaxmem.scope(fewbit=fewbit):
        got = _grad(NET)
        traced = _jaxpr(NET)
    _same(got, want)
    assert traced == _converted_jaxpr(fewbit)
    assert traced != _jaxpr(NET)  # outside: the untouched model again


def test_exact_scope_gradient_equals_the_untouched_model():
    with jaxmem.scope():
        got = _grad(NET)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got,
                 _grad(NET))


def test_inner_scope_overrides_outer_and_outer_is_restored():
    few2, exact = _converted_jaxpr(2), _converted_jaxpr(None)
    with jaxmem.scope(fewbit=2):
        assert _jaxpr(NET) == few2
        with jaxmem.scope(fewbit=None):
            assert _jaxpr(NET) == exact
        assert _jaxpr(NET) == few2
    assert few2 != exact


def test_nothing_is_patched_and_nothing_is_left():
    names = (jax.nn.relu, jax.nn.gelu, nn.gelu, nn.Dense.__call__, nnx.relu, jax.lax.scan,
             jax.nn.softmax, nn.dot_product_attention)
    with jaxmem.scope(fewbit=2):
        assert (jax.nn.relu, jax.nn.gelu, nn.gelu, nn.Dense.__call__, nnx.relu, jax.lax.scan,
                jax.nn.softmax, nn.dot_product_attention) == names
        _grad(NET)
    for mod in (jax, jax.nn, jax.lax, jnp, nn, nnx):
        assert not [n for n in vars(mod) if "jaxmem" in n.lower()], mod.__name__


def test_thread_without_scope_gets_plain_flax():
    plain, out = _plain_jaxpr(), {}
    go, done = threading.Event(), threading.Event()

    def scoped():
        with jaxmem.scope(fewbit=2):
            go.set()
            out["scoped"] = _jaxpr(NET)
            done.wait(60)

    def other():
        go.wait(60)
        out["other"] = _jaxpr(NET)
        done.set()

    ts = [threading.Thread(target=scoped), threading.Thread(target=other)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out["other"] == plain and out["scoped"] != plain


def test_raw_functions_and_nnx_are_left_as_written():
    f = lambda x: jnp.sum(jax.nn.gelu(x))
    plain = str(jax.make_jaxpr(jax.grad(f))(X))
    lin = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    plain_nnx = str(jax.make_jaxpr(lambda x: lin(x))(X))
    with jaxmem.scope(fewbit=2):
        assert str(jax.make_jaxpr(jax.grad(f))(X)) == plain
        assert str(jax.make_jaxpr(lambda x: lin(x))(X)) == plain_nnx


def test_deprecation_names_what_the_scope_converts():
    with pytest.warns(jaxmem.JaxmemDeprecationWarning, match="converts Linen calls only"):
        jaxmem.scope()


def test_converted_module_inside_a_scope_keeps_its_own_options():
    conv = jaxmem.linen.convert(NET, fewbit=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.NothingConvertedWarning)
        with jaxmem.scope(selective=False, fewbit=None, attention=False):
            # its inner calls are not converted again (that would convert nothing: a warning)
            assert _jaxpr(conv) == _converted_jaxpr(2)


def test_init_inside_a_scope_gives_the_same_variables():
    with jaxmem.scope(fewbit=2):
        v = jax.jit(NET.init)(jax.random.key(0), X)  # traced inside the scope
    _same(v, _params())


def test_report_of_a_scoped_call_lists_the_transformation_rows():
    with jaxmem.scope():
        rep = jaxmem.report(lambda p: NET.apply(p, X), _params())
    kinds = [e.kind for e in rep.converted()]
    assert kinds.count("dot") == 4 and kinds.count("norm") == 2
    assert {e.path for e in rep.by_kind("norm")} == {"_Block_0/LayerNorm_0",
                                                      "_Block_1/LayerNorm_0"}


def test_bad_options():
    with pytest.raises(ValueError, match="fewbit"), jaxmem.scope(fewbit=0):
        pass
    with pytest.raises(TypeError, match="selective"), jaxmem.scope(selective="yes"):
        pass
    with pytest.raises(TypeError, match="callable"):
        jaxmem.report(3)
