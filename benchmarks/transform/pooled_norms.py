"""Normalisations with statistics pooled over a named axis, under ``jaxmem.transform``.

Tensor-parallel layout simulated on one device with ``jax.vmap(axis_name="r")``: R = 4
replicas, each holding 256 of the 1024 features of 4096 tokens (f32); per layer
``LayerNorm(axis_name="r")`` (statistics over all 1024 features: the local mean and mean of
squares pooled over the replicas) -> ``Dense(256)`` on the local features -> GELU (tanh), and
an ``RMSNorm(axis_name="r")`` at the end; loss ``sum(y^2)`` summed over replicas. For depth 2
and 4, the untouched loss, ``jaxmem.transform(loss, norms=False)`` (the pooled norms left as
written) and ``jaxmem.transform(loss)``: ``jaxmem.measure.residual_bytes``
w.r.t. the parameters and the temp bytes of the compiled ``jax.grad`` for XLA:CPU and the H100
plan (compiled without a GPU). One layer's LayerNorm input is 16 MiB over the replicas.

Run:  .venv/bin/python benchmarks/transform/pooled_norms.py [--out benchmarks/results/transform]
"""
from __future__ import annotations

import datetime
import json
import sys

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.measure import compiled_memory, residual_bytes

R, TOKENS, LOCAL = 4, 4096, 256


class Stack(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(LOCAL)(nn.LayerNorm(axis_name="r")(x)))
        return nn.RMSNorm(axis_name="r")(x)


def _case(depth):
    model = Stack(depth)
    xs = jax.random.normal(jax.random.key(0), (R, TOKENS, LOCAL))
    v = jax.vmap(lambda x: model.init(jax.random.key(1), x), axis_name="r")(xs)
    params = jax.tree_util.tree_map(lambda a: a[0], v)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    def total(fn):
        return lambda p, xs: jnp.sum(jax.vmap(fn, (None, 0), axis_name="r")(p, xs))

    return params, xs, {"default": total(loss),
                        "transform(norms=False)": total(jaxmem.transform(loss, norms=False)),
                        "transform": total(jaxmem.transform(loss))}


def run(targets):
    mib = 2 ** 20
    rows = []
    for depth in (2, 4):
        params, xs, variants = _case(depth)
        for name, fn in variants.items():
            row = {"depth": depth, "variant": name,
                   "residual_mib": residual_bytes(fn, params, xs).activation_bytes / mib}
            for t in targets:
                row[f"temp_{t}_mib"] = compiled_memory(jax.grad(fn), params, xs,
                                                       target=t).temp_bytes / mib
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(rows, targets):
    head = ("| depth | variant | residuals MiB | " + " | ".join(f"temp {t} MiB" for t in targets)
            + " |")
    title = (f"# Pooled normalisations under `jaxmem.transform` "
             f"({datetime.date.today().isoformat()}, jax {jax.__version__})")
    lines = [title, "",
             __doc__.split("\n\n")[1].replace("\n", " "), "", head,
             "|" + "---|" * (3 + len(targets))]
    for r in rows:
        lines.append(f"| {r['depth']} | {r['variant']} | {r['residual_mib']:.2f} | "
                     + " | ".join(f"{r[f'temp_{t}_mib']:.2f}" for t in targets) + " |")
    by = {(r["depth"], r["variant"]): r for r in rows}
    lines += ["", "Per layer (depth 4 minus depth 2, halved):", ""]
    for key in ["residual_mib"] + [f"temp_{t}_mib" for t in targets]:
        per = {v: (by[(4, v)][key] - by[(2, v)][key]) / 2
               for v in ("default", "transform(norms=False)", "transform")}
        lines.append(f"- {key}: " + ", ".join(f"{v} {b:.2f}" for v, b in per.items()))
    return "\n".join(lines) + "\n"


def main(argv=None):
    return _cli.main(__doc__, run, markdown, "pooled_norms", argv)


if __name__ == "__main__":
    sys.exit(main())
