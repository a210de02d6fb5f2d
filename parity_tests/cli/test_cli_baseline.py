"""The `baseline` bench section on the Figure-1 chain: both frameworks run the same model and
the byte counts follow from the architecture."""
from __future__ import annotations

import pytest

from jaxmem.bench import baseline


@pytest.fixture(scope="module")
def convchain_row():
    return baseline.measure_model("convchain", quick=True, peak=False)


def test_baseline_same_model_in_both_frameworks(convchain_row):
    assert convchain_row["loss_rdiff"] < 1e-5


def test_baseline_convchain_exact_bytes(convchain_row):
    spec = baseline.MODELS["convchain"]
    n, s = spec.batch[0], spec.size[0]
    layer = n * s * s * 8 * 4  # one f32 (N, S, S, 8) activation
    depth = 8
    # torch: each ReLU output is saved once (ReLU backward and the next conv share its
    # storage), plus (out - y) of the MSE; the chain input x is an argument, not counted.
    assert convchain_row["torch_saved"] == (depth + 1) * layer
    # JAX (jaxpr level): every conv input but x (7), per ReLU a bool mask + an f32 zeros
    # array (1.25 layers each), and the MSE's (out - y).
    assert convchain_row["jax_saved"] == (depth - 1) * layer + depth * layer * 5 // 4 + layer
    assert convchain_row["params"] == depth * 3 * 3 * 8 * 8 * 4
    cm_total = convchain_row["jax_total"]
    assert convchain_row["jax_temp"] <= cm_total
    assert convchain_row["jax_peak"] is None and convchain_row["torch_peak"] is None


def test_baseline_rejects_unknown_model():
    with pytest.raises(ValueError, match="allowed"):
        baseline.run(quick=True, models=["alexnet"])


def test_baseline_does_not_import_torch_at_module_level():
    import subprocess
    import sys

    code = ("import sys, jaxmem, jaxmem.measure, jaxmem.bench.baseline, jaxmem.cli; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
