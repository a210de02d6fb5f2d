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
    ("jaxmem.fewbit", "patch_activations", "jaxmem.scope("),
    ("jaxmem.fewbit", "patch_softmax", "jaxmem.scope("),
    ("jaxmem.fewbit", "patch_attention", "jaxmem.scope("),
    ("jaxmem.fewbit.linen", "patch_activations", "jaxmem.scope("),
    ("jaxmem.selective.linen", "convert", "jaxmem.linen.convert("),
    ("jaxmem.selective.linen", "scope", "jaxmem.scope("),
    ("jaxmem.selective.linen", "wrap", "a call inside jaxmem.scope("),
    ("jaxmem.selective.nnx", "convert", "jaxmem.nnx.convert("),
    ("jaxmem.selective.nnx", "scope", "jaxmem.scope("),
    ("jaxmem.selective.patch", "patch_functions", "jaxmem.scope("),
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
    return jax.grad(lambda v: jnp.sum(jnp.sin(model.apply(v, _x()))))(variables)


def test_selective_linen_convert_scope_wrap_equal_the_one_way_in():
    ref = _MLP()
    variables = ref.init(jax.random.key(0), _x())
    sl = importlib.import_module("jaxmem.selective.linen")
    want = _grad(jaxmem.linen.convert(ref, attention=False), variables)
    with pytest.warns(JaxmemDeprecationWarning):
        old = sl.convert(ref)
    assert type(old).__name__ == "_MLP"
    jax.tree.map(np.testing.assert_array_equal, _grad(old, variables), want)
    with jaxmem.scope(attention=False):
        want_scoped = _grad(ref, variables)
    with pytest.warns(JaxmemDeprecationWarning), sl.scope():
        got = _grad(ref, variables)
    jax.tree.map(np.testing.assert_array_equal, got, want_scoped)
    with pytest.warns(JaxmemDeprecationWarning):
        wrapped = sl.wrap(_grad)
    jax.tree.map(np.testing.assert_array_equal, wrapped(ref, variables), want_scoped)


def test_selective_nnx_convert_equals_the_one_way_in():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.lin(x))

    sn = importlib.import_module("jaxmem.selective.nnx")
    new = jaxmem.nnx.convert(Net(nnx.Rngs(0)), attention=False)
    with pytest.warns(JaxmemDeprecationWarning):
        old = sn.convert(Net(nnx.Rngs(0)))
    # the deprecated layer pass re-classes the layers; jaxmem.nnx.convert leaves them as
    # they are and converts what the root's call computes
    assert type(old.lin) is not nnx.Linear and type(new.lin) is nnx.Linear
    loss = lambda m: jnp.sum(jnp.sin(m(_x())))  # noqa: E731
    with pytest.warns(JaxmemDeprecationWarning), sn.scope():
        g_old = nnx.grad(loss)(old)
    jax.tree.map(np.testing.assert_array_equal, g_old, nnx.grad(loss)(new))


def test_fewbit_patch_context_managers_equal_scope():
    fewbit = jaxmem.fewbit
    x = jnp.linspace(-3.0, 3.0, 16)
    dgelu = lambda: jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))(x)  # noqa: E731
    dsoft = lambda: jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) ** 2))(x)  # noqa: E731
    with jaxmem.scope(selective=False, fewbit=2, attention=False):
        want_gelu = dgelu()
    with pytest.warns(JaxmemDeprecationWarning), fewbit.patch_activations(bits=2):
        np.testing.assert_array_equal(dgelu(), want_gelu)
    assert not np.array_equal(dgelu(), want_gelu)  # restored: exact again
    plain = str(jax.make_jaxpr(dsoft)())
    with jaxmem.scope(selective=False, attention=True):
        want_soft = str(jax.make_jaxpr(dsoft)())
    assert want_soft != plain
    with pytest.warns(JaxmemDeprecationWarning), fewbit.patch_softmax():
        assert str(jax.make_jaxpr(dsoft)()) == want_soft
    with pytest.warns(JaxmemDeprecationWarning), fewbit.patch_attention():
        assert str(jax.make_jaxpr(dsoft)()) == plain  # the model zoo's attention only
