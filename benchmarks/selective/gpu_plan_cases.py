"""Selective differentiation's CNN cases on XLA:GPU's H100 plan beside XLA:CPU, and what the
tie's lowering does on each.

Command: .venv/bin/python benchmarks/selective/gpu_plan_cases.py
    [--models resnet50,resnet18] [--cases input,norm,all] [--batch 8] [--size 64]
    [--width 0.25] [--targets h100,cpu] [--main-only] [--name selective_cases] [--time 0]

For each model (width 0.25 unless ``--width``, 10 classes) and case, the jitted gradient step of JAX default
(differentiating only the case's leaves) and of
``jaxmem.linen.convert(model, attention=False)`` is compiled for the H100 plan and for the
CPU; compiled = temp + output bytes. The column ``h100_jaxmem_arith_tie`` compiles jaxmem's
step for the H100 plan once more with the tie's CPU lowering forced everywhere
(``x - isnan(g_0) * 0``, which XLA:GPU folds away), to show what the per-platform tie (an
``optimization_barrier`` on GPU) is worth there. The columns ``*_jaxmem_adds_apart`` compile
jaxmem's step once more without recording the residual adds
(``jaxmem.linen.convert(..., residual_adds=False)``: the ResNet block output
``relu(bn3(c3) + shortcut)`` kept for the next block's kernel gradient), to show what
recording them is worth. The columns ``*_jaxmem_conv_kept`` compile it once more with
``conv_recompute=False`` (a norm of a 1x1 convolution of another norm's output keeps that
convolution's output instead of recomputing it in its backward pass: ResNet-50's bottleneck
expansion ``c3``), to show what the recomputation is worth.
``--main-only`` compiles the JAX, jaxmem and conv-kept columns only (the large sizes), on
``--targets``. ``--time N``: also the CPU step time of jaxmem and of its conv-kept variant
as a ratio to JAX default's (``jaxmem.bench.selective.time_ratio``: interleaved, median of N
runs each). Writes benchmarks/results/gpu_plan/<name>.{json,md}.
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
    """Lower every tie in its CPU (arithmetic) form, whatever the platform. The tie op is
    traced once per operand types and replayed (``ties._traced_once``), so JAX's caches are
    cleared on entry and exit: a trace made before would otherwise be replayed unchanged."""
    import jax

    from jaxmem._prims import ties
    saved = ties._arith
    ties._arith = ties._arith_cpu
    jax.clear_caches()
    try:
        yield
    finally:
        ties._arith = saved
        jax.clear_caches()


def _bytes(step, params, x, target):
    from jaxmem.measure import compiled_memory
    c = compiled_memory(step, params, x, target=target)
    return int(c.temp_bytes + c.output_bytes), c.gemm_backend


def rows(models, cases, batch, size, width=0.25, targets=("h100", "cpu"), main_only=False,
         time_repeats=0):
    import jax

    import jaxmem
    from jaxmem import models as zoo
    from jaxmem.bench.selective import make_step, time_ratio
    out = []
    for name in models:
        model = getattr(zoo, name)(width=width, num_classes=10)
        x = jax.random.normal(jax.random.key(0), (batch, size, size, 3))
        v = model.init(jax.random.key(1), x, train=False)
        conv = jaxmem.linen.convert(model, attention=False)
        apart = jaxmem.linen.convert(model, attention=False, residual_adds=False)
        kept = jaxmem.linen.convert(model, attention=False, conv_recompute=False)
        for case in cases:
            row = {"model": name, "width": width, "case": case,
                   "batch": f"{batch}x{size}x{size}"}
            for target in targets:
                for impl, m in (("jax", model), ("jaxmem", conv), ("jaxmem_conv_kept", kept)):
                    b, gemm = _bytes(make_step(m, v, case), v["params"], x, target)
                    row[f"{target}_{impl}"] = b
                    if target == "h100":
                        row["gemm"] = gemm
                row[f"{target}_ratio"] = row[f"{target}_jaxmem"] / row[f"{target}_jax"]
                row[f"{target}_conv_kept_ratio"] = (row[f"{target}_jaxmem_conv_kept"]
                                                    / row[f"{target}_jax"])
            if time_repeats:
                args = (v["params"], x)
                ref = make_step(model, v, case)
                row["cpu_time_ratio"] = time_ratio(ref, make_step(conv, v, case), args,
                                                   time_repeats)
                row["cpu_time_conv_kept_ratio"] = time_ratio(ref, make_step(kept, v, case),
                                                             args, time_repeats)
            if main_only:
                print(json.dumps(row), flush=True)
                out.append(row)
                continue
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
             "the norms' residuals). `conv kept`: jaxmem with `conv_recompute=False` (a norm "
             "of a 1x1 convolution of another norm's output keeps that convolution's output "
             "instead of recomputing it)."), "",
             ("| model | case | batch | H100 JAX MiB | H100 jaxmem MiB | H100 ratio | H100 ratio, "
             "arith tie | H100 ratio, adds apart | H100 ratio, conv kept | CPU JAX MiB | "
             "CPU jaxmem MiB | CPU ratio | CPU ratio, adds apart | CPU ratio, conv kept "
             "| GEMM |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def mib(r, key):
        return f"{r[key] / MiB:.2f}" if key in r else "-"

    def ratio(r, key):
        return f"{r[key]:.2f}x" if key in r else "-"

    for r in rs:
        lines.append(
            f"| {r['model']} (w {r.get('width', 0.25):g}) | {r['case']} | {r['batch']} | {mib(r, 'h100_jax')} | "
            f"{mib(r, 'h100_jaxmem')} | {ratio(r, 'h100_ratio')} | "
            f"{ratio(r, 'h100_arith_tie_ratio')} | {ratio(r, 'h100_adds_apart_ratio')} | "
            f"{ratio(r, 'h100_conv_kept_ratio')} | {mib(r, 'cpu_jax')} | "
            f"{mib(r, 'cpu_jaxmem')} | {ratio(r, 'cpu_ratio')} | "
            f"{ratio(r, 'cpu_adds_apart_ratio')} | {ratio(r, 'cpu_conv_kept_ratio')} | "
            f"{r.get('gemm', '-')} |")
    timed = [r for r in rs if "cpu_time_ratio" in r]
    if timed:
        lines += ["", "CPU step time ÷ JAX default's (median, interleaved):", "",
                  "| model | case | batch | jaxmem | jaxmem, conv kept |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} (w {r.get('width', 0.25):g}) | {r['case']} | {r['batch']} | "
                  f"{r['cpu_time_ratio']:.2f}x | {r['cpu_time_conv_kept_ratio']:.2f}x |"
                  for r in timed]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--cases", default="input,norm,all")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--targets", default="h100,cpu")
    ap.add_argument("--main-only", action="store_true",
                    help="only the JAX, jaxmem and conv-kept columns")
    ap.add_argument("--name", default="selective_cases", help="output file name (no suffix)")
    ap.add_argument("--time", type=int, default=0, metavar="N",
                    help="also time the CPU steps, N runs each (default: no timing)")
    a = ap.parse_args()
    cmd = " ".join(["python benchmarks/selective/gpu_plan_cases.py", *sys.argv[1:]])
    rs = rows(a.models.split(","), a.cases.split(","), a.batch, a.size, a.width,
              tuple(a.targets.split(",")), a.main_only, a.time)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"{a.name}.json"), "w") as fh:
        json.dump({"command": cmd, "rows": rs}, fh, indent=2)
    with open(os.path.join(OUT, f"{a.name}.md"), "w") as fh:
        fh.write(markdown(rs, cmd))


if __name__ == "__main__":
    main()
