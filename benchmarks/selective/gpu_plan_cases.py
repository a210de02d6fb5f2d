"""Selective differentiation's CNN cases on XLA:GPU's H100 plan beside XLA:CPU, and what the
tie's lowering does on each.

Command: .venv/bin/python benchmarks/selective/gpu_plan_cases.py
    [--models resnet50,resnet18] [--cases input,norm,all] [--batch 8] [--size 64]

For each model (width 0.25, 10 classes) and case, the jitted gradient step of JAX default
(differentiating only the case's leaves) and of
``jaxmem.linen.convert(model, attention=False)`` is compiled for the H100 plan and for the
CPU; compiled = temp + output bytes. The column ``h100_jaxmem_arith_tie`` compiles jaxmem's
step for the H100 plan once more with the tie's CPU lowering forced everywhere
(``x - isnan(g_0) * 0``, which XLA:GPU folds away), to show what the per-platform tie (an
``optimization_barrier`` on GPU) is worth there. The columns ``*_jaxmem_adds_apart`` compile
jaxmem's step once more without recording the residual adds
(``jaxmem.linen.convert(..., residual_adds=False)``: the ResNet block output
``relu(bn3(c3) + shortcut)`` kept for the next block's kernel gradient), to show what
recording them is worth.
Writes benchmarks/results/gpu_plan/selective_cases.{json,md}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "results", "gpu_plan")
MiB = 2.0 ** 20


@contextlib.contextmanager
def _arith_tie():
    """Lower every tie in its CPU (arithmetic) form, whatever the platform."""
    from jaxmem._prims import ties
    saved = ties._arith
    ties._arith = ties._arith_cpu
    try:
        yield
    finally:
        ties._arith = saved


def _bytes(step, params, x, target):
    from jaxmem.measure import compiled_memory
    c = compiled_memory(step, params, x, target=target)
    return int(c.temp_bytes + c.output_bytes), c.gemm_backend


def rows(models, cases, batch, size):
    import jax

    import jaxmem
    from jaxmem import models as zoo
    from jaxmem.bench.selective import make_step
    out = []
    for name in models:
        model = getattr(zoo, name)(width=0.25, num_classes=10)
        x = jax.random.normal(jax.random.key(0), (batch, size, size, 3))
        v = model.init(jax.random.key(1), x, train=False)
        conv = jaxmem.linen.convert(model, attention=False)
        apart = jaxmem.linen.convert(model, attention=False, residual_adds=False)
        for case in cases:
            row = {"model": name, "case": case, "batch": f"{batch}x{size}x{size}"}
            for target in ("h100", "cpu"):
                for impl, m in (("jax", model), ("jaxmem", conv)):
                    b, gemm = _bytes(make_step(m, v, case), v["params"], x, target)
                    row[f"{target}_{impl}"] = b
                    if target == "h100":
                        row["gemm"] = gemm
                row[f"{target}_ratio"] = row[f"{target}_jaxmem"] / row[f"{target}_jax"]
            with _arith_tie():
                row["h100_jaxmem_arith_tie"], _ = _bytes(make_step(conv, v, case), v["params"],
                                                         x, "h100")
            row["h100_arith_tie_ratio"] = row["h100_jaxmem_arith_tie"] / row["h100_jax"]
            for target in ("h100", "cpu"):
                row[f"{target}_jaxmem_adds_apart"], _ = _bytes(make_step(apart, v, case),
                                                               v["params"], x, target)
                row[f"{target}_adds_apart_ratio"] = (row[f"{target}_jaxmem_adds_apart"]
                                                     / row[f"{target}_jax"])
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def markdown(rs, cmd):
    import datetime

    import jax
    lines = ["# Selective CNN cases: H100 plan beside CPU", "",
             f"Command: `{cmd}` (jax {jax.__version__}; {datetime.date.today()}).", "",
             ("compiled = temp + output bytes of the jitted gradient step; ratio = jaxmem / JAX "
             "default on the same plan. H100 plan: XLA:GPU compiled without a GPU (no "
             "autotuning: cuDNN/cuBLAS workspaces not counted, temp a lower bound; no timing). "
             "`arith tie`: jaxmem with the tie lowered in its CPU form on the GPU too (folded "
             "by XLA:GPU). `adds apart`: jaxmem without recording the residual adds (the ResNet "
             "block output kept for the next block's kernel gradient instead of recomputed from "
             "the norms' residuals)."), "",
             ("| model | case | batch | H100 JAX MiB | H100 jaxmem MiB | H100 ratio | H100 ratio, "
             "arith tie | H100 ratio, adds apart | CPU JAX MiB | CPU jaxmem MiB | CPU ratio "
             "| CPU ratio, adds apart | GEMM |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(
            f"| {r['model']} | {r['case']} | {r['batch']} | {r['h100_jax'] / MiB:.2f} | "
            f"{r['h100_jaxmem'] / MiB:.2f} | {r['h100_ratio']:.2f}x | "
            f"{r['h100_arith_tie_ratio']:.2f}x | {r['h100_adds_apart_ratio']:.2f}x | "
            f"{r['cpu_jax'] / MiB:.2f} | {r['cpu_jaxmem'] / MiB:.2f} | {r['cpu_ratio']:.2f}x | "
            f"{r['cpu_adds_apart_ratio']:.2f}x | {r['gemm']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--cases", default="input,norm,all")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    a = ap.parse_args()
    cmd = "python benchmarks/selective/gpu_plan_cases.py " + " ".join(sys.argv[1:])
    rs = rows(a.models.split(","), a.cases.split(","), a.batch, a.size)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "selective_cases.json"), "w") as fh:
        json.dump({"command": cmd, "rows": rs}, fh, indent=2)
    with open(os.path.join(OUT, "selective_cases.md"), "w") as fh:
        fh.write(markdown(rs, cmd))


if __name__ == "__main__":
    main()
