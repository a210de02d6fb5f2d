"""Two small Flax blocks under ``jaxmem.transform``: what autodiff keeps and XLA's plan.

* MLP: 6 ``Dense(512)`` layers alternating ``relu`` / ``gelu`` (tanh), batch 256, input 256;
* attention block: width 256, ``x + MHA(LN(x))`` (Flax ``MultiHeadDotProductAttention``,
  4 heads, d = 64) then ``x + Dense(gelu(Dense(LN(x))))`` (MLP 256), batch 8, T = 256;

loss ``mean(y^2)``, f32, random init.  For the untouched loss, ``jaxmem.transform(loss)`` and
``jaxmem.transform(loss, fewbit=3)`` (and, for the attention block,
``jaxmem.transform(loss, attention_chunk=64)``: its attention 64 query rows at a time):
``jaxmem.measure.residual_bytes`` of the loss w.r.t.
the parameters, and the temp bytes of the compiled ``jax.grad`` for XLA:CPU and the H100
plan (``target="h100"``, compiled without a GPU).

Run:  .venv/bin/python benchmarks/transform/bench_blocks.py [--out benchmarks/results/transform]
"""
from __future__ import annotations

import json
import sys

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.measure import compiled_memory, residual_bytes


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(6):
            x = nn.Dense(512)(x)
            x = nn.relu(x) if i % 2 == 0 else nn.gelu(x)
        return x


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        x = x + h
        h = nn.gelu(nn.Dense(256)(nn.LayerNorm()(x)))
        return x + nn.Dense(256)(h)


def run(targets):
    mib = 2 ** 20
    rows = []
    cases = [("MLP 6x512", MLP(), (256, 256)), ("attention block", Block(), (8, 256, 256))]
    for name, model, shape in cases:
        x = jax.random.normal(jax.random.key(0), shape)
        params = model.init(jax.random.key(1), x)

        def loss(p, x, model=model):
            return jnp.mean(model.apply(p, x) ** 2)

        variants = {"default": loss, "transform": jaxmem.transform(loss),
                    "transform(fewbit=3)": jaxmem.transform(loss, fewbit=3)}
        if name == "attention block":
            variants["transform(attention_chunk=64)"] = jaxmem.transform(loss,
                                                                         attention_chunk=64)
        for vname, fn in variants.items():
            row = {"model": name, "variant": vname,
                   "residuals": residual_bytes(fn, params, x).total_bytes / mib}
            for t in targets:
                row[t] = compiled_memory(jax.grad(fn), params, x, target=t).temp_bytes / mib
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(rows, targets) -> str:
    head = "| model | variant | residuals (MiB) | " + " | ".join(
        f"compiled temp {t} (MiB)" for t in targets) + " |"
    out = [head, "|" + "---|" * (3 + len(targets))]
    for r in rows:
        out.append(f"| {r['model']} | {r['variant']} | {r['residuals']:.2f} | "
                   + " | ".join(f"{r[t]:.2f}" for t in targets) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    return _cli.main(__doc__, run, markdown, "blocks", argv)


if __name__ == "__main__":
    sys.exit(main())
