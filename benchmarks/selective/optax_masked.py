"""Freezing by optax.masked vs differentiating only the trainable subset (ResNet-18 twin).

Command: .venv/bin/python benchmarks/selective/optax_masked.py
Writes benchmarks/results/selective/optax_masked.{json,md}. Compiled bytes (XLA temp+output)
of one jitted gradient step; "optax.masked" = jax.grad w.r.t. all params (what a masked /
multi_transform optimizer is fed), "subset" = jaxmem.selective.grad(trainable=...), "subset +
convert" = the same through jaxmem.linen.convert(model, attention=False).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem import models
from jaxmem.bench.selective import case_filter
from jaxmem.measure import compiled_memory
from jaxmem.selective.subset import grad as sgrad

OUT = os.path.join(os.path.dirname(__file__), "..", "results", "selective")


def main():
    m = models.resnet18(width=0.25, num_classes=10)
    x = jax.random.normal(jax.random.key(0), (8, 64, 64, 3))
    v = m.init(jax.random.key(1), x, train=False)
    rows = []
    for case in ("norm", "conv", "last_quarter"):
        flt = case_filter(case, v["params"])
        out = {"case": case}
        conv = jaxmem.linen.convert(m, attention=False)
        for label, model, subset in (("optax_masked", m, False), ("subset", m, True),
                                     ("subset_convert", conv, True)):
            def loss(p, x, model=model):
                y, _ = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x,
                                   train=True, mutable=["batch_stats"])
                return jnp.mean(y ** 2)
            step = (lambda p, x, loss=loss, flt=flt: sgrad(loss, trainable=flt)(p, x)) if subset \
                else jax.grad(loss)
            c = compiled_memory(step, v["params"], x)
            out[label] = int(c.temp_bytes + c.output_bytes)
        rows.append(out)
        print(out, flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "optax_masked.json"), "w") as f:
        json.dump({"command": "python benchmarks/selective/optax_masked.py", "rows": rows}, f,
                  indent=2)
    with open(os.path.join(OUT, "optax_masked.md"), "w") as f:
        f.write("Regenerate with `python benchmarks/selective/optax_masked.py` (CPU).\n\n")
        f.write("ResNet-18 (width 0.25), batch 8x64x64x3, compiled temp+output bytes of the "
                "gradient step.\n\n| case | optax.masked (grad all) | subset grad | subset + "
                "convert |\n|---|---|---|---|\n")
        f.writelines(f"| {r['case']} | {r['optax_masked'] / 2**20:.2f} MiB | "
                    f"{r['subset'] / 2**20:.2f} MiB | {r['subset_convert'] / 2**20:.2f} MiB |\n" for r in rows)


if __name__ == "__main__":
    main()
