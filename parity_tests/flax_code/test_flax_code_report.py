"""``jaxmem.report`` of converted Flax code lists the computations of the traced step.

* A converted model runs through ``jaxmem.transform``: one entry per product, norm,
  activation, ... of the jaxpr, with the Flax module path; the computations inside an
  ``nn.scan`` body appear once (``[scan]`` in the target), not once more for the pre-trace
  Flax makes of the body to check loop invariants. ``jax.eval_shape`` of a converted
  function inside the step, and a Linen ``init`` (which runs the untouched code), are not
  entries of the step (what they trace goes to ``Report.pretrace``).
* Names bound before any conversion (``from jax.lax import scan``, ``from flax.linen import
  relu``) are converted like the module attributes: the transformation sees what they
  compute. ``jax.lax.fori_loop`` lowers to a ``scan`` (static bounds), which is entered.
  Code traced *outside* every converted model and scope is still watched: the report lists
  such a ``fori_loop`` as 'unsupported'.
"""
from __future__ import annotations

import collections
import importlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _data import normal
from flax.linen import relu  # bound to the original before any conversion
from jax.lax import fori_loop, scan  # likewise

import jaxmem

B, D = 2, 8


def _x(seed=0):
    return normal(seed, (B, D))


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
    v = jax.jit(model.init)(jax.random.key(1), x)  # one compile (op by op: one per op)
    conv = jaxmem.linen.convert(model)
    return jaxmem.report(lambda p: jax.grad(lambda p: jnp.sum(conv.apply(p, x) ** 2))(p), v)


def _arrays_autodiff_keeps_for_scanned_tanh():
    """How many arrays JAX's own autodiff keeps for ``tanh`` inside a ``scan`` body."""
    def f(c):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c), None), c, None, length=1)[0]

    _, pullback = jax.vjp(f, jnp.full((2, D), 0.5))  # a jax.tree_util.Partial: residual leaves
    return sum(1 for leaf in jax.tree.leaves(pullback) if jnp.size(leaf) == 2 * D)


def _rows(rep):
    return collections.Counter((e.path, e.target, e.status) for e in rep.entries)


@pytest.mark.parametrize("remat", [False, True])
def test_nn_scan_body_listed_once_not_its_pretrace(remat):
    rep = _report_of_grad(Scanned(remat=remat), _x())
    rows = _rows(rep)
    inner = "[scan/remat2] " if remat else "[scan] "
    assert rows[("Dense_0", inner + "dot_general f32[2,8] x f32[8,8] -> f32[2,8]",
                 "converted")] == 1, str(rep)
    acts = [e for e in rep.by_kind("activation") if e.target.startswith(inner)]
    assert [e.status for e in acts] == ["converted"] and "1-bit mask" in acts[0].reason
    assert len(rep.by_kind("dot")) == 2 and len(rep.by_kind("activation")) == 1, str(rep)
    assert [e.target for e in rep.by_kind("higher-order")] == (
        ["scan", "[scan] remat2"] if remat else ["scan"])
    assert rep.pretrace == []  # Flax's pre-trace of the body makes no rows
    d = rep.to_dict()
    assert sum(d["counts"].values()) == len(rep.entries)


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
    rows = collections.Counter((e.path, e.kind, e.status) for e in rep.entries)
    assert rows == collections.Counter({("Dense_0", "dot", "converted"): 1,
                                        ("Dense_0", "bias", "converted"): 1,
                                        ("", "activation", "converted"): 1,
                                        ("Dense_1", "dot", "converted"): 1,
                                        ("Dense_1", "bias", "converted"): 1}), str(rep)
    whys = {why for _, why in rep.pretrace}
    # an init runs the untouched code (nothing to record); shape inference is discarded
    assert whys == {"jax.eval_shape (shape inference)"}, whys
    assert "pre-traces" in str(rep)


def test_sequential_layers_and_list_activations_converted():
    x = _x()
    model = nn.Sequential([nn.Dense(D), nn.relu, nn.Dense(1)])
    rep = _report_of_grad(model, x)
    assert [(e.path, e.status) for e in rep.by_kind("dot")] == [
        ("layers_0", "converted"), ("layers_2", "converted")], str(rep)
    assert [e.status for e in rep.by_kind("activation")] == ["converted"]
    # a Flax layer with its own elementwise code (PReLU): a two-slope function, also a mask
    prelu = nn.Sequential([nn.Dense(D), nn.PReLU()])
    rep2 = _report_of_grad(prelu, x)
    assert not [e for e in rep2.entries if e.status in ("unsupported", "fallback")], str(rep2)


def test_nothing_converted_warns_once_per_converted_class():
    x = _x()

    class Smooth(nn.Module):  # one exp: keeping its input saves nothing, nothing to convert
        @nn.compact
        def __call__(self, x):
            return jnp.exp(x) * self.param("s", nn.initializers.ones, (D,))

    v = Smooth().init(jax.random.key(1), x)
    conv = jaxmem.linen.convert(Smooth())
    importlib.import_module("jaxmem.transform.report")._warned.clear()
    with pytest.warns(jaxmem.NothingConvertedWarning, match="nothing was converted"):
        jax.grad(lambda p: jnp.sum(conv.apply(p, x)))(v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(lambda p: jnp.sum(conv.apply(p, 2 * x)))(v)  # once per class


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


@pytest.mark.parametrize("cls", [ByName, ByModule])
def test_functions_imported_by_name_are_converted_like_module_attributes(cls):
    rep = _report_of_grad(cls(), _x())
    assert not [e for e in rep.entries if e.kind in ("function", "module")], str(rep)
    assert [e.status for e in rep.by_kind("dot")] == ["converted"] * 2
    acts = {e.target.split(": ")[-1]: e.status for e in rep.by_kind("activation")}
    assert acts["custom_jvp_call"] == "converted"  # relu, however imported: a 1-bit mask
    # tanh in the scan body: converted where JAX's autodiff keeps two arrays for it (jax 0.10:
    # input and output), nothing to save where it keeps one (jax 0.11 keeps the output only)
    kept = _arrays_autodiff_keeps_for_scanned_tanh()
    assert acts["tanh"] == ("converted" if kept > 1 else "nothing-to-save"), (kept, str(rep))
    # jax.lax.scan and the fori_loop (a scan with static bounds) are entered
    assert [e.target for e in rep.by_kind("higher-order")] == ["scan", "scan"], str(rep)


@pytest.mark.parametrize("cls", [ByName, ByModule])
def test_loops_and_imported_names_keep_exact_gradients(cls):
    x = _x(3)
    model = cls()
    v = jax.jit(model.init)(jax.random.key(4), x)
    conv = jaxmem.linen.convert(model)

    def loss(m):
        return lambda p: jnp.sum(jnp.sin(m.apply(p, x)))

    # compiled, both in one program (op by op, a loop's gradient is dozens of small compiles)
    ref, got = jax.jit(lambda v: [jax.grad(loss(m))(v) for m in (model, conv)])(v)
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(ref))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * scale)


def test_fori_loop_reported_as_the_scan_it_lowers_to():
    x = jnp.arange(1.0, 5.0)
    loop = lambda x: jax.lax.fori_loop(0, 2, lambda i, c: jnp.sin(c), x)
    rep = jaxmem.report(jaxmem.transform(loop), x)
    assert [(e.kind, e.target, e.status) for e in rep.entries] == [
        ("higher-order", "scan", "converted"),
        ("activation", "[scan] elementwise f32[4]: sin", "nothing-to-save")], str(rep)
    assert "scan_policy" in rep.entries[0].reason
    # untouched: what the transformation would do, nothing done
    assert [e.status for e in jaxmem.report(loop, x).entries] == ["fallback",
                                                                  "nothing-to-save"]
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(jaxmem.transform(loop)(x)))(x),
                               jax.grad(lambda x: jnp.sum(loop(x)))(x), rtol=1e-6)
