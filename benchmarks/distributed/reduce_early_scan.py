"""``train_step(reduce_early=...)`` on a scanned stack, 8 x H100 plan: per-device temp and
collectives with each weight gradient reduced in its layer (inside the loop body) or left
to XLA:GPU.

Four MLP blocks (d 128, hidden 512) under ``nn.scan``, 16 x 64 tokens, SGD, the loss
converted with ``jaxmem.transform`` and, separately, the model with ``jaxmem.linen.convert``.

    .venv/bin/python benchmarks/distributed/reduce_early_scan.py

Writes ``benchmarks/results/distributed/h100/reduce_early_scan.{md,json}``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FLAG = "--xla_force_host_platform_device_count=8"
if FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    os.execv(sys.executable, [sys.executable, *sys.argv])

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmem
import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem.measure import target_mesh
from jaxmem.measure.target import compile_lowered
from jaxmem.models.transformer import MLPBlock

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "distributed" / "h100"
LAYERS, D, HIDDEN, BATCH, T = 4, 128, 512, 16, 64


class _Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return MLPBlock(HIDDEN, gelu_approximate=True)(c) + c, None


class Stack(nn.Module):
    """``LAYERS`` residual MLP blocks under ``nn.scan`` (parameters stacked on axis 0)."""

    @nn.compact
    def __call__(self, x):
        return nn.scan(_Body, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=LAYERS)()(x, None)[0]


def losses():
    base = Stack()
    x = jax.ShapeDtypeStruct((BATCH, T, D), jnp.float32)
    params = jax.eval_shape(base.init, jax.random.key(0), x)["params"]

    def make(model):
        return lambda p, b: jnp.mean((model.apply({"params": p}, b[0]) - b[1]) ** 2)

    return params, (x, x), {"default": make(base), "transform": jaxmem.transform(make(base)),
                            "linen.convert": make(jaxmem.linen.convert(base))}


def main():
    params, batch, fns = losses()
    opt = optax.sgd(0.1)
    ostate = jax.eval_shape(opt.init, params)
    devs = list(target_mesh("h100", (8,), ("data",)).devices.flat)
    rows = []
    for mode in ("dp", "fsdp"):
        for name, loss in fns.items():
            for early in ((False,) if name == "default" else (True, False)):
                step = jd.train_step(loss, opt, jd.mesh(data=8, devices=devs), mode,
                                     reduce_early=early)
                c, _ = compile_lowered(step.lower(params, ostate, batch), "h100", "auto")
                col = jd.collectives(c.as_text())
                rows.append({"mode": mode, "variant": name, "reduce_early": early,
                             "temp": int(c.memory_analysis().temp_size_in_bytes),
                             "collectives": col.counts, "collective_bytes": col.bytes})
                print(rows[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "reduce_early_scan.json").write_text(json.dumps(
        {"jax": jax.__version__, "rows": rows}, indent=1))
    base = {r["mode"]: r["temp"] for r in rows if r["variant"] == "default"}
    md = ["# `reduce_early` on a scanned stack, 8 x H100 plan", "",
          ("Command: `.venv/bin/python benchmarks/distributed/reduce_early_scan.py` "
           f"(jax {jax.__version__}). {LAYERS} residual MLP blocks (d {D}, hidden {HIDDEN}) "
           f"under `nn.scan`, {BATCH} x {T} tokens (2 sequences a device), SGD, parameters "
           "donated; compiled for 8 H100s without a GPU (no autotuning: temp is a lower "
           "bound). Collective counts are HLO ops: one inside the loop body counts once, "
           "however many iterations run it."), "",
          "| layout | variant | reduce_early | temp MiB | vs default | collectives (count) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        counts = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v)
        md.append(f"| {r['mode'].upper()} | {r['variant']} | {r['reduce_early']} | "
                  f"{r['temp'] / 2**20:.2f} | {r['temp'] / base[r['mode']]:.2f}x | {counts} |")
    (OUT / "reduce_early_scan.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
