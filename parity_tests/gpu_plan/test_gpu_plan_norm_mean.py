"""A batch norm's backward and the mean ``mu`` it reads: tied to the cotangent on XLA:CPU
only (``ties.tie_on_cpu``).

The backward's ``xhat = (x - mu) * rstd`` broadcasts ``mu`` to the input's shape, as the
forward's ``x - mu`` does. Untied, XLA:CPU merges the two broadcasts and keeps the forward's
input-sized one until the backward pass; XLA:GPU fuses each into its reader, and a barrier
there would only cost its plan bytes. Checked on a conv -> BN -> ReLU stack whose batch-norm
parameters alone are trained (``jaxmem.selective.subset.grad``), the mean tied and, by
monkeypatch, untied: on CPU one input-sized array less, on the H100 plan the same plan."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gp_util import TARGET, rand, ties_patched

import jaxmem
from jaxmem._prims import ties
from jaxmem.measure import compiled_memory
from jaxmem.selective.subset import grad as subset_grad

SHAPE = (8, 32, 32, 3)
FEATURES = 16


class _ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(2):
            x = nn.Conv(FEATURES, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return x.mean((1, 2))


def _step(model, variables):
    stats = variables["batch_stats"]

    def loss(p, x):
        y, _ = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                           mutable=["batch_stats"])
        return jnp.mean(y ** 2)

    norms_only = jax.tree_util.tree_map_with_path(
        lambda path, a: "BatchNorm" in jax.tree_util.keystr(path), variables["params"])
    return lambda p, x: subset_grad(loss, trainable=norms_only)(p, x)


@pytest.fixture(scope="module")
def measured():
    x = rand(0, SHAPE)
    model = _ConvBN()
    variables = model.init(jax.random.key(1), x, train=False)
    step = _step(jaxmem.linen.convert(model, attention=False), variables)
    out = {"bytes": {}, "grads": {}, "x": x, "variables": variables, "model": model}
    for tied in (True, False):
        with ties_patched(**({} if tied else {"_tie_on_cpu": lambda x, dep: x})):
            for target in ("cpu", TARGET):
                c = compiled_memory(step, variables["params"], x, target=target)
                out["bytes"][tied, target] = c.temp_bytes + c.output_bytes
            out["grads"][tied] = jax.jit(step)(variables["params"], x)
    return out


def test_mean_tied_on_cpu_keeps_one_input_sized_array_less(measured):
    """One ``f32[8,32,32,16]`` less (to within 1 %: the heap's packing moves by a few
    bytes; measured 524 224 of 524 288)."""
    b, one = measured["bytes"], SHAPE[0] * SHAPE[1] * SHAPE[2] * FEATURES * 4
    assert b[False, "cpu"] - b[True, "cpu"] >= 0.99 * one, b


def test_mean_untied_on_the_h100_plan(measured):
    b = measured["bytes"]
    assert b[True, TARGET] == b[False, TARGET], b


def test_gradients_unchanged_and_equal_to_jax(measured):
    """The tie is exact: tied and untied gradients bit for bit; both equal to the untouched
    model's (fp32, rtol 1e-5 of the largest entry)."""
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 measured["grads"][True], measured["grads"][False])
    ref = jax.jit(_step(measured["model"], measured["variables"]))(
        measured["variables"]["params"], measured["x"])
    for a, b in zip(jax.tree.leaves(measured["grads"][True]), jax.tree.leaves(ref)):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)


def test_cpu_only_tie_compiles_to_nothing_on_the_h100_plan():
    """Off CPU, ``tie_on_cpu(x, dep)`` is ``x``: its compiled program holds no barrier (the
    plain tie's barrier holds ``x`` there)."""
    from jaxmem.measure.compiled import compiled_hlo

    x, dep = rand(1, (4, 4)), rand(2, (2,))
    for op, reads in ((ties.tie_on_cpu, False), (ties.tie, True)):
        txt = compiled_hlo(lambda x, d, op=op: op(x, d) * 2, x, dep, target=TARGET)
        entry = txt[txt.index("ENTRY"):]
        assert ("optimization_barrier" in entry) == reads, entry
