"""``jaxmem.report`` lists the calls of the traced step, as Flax code is written.

* Calls Flax or JAX make in a trace they throw away are not entries of the step: ``nn.scan``
  traces its body once more to check loop invariants, ``jax.eval_shape`` infers shapes, a
  Linen ``init`` runs the model; they go to ``Report.pretrace`` and are not counted.
* A Flax module jaxmem has no conversion for but whose inner calls are recorded
  (``nn.Sequential`` and the activations held in its list) is a ``'container'``, never
  ``'unsupported'``; one with no recorded inner call stays ``'unsupported'``.
* Names bound before any conversion (``from jax.lax import scan``, ``from flax.linen import
  relu``) keep the original function, which jaxmem never sees: the report lists each as
  'fallback' with "not reached: imported by name before conversion". ``jax.lax.fori_loop``
  (lowered inside JAX, never converted) is listed 'unsupported' at each call, however
  imported. The layers inside those loops are converted and the gradients are exact.
"""
from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import relu  # bound to the original before any conversion
from jax.lax import fori_loop, scan  # likewise

import jaxmem

B, D = 2, 8
NOT_REACHED = "not reached: imported by name before conversion"


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, D))


class Layer(nn.Module):
    """``(carry, _) -> (carry, None)``: Dense -> relu, for ``nn.scan``."""

    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(D)(x)), None


class Scanned(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(Layer) if self.remat else Layer
        x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)(name="stack")(x, None)
        return nn.Dense(1)(x)


def _report_of_grad(model, x):
    v = model.init(jax.random.key(1), x)
    conv = jaxmem.linen.convert(model)
    return jaxmem.report(lambda p: jax.grad(lambda p: jnp.sum(conv.apply(p, x) ** 2))(p), v)


def _rows(rep):
    return collections.Counter((e.path, e.target, e.status) for e in rep.entries)


@pytest.mark.parametrize("remat", [False, True])
def test_nn_scan_body_listed_once_not_its_pretrace(remat):
    rep = _report_of_grad(Scanned(remat=remat), _x())
    rows = _rows(rep)
    assert rows[("stack/Dense_0", "Dense", "converted")] == 1, str(rep)
    assert rows[("stack", "flax.linen.relu", "converted")] == 1, str(rep)
    assert sum(1 for e in rep.entries if e.target == "jax.lax.scan") == 1
    # Flax's pre-trace of the body is kept apart, named, and not counted
    assert rep.pretrace, "nn.scan's pre-trace should have been seen"
    assert all("nn.scan" in why for _, why in rep.pretrace)
    d = rep.to_dict()
    assert sum(d["counts"].values()) == len(rep.entries)
    assert len(d["pretrace"]) == len(rep.pretrace)
    assert "pre-traces" in str(rep)


def test_eval_shape_and_init_calls_are_not_part_of_the_step():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(D)(x)))

    x = _x()
    conv = jaxmem.linen.convert(MLP())
    v = conv.init(jax.random.key(1), x)

    def step(p):
        jax.eval_shape(conv.apply, p, x)  # shape inference: discarded
        conv.init(jax.random.key(2), x)  # an init inside the traced function: not the step
        return conv.apply(p, x)

    rep = jaxmem.report(step, v)
    rows = _rows(rep)
    assert rows == collections.Counter({("Dense_0", "Dense", "converted"): 1,
                                        ("", "flax.linen.relu", "converted"): 1,
                                        ("Dense_1", "Dense", "converted"): 1}), str(rep)
    whys = {why for _, why in rep.pretrace}
    assert any("eval_shape" in w for w in whys) and "Linen init" in whys, whys


def test_sequential_is_a_container_not_unsupported():
    x = _x()
    model = nn.Sequential([nn.Dense(D), nn.relu, nn.Dense(1)])
    rep = _report_of_grad(model, x)
    seq = [e for e in rep.entries if e.target == "Sequential"]
    assert [e.status for e in seq] == ["container"], str(rep)
    assert "2 converted" in seq[0].reason
    assert not [e for e in rep.entries if e.status == "unsupported"], str(rep)
    # the container's entry comes before its children, in trace order
    targets = [e.target for e in rep.entries if e.kind == "module"]
    assert targets == ["Sequential", "Dense", "Dense"], targets
    # a Flax layer with no conversion and nothing recorded inside stays 'unsupported'
    prelu = nn.Sequential([nn.Dense(D), nn.PReLU()])
    rep2 = _report_of_grad(prelu, x)
    assert {(e.target, e.status) for e in rep2.entries if e.kind == "module"} == {
        ("Sequential", "container"), ("Dense", "converted"), ("PReLU", "unsupported")}


def test_container_alone_does_not_silence_the_nothing_converted_warning():
    x = _x()
    model = nn.Sequential([nn.PReLU()])
    v = model.init(jax.random.key(1), x)
    conv = jaxmem.linen.convert(model)
    from jaxmem._glue import report as _report
    _report._warned.clear()
    with pytest.warns(jaxmem.NothingConvertedWarning):
        jax.grad(lambda p: jnp.sum(conv.apply(p, x)))(v)


class ByName(nn.Module):
    """Uses functions imported by name at the top of this file."""

    @nn.compact
    def __call__(self, x):
        x = relu(nn.Dense(D)(x))

        def body(c, _):
            return jnp.tanh(c), None

        x, _ = scan(body, x, None, length=2)
        x = fori_loop(0, 2, lambda i, c: jnp.sin(c), x)
        return nn.Dense(1)(x)


class ByModule(nn.Module):
    """The same through the modules' attributes."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(D)(x))

        def body(c, _):
            return jnp.tanh(c), None

        x, _ = jax.lax.scan(body, x, None, length=2)
        x = jax.lax.fori_loop(0, 2, lambda i, c: jnp.sin(c), x)
        return nn.Dense(1)(x)


def test_functions_imported_by_name_are_reported_not_reached():
    rep = _report_of_grad(ByName(), _x())
    not_reached = {e.target: e for e in rep.entries if NOT_REACHED in e.reason}
    assert set(not_reached) == {"jax.lax.scan", "jax.nn.relu"}, str(rep)
    assert all(e.status == "fallback" for e in not_reached.values())
    assert "`scan` in " in not_reached["jax.lax.scan"].reason
    assert set(not_reached.values()) <= set(rep.unconverted())
    fori = [e for e in rep.entries if e.target == "jax.lax.fori_loop"]
    assert [e.status for e in fori] == ["unsupported"], str(rep)
    # the layers are converted all the same
    assert [e.status for e in rep.entries if e.target == "Dense"] == ["converted"] * 2


def test_functions_called_through_their_module_are_converted():
    rep = _report_of_grad(ByModule(), _x())
    assert not [e for e in rep.entries if NOT_REACHED in e.reason], str(rep)
    status = {e.target: e.status for e in rep.entries}
    assert status["flax.linen.relu"] == "converted"
    assert status["jax.lax.scan"] == "converted"
    assert status["jax.lax.fori_loop"] == "unsupported"  # reported, however imported


@pytest.mark.parametrize("cls", [ByName, ByModule])
def test_loops_and_imported_names_keep_exact_gradients(cls):
    x = _x(3)
    model = cls()
    v = model.init(jax.random.key(4), x)
    conv = jaxmem.linen.convert(model)

    def loss(m):
        return lambda p: jnp.sum(jnp.sin(m.apply(p, x)))

    ref = jax.grad(loss(model))(v)
    got = jax.grad(loss(conv))(v)
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(ref))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * scale)


def test_fori_loop_listed_for_user_code_not_inside_jax():
    x = jnp.arange(1.0, 5.0)
    rep = jaxmem.report(lambda x: jax.lax.fori_loop(0, 2, lambda i, c: c * 2.0, x), x)
    assert [(e.target, e.status) for e in rep.entries] == [("jax.lax.fori_loop", "unsupported")]
    mul = jnp.frompyfunc(lambda a, b: a * b, 2, 1)  # JAX runs a fori_loop inside
    assert jaxmem.report(lambda x: mul.accumulate(x), x).entries == []
