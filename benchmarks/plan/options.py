"""One budget per conversion option of ``jaxmem.plan`` where the planner picks it.

* OLLA order alone: GPT (``bench_plan.gpt_case``) at 85 % of the default compiled bytes;
* few-bit codes per unit: the same GPT at 50 % with ``allow_approximate=True`` (beside the
  exact plan at the same budget);
* row tiling: VGG-16 (width 1/16, 128x128, batch 1) at 25 %.

Per row: compiled bytes of the plan's value-and-grad step (``plan.value_and_grad()``), the
choices, the largest relative L2 error of a gradient leaf vs the untouched step, and the step
time ratio (median of interleaved runs; 2 shared CPU cores: rough).

    .venv/bin/python benchmarks/plan/options.py
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import gpt_case

from jaxmem import models
from jaxmem.planner import plan

OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "plan"
MIB = 2.0**20


def vgg_small():
    m = models.vgg16(width=1 / 16, num_classes=10)
    x = jax.random.normal(jax.random.key(0), (1, 128, 128, 3))
    params = m.init(jax.random.key(1), x)["params"]

    def loss(p, x):
        return jnp.mean(m.apply({"params": p}, x) ** 2)

    return "vgg16 (w 1/16, 128x128, b1)", loss, (params, x)


def grad_error(p, loss, args):
    g = jax.jit(p.value_and_grad())(*args)[1]   # the ordered step's own gradients too
    g0 = jax.jit(jax.grad(loss))(*args)
    return max(float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
               for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g0)))


def time_ratio(p, loss, args, reps=5):
    fs = [jax.jit(jax.value_and_grad(loss)), jax.jit(p.value_and_grad())]
    for f in fs:
        jax.block_until_ready(f(*args))
    ts = [[], []]
    for _ in range(reps):
        for i, f in enumerate(fs):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[i].append(time.perf_counter() - t)
    return float(np.median(ts[1]) / np.median(ts[0]))


def main():
    gname, gloss, gargs = gpt_case(True)
    vname, vloss, vargs = vgg_small()
    runs = [(gname, gloss, gargs, 0.85, False), (gname, gloss, gargs, 0.5, False),
            (gname, gloss, gargs, 0.5, True), (vname, vloss, vargs, 0.25, False)]
    rows = []
    for name, loss, args, frac, approx in runs:
        t0 = time.perf_counter()
        p = plan(loss, *args, budget=frac, allow_approximate=approx)
        secs = time.perf_counter() - t0
        row = {"model": name, "fraction": frac, "allow_approximate": approx,
               "default_bytes": p.default_bytes, "compiled_bytes": p.compiled_bytes,
               "choices": [f"{c.label}: {c.option}" + (f" {c.bits} bit" if c.bits else "")
                           + (f" {c.rows} rows" if c.rows else "")
                           for c in p.choices if c.option != "store"] or ["all stored"],
               "order_applied": bool(p.order is not None and p.order.applied),
               "notes": list(p.notes), "gradient_rel_error": grad_error(p, loss, args),
               "time_ratio": time_ratio(p, loss, args), "plan_seconds": secs}
        print(json.dumps(row), flush=True)
        rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "options.json").write_text(json.dumps({"jax": jax.__version__, "rows": rows},
                                                 indent=1))
    lines = ["# jaxmem.plan: a budget per conversion option", "",
             ("Command: `.venv/bin/python benchmarks/plan/options.py` (CPU, jax "
             f"{jax.__version__}; 2 shared cores: times are rough)"), "",
             ("| model | budget | compiled MiB (x default) | plan | gradient error | time | "
             "planning s |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        plan_text = ("untouched step in an OLLA order" if r["order_applied"]
                     else "; ".join(r["choices"]))
        lines.append(
            f"| {r['model']} | {int(r['fraction'] * 100)} %"
            f"{' approx.' if r['allow_approximate'] else ''} | "
            f"{r['compiled_bytes'] / MIB:.2f} ({r['compiled_bytes'] / r['default_bytes']:.2f}x)"
            f" | {plan_text} | {r['gradient_rel_error']:.1e} | {r['time_ratio']:.2f}x | "
            f"{r['plan_seconds']:.0f} |")
    lines += ["", ("gradient error: largest relative L2 error of a gradient leaf vs the "
              "untouched step (fp32; exact plans differ by rounding only).")]
    (OUT / "options.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
