"""Largest batch whose compiled step fits a budget: untouched vs ``jaxmem.plan``.

``jaxmem.plan.max_batch`` doubles the batch, then bisects, for the untouched
step (``value_and_grad(loss)`` and ``grad(loss)`` both within the budget, the promise a plan
makes) and for the planned step at the same budget. Models are the
CPU-scaled ones of ``bench_plan.py`` (GPT 4x64, ctx 64; ResNet-50 width 0.125 at 32x32).

    .venv/bin/python benchmarks/plan/max_batch.py [--budget 256MiB] [--models gpt,resnet50]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp

from jaxmem import models
from jaxmem.planner import max_batch

OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "plan"
MIB = 2.0**20


def gpt_case():
    m = models.gpt(n_layer=4, d_model=64, ctx=64)
    params = m.init(jax.random.key(1), jnp.zeros((1, 64), jnp.int32))["params"]

    def loss(p, t):
        lg = m.apply({"params": p}, t)
        return -jnp.mean(jax.nn.log_softmax(lg)[..., 0])

    def make(b):
        return params, jax.random.randint(jax.random.key(0), (b, 64), 0, 256)

    return "gpt (4x64, ctx 64)", loss, make


def resnet_case():
    m = models.resnet50(width=0.125, num_classes=10, stem="cifar")
    v = m.init(jax.random.key(3), jnp.zeros((1, 32, 32, 3)), train=False)

    def loss(p, x):
        y, _ = m.apply({"params": p, "batch_stats": v["batch_stats"]}, x, train=True,
                       mutable=["batch_stats"])
        return jnp.mean(y ** 2)

    def make(b):
        return v["params"], jax.random.normal(jax.random.key(2), (b, 32, 32, 3))

    return "resnet50 (w 0.125, 32x32)", loss, make


CASES = {"gpt": gpt_case, "resnet50": resnet_case}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--models", default="gpt,resnet50")
    ap.add_argument("--limit", type=int, default=4096)
    args = ap.parse_args()
    rows = []
    for key in args.models.split(","):
        name, loss, make = CASES[key]()
        t0 = time.perf_counter()
        fit = max_batch(loss, make, args.budget, limit=args.limit)
        rows.append({"model": name, "budget": args.budget, "budget_bytes": fit.budget_bytes,
                     "default_batch": fit.default_batch, "default_bytes": fit.default_bytes,
                     "planned_batch": fit.planned_batch, "planned_bytes": fit.planned_bytes,
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    cmd = (".venv/bin/python benchmarks/plan/max_batch.py --budget " + args.budget
           + ("" if args.models == "gpt,resnet50" else f" --models {args.models}"))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "max_batch.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    lines = ["# Largest batch within a compiled budget: untouched vs jaxmem.plan", "",
             (f"Command: `{cmd}` (jax {jax.__version__}, {jax.default_backend()}). Compiled bytes "
             "= temp + output + argument - alias, the larger of `value_and_grad(loss)` and "
             "`grad(loss)`; the planned step is "
             "`jaxmem.plan(loss, *args, budget=...)` at each batch tried (doubling, then "
             "bisection)."), "",
             "| model | budget | default batch (MiB) | planned batch (MiB) | batch gain | search s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        gain = (f"{r['planned_batch'] / r['default_batch']:.2f}x" if r["default_batch"]
                else "-")
        lines.append(f"| {r['model']} | {r['budget']} | {r['default_batch']} "
                     f"({r['default_bytes'] / MIB:.1f}) | {r['planned_batch']} "
                     f"({(r['planned_bytes'] or 0) / MIB:.1f}) | {gain} | {r['seconds']} |")
    (OUT / "max_batch.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
