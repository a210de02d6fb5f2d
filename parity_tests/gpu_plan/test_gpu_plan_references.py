"""Real-H100 figures reproduced by the deviceless H100 plan (validated external references).

``jaxmem bench --quick`` on a real H100 (``benchmarks/results/gpu/run1_bench_quick.tgz``,
``selective.json``, table "cnn", resnet18 width 0.25, case "input", batch 4x32x32): compiled
temp + output bytes (``jaxmem.bench.selective.jax_bytes``) of JAX default 759080 B and of
jaxmem.selective 701720 B. That run's ``jaxmem._prims.ties.tie`` was the arithmetic one on
every platform (XLA:GPU folds it); today's tie is an ``optimization_barrier`` off the CPU.
With the run's tie restored the plan gives both figures to the byte; with today's tie
jaxmem keeps no more. The few-bit packing rows of
``run3_fewbit_packing.json`` are checked in ``test_gpu_plan_fewbit.py``."""
from __future__ import annotations

import functools
import io
import json
import os
import tarfile

import jax
import pytest
from _gp_util import GPU_RESULTS, TARGET, ties_patched

import jaxmem
from jaxmem._prims import ties
from jaxmem.bench.selective import cnn_models, make_step
from jaxmem.measure import compiled_memory


def _real_h100_row():
    with tarfile.open(os.path.join(GPU_RESULTS, "run1_bench_quick.tgz")) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("selective.json"))
        data = json.load(io.TextIOWrapper(tar.extractfile(member)))
    (row,) = [r for r in data["rows"] if r.get("table") == "cnn" and r["model"] == "resnet18"
              and r["case"] == "input"]
    return row


def _measure(x, model, variables, impls):
    out = {}
    for impl in impls:
        m = jaxmem.linen.convert(model, attention=False) if impl == "jaxmem" else model
        c = compiled_memory(make_step(m, variables, "input"), variables["params"], x,
                            target=TARGET)
        out[impl] = c.temp_bytes + c.output_bytes
    return out


@pytest.fixture(scope="module")
def resnet18_input_case():
    """The bench's quick case, measured as the bench measures it, on the H100 plan: with the
    tie of the real run (arithmetic everywhere) and with today's."""
    x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
    model = cnn_models(True)["resnet18"][0]()
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(1), x)
    with ties_patched(_arith=ties._arith_cpu):
        run = _measure(x, model, variables, ("jax", "jaxmem"))
    return {"run": run, "today": _measure(x, model, variables, ("jaxmem",))}


def test_selective_resnet18_quick_case_equals_real_h100(resnet18_input_case):
    row = _real_h100_row()
    assert (row["jax_compiled"], row["jaxmem_compiled"]) == (759080, 701720)  # the file
    assert resnet18_input_case["run"] == {"jax": row["jax_compiled"],
                                          "jaxmem": row["jaxmem_compiled"]}


def test_selective_resnet18_today_keeps_no_more(resnet18_input_case):
    run, today = resnet18_input_case["run"], resnet18_input_case["today"]
    assert today["jaxmem"] <= run["jaxmem"], resnet18_input_case
