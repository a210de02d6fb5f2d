"""``parity_tests/gpu_plan``: the memory invariants of each technique asserted on XLA:GPU's
plan for an H100, compiled on this machine without a GPU (``compiled_memory(...,
target="h100")``, :mod:`jaxmem.measure.target`).

Every test here is skipped, with the reason below, where the CUDA PJRT plugin that compiles
for GPU targets is not installed (CI installs it: ``.ci/run``). Limits of what is asserted:
the plan of this jax/XLA version without autotuning (default Triton GEMM tiles; cuBLAS/cuDNN
workspaces chosen by autotuning are not counted), never a timing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REASON = ("XLA:GPU plan tests need the CUDA PJRT plugin (`.venv/bin/pip install -c "
          "constraints.txt --no-deps --target .venv/gpu-plan jax-cuda12-plugin "
          "jax-cuda12-pjrt`; docs/measuring.md, 'XLA:GPU's plan without a GPU')")


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if HERE in Path(str(it.fspath)).resolve().parents]
    if not mine:
        return
    from jaxmem.measure import gpu_plan_available

    if gpu_plan_available():
        return
    skip = pytest.mark.skip(reason=REASON)
    for it in mine:
        it.add_marker(skip)
