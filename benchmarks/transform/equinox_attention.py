"""An Equinox transformer block in train mode under ``jaxmem.transform``: stored residuals
against XLA's compiled plan.

The block: ``x + MultiheadAttention(LN(x))`` (4 heads, width 32, attention-weights dropout
0.1: a ``where`` on the weights, one key per example and head) then ``x + Dense(relu(
Dense(LN(x))))`` with output dropout, run per example under ``jax.vmap`` (batch 8, a batch
of dropout keys); loss ``mean(sin(y)**2)``; gradients w.r.t. every parameter. For sequence
lengths 64 and 128: ``jaxmem.measure.residual_bytes`` of the untouched loss and of
``jaxmem.transform(loss)`` (the attention, dropout inside, re-emitted as the exact
memory-lean attention), and the temp bytes of the compiled ``jax.grad`` on XLA:CPU and the
H100 plan (compiled without a GPU); the same with ``attention_chunk=32`` (both passes of the
attention core 32 query rows at a time). The slope per token says what each plan keeps per
added position.

Run:  .venv/bin/python benchmarks/transform/equinox_attention.py [--out benchmarks/results/transform]
"""
from __future__ import annotations

import sys

import _cli
import equinox as eqx
import jax
import jax.numpy as jnp

from jaxmem.measure import compiled_memory, residual_bytes
from jaxmem.transform import transform

H, FF, B, LENGTHS = 32, 64, 8, (64, 128)
CHUNK = 32  # query rows per chunk of the chunked variant
KiB = 1024.0


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    att: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, k):
        k = jax.random.split(k, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(H), eqx.nn.LayerNorm(H)
        self.att = eqx.nn.MultiheadAttention(4, H, dropout_p=0.1, key=k[0])
        self.up, self.down = eqx.nn.Linear(H, FF, key=k[1]), eqx.nn.Linear(FF, H, key=k[2])
        self.drop = eqx.nn.Dropout(0.1)

    def __call__(self, x, k):
        k1, k2 = jax.random.split(k)
        h = jax.vmap(self.ln1)(x)
        x = x + self.att(h, h, h, key=k1, inference=False)
        h = jax.nn.relu(jax.vmap(self.up)(jax.vmap(self.ln2)(x)))
        return x + self.drop(jax.vmap(self.down)(h), key=k2, inference=False)


def run(targets):
    params, static = eqx.partition(Block(jax.random.key(0)), eqx.is_inexact_array)
    keys = jax.random.split(jax.random.key(1), B)

    def loss(p, x):
        m = eqx.combine(p, static)
        return jnp.mean(jnp.sin(jax.vmap(m)(x, keys)) ** 2)

    variants = {"default": loss, "transform": transform(loss),
                f"transform, attention_chunk={CHUNK}": transform(loss, attention_chunk=CHUNK)}
    rows = []
    for t in LENGTHS:
        x = jax.random.normal(jax.random.key(2), (B, t, H))
        for name, f in variants.items():
            row = {"length": t, "variant": name,
                   "residual_kib": residual_bytes(f, params, x).activation_bytes / KiB}
            for target in targets:
                row[f"temp_{target}_kib"] = compiled_memory(
                    jax.grad(f), params, x, target=target).temp_bytes / KiB
            rows.append(row)
    return rows


def markdown(rows, targets):
    cols = ["residual_kib"] + [f"temp_{t}_kib" for t in targets]
    head = ["length", "variant", "residuals KiB"] + [f"compiled temp {t} KiB" for t in targets]
    out = ["# Equinox block, train mode (attention dropout inside), under `jaxmem.transform`",
           "", ("Regenerate: `.venv/bin/python benchmarks/transform/equinox_attention.py "
                "--out benchmarks/results/transform`."), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append(f"| {r['length']} | {r['variant']} | "
                   + " | ".join(f"{r[c]:.0f}" for c in cols) + " |")
    lo, hi = LENGTHS
    out += ["", "Per added token (slope between the two lengths), KiB:", ""]
    for c in cols:
        per = {v: (next(r[c] for r in rows if r["length"] == hi and r["variant"] == v)
                   - next(r[c] for r in rows if r["length"] == lo and r["variant"] == v))
               / (hi - lo) for v in dict.fromkeys(r["variant"] for r in rows)}
        out.append(f"- {c}: " + ", ".join(f"{v} {d:.1f}" for v, d in per.items()))
    return "\n".join(out) + "\n"


def main(argv=None):
    return _cli.main(__doc__, run, markdown, "equinox_attention", argv)


if __name__ == "__main__":
    sys.exit(main())
