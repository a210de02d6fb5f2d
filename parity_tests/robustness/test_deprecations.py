"""Deprecated spellings: each warns ``JaxmemDeprecationWarning`` (naming the new spelling and
the removal version) and gives the same object or result as the one spelling per task."""
from __future__ import annotations

import importlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem import JaxmemDeprecationWarning, _deprecation

#: (module, old name, module of the new spelling, its name): the very same object
SAME_OBJECT = [
    ("jaxmem.fewbit", "relu", "jaxmem.selective", "relu"),
    ("jaxmem.fewbit", "relu6", "jaxmem.selective", "relu6"),
    ("jaxmem.fewbit", "hard_tanh", "jaxmem.selective", "hard_tanh"),
    ("jaxmem.fewbit", "attention", "jaxmem.selective", "attention"),
    ("jaxmem.fewbit", "softmax", "jaxmem.selective", "softmax"),
    ("jaxmem.fewbit", "attention_core", "jaxmem.selective", "attention_core"),
    ("jaxmem.fewbit", "activation_fn", "jaxmem.fewbit", "activation"),
    ("jaxmem.fewbit.linen", "activation_fn", "jaxmem.fewbit", "activation"),
    ("jaxmem.schedule", "Plan", "jaxmem.schedule", "Schedule"),
    ("jaxmem.rowconv", "TilePlan", "jaxmem.rowconv", "Tiling"),
]

#: every deprecated name and the spelling its warning names
NEW_SPELLING = [(m, old, f"{nm}.{new}") for m, old, nm, new in SAME_OBJECT] + [
    ("jaxmem.fewbit", "patch_activations", "jaxmem.linen.convert(model, selective=False"),
    ("jaxmem.fewbit", "patch_softmax", "jaxmem.linen.convert(model, selective=False"),
    ("jaxmem.fewbit", "patch_attention", "jaxmem.linen.convert(model, selective=False"),
    ("jaxmem.fewbit.linen", "patch_activations", "jaxmem.linen.convert(model, selective"),
    ("jaxmem.selective.linen", "convert", "jaxmem.linen.convert("),
    ("jaxmem.selective.linen", "scope", "jaxmem.linen.convert("),
    ("jaxmem.selective.linen", "wrap", "jaxmem.transform(fn, attention=False)"),
    ("jaxmem.selective.nnx", "convert", "jaxmem.nnx.convert("),
    ("jaxmem.selective.nnx", "scope", "jaxmem.nnx.convert("),
    ("jaxmem.selective.patch", "patch_functions", "jaxmem.transform(f, attention=False)"),
]


@pytest.fixture(autouse=True)
def _fresh_call_sites():
    """Each test sees every deprecated name warn again (warnings are once per call site)."""
    _deprecation._seen.clear()


def _old(module, name):
    with pytest.warns(JaxmemDeprecationWarning) as rec:
        value = getattr(importlib.import_module(module), name)
    return value, str(rec[0].message)


@pytest.mark.parametrize("module,old,new_module,new", SAME_OBJECT,
                         ids=[f"{m}.{o}" for m, o, _, _ in SAME_OBJECT])
def test_alias_is_the_new_object(module, old, new_module, new):
    value, _ = _old(module, old)
    assert value is getattr(importlib.import_module(new_module), new)


@pytest.mark.parametrize("module,old,new", NEW_SPELLING,
                         ids=[f"{m}.{o}" for m, o, _ in NEW_SPELLING])
def test_warning_names_old_new_and_removal(module, old, new):
    _, msg = _old(module, old)
    assert f"{module}.{old} is deprecated" in msg
    assert f"removed in jaxmem {_deprecation.REMOVAL}" in msg and f"use {new}" in msg


def test_from_import_warns_once_at_the_import_line():
    with pytest.warns(JaxmemDeprecationWarning) as rec:
        from jaxmem.fewbit import relu  # noqa: F401
    assert len(rec) == 1 and rec[0].filename == __file__


def test_once_per_call_site():
    fewbit = jaxmem.fewbit
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            fewbit.relu6  # noqa: B018
    assert [w.category for w in rec] == [JaxmemDeprecationWarning]


def test_unknown_names_still_raise_attribute_error():
    for module in ("jaxmem.fewbit", "jaxmem.selective.linen", "jaxmem.schedule",
                   "jaxmem.rowconv"):
        with pytest.raises(AttributeError, match="no_such_name"):
            getattr(importlib.import_module(module), "no_such_name")
    assert jaxmem.schedule.trace is importlib.import_module("jaxmem.schedule.jaxpr_graph").trace
    assert issubclass(JaxmemDeprecationWarning, DeprecationWarning)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


def _x():
    return jnp.linspace(-1.0, 1.0, 10).reshape(2, 5)


def _grad(model, variables):
    return jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(model.apply(v, _x())))))(variables)


def test_selective_linen_convert_scope_wrap_equal_the_one_way_in():
    ref = _MLP()
    variables = ref.init(jax.random.key(0), _x())
    sl = importlib.import_module("jaxmem.selective.linen")
    want = _grad(jaxmem.linen.convert(ref, attention=False), variables)
    with pytest.warns(JaxmemDeprecationWarning):
        old = sl.convert(ref)
    assert type(old).__name__ == "_MLP"
    jax.tree.map(np.testing.assert_array_equal, _grad(old, variables), want)
    with pytest.warns(JaxmemDeprecationWarning), sl.scope():
        got = _grad(ref, variables)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    with pytest.warns(JaxmemDeprecationWarning):
        wrapped = sl.wrap(_grad)
    jax.tree.map(np.testing.assert_array_equal, wrapped(ref, variables), want)


def test_selective_nnx_convert_equals_the_one_way_in():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.lin(x))

    sn = importlib.import_module("jaxmem.selective.nnx")
    new = jaxmem.nnx.convert(Net(nnx.Rngs(0)), fewbit=None, attention=False)
    net = Net(nnx.Rngs(0))
    with pytest.warns(JaxmemDeprecationWarning):
        old = sn.convert(net)
    assert old is net and jaxmem.nnx.is_converted(old)  # in place, as before
    assert type(old.lin) is nnx.Linear  # its layers are left as they are
    loss = lambda m: jnp.sum(jnp.sin(m(_x())))  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, nnx.grad(loss)(old), nnx.grad(loss)(new))


def test_fewbit_patch_context_managers_equal_the_linen_conversion():
    fewbit = jaxmem.fewbit

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.sum(jax.nn.softmax(nn.Dense(8)(x)) ** 2 + jnp.sin(nn.gelu(x)))

    model = Net()
    x = jnp.linspace(-3.0, 3.0, 16).reshape(2, 8)
    v = model.init(jax.random.key(0), x)
    grad = lambda m: jax.jit(jax.grad(lambda v: m.apply(v, x)))(v)  # noqa: E731
    jaxpr = lambda m: str(jax.make_jaxpr(lambda v: jax.grad(  # noqa: E731
        lambda v: m.apply(v, x))(v))(v))
    want2 = grad(jaxmem.linen.convert(model, selective=False, fewbit=2, attention=False))
    with pytest.warns(JaxmemDeprecationWarning), fewbit.patch_activations(bits=2):
        jax.tree.map(np.testing.assert_array_equal, grad(model), want2)
    exact = grad(model)  # restored: exact again
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, exact, want2)))
    soft = jaxpr(jaxmem.linen.convert(model, selective=False, attention=True))
    for cm in ("patch_softmax", "patch_attention"):
        with pytest.warns(JaxmemDeprecationWarning), getattr(fewbit, cm)():
            assert jaxpr(model) == soft
    with pytest.warns(JaxmemDeprecationWarning), pytest.raises(TypeError, match="activations="):
        with fewbit.patch_activations(bits=2, activations=["gelu"]):
            pass
