"""What ``jaxmem.transform`` costs when a step is traced: ``jax.jit(jax.grad(f)).lower(...)``
(trace and lowering, no compile) of the untouched loss and of ``jaxmem.transform(loss)``.

The transformation runs once per traced shape (``jit`` caches the result): it reads the
jaxpr, matches and verifies each candidate (normalisations checked in NumPy float64), and
re-emits the program. Models from ``jaxmem.models``: ResNet-18 (batch 4, 32², train-mode
batch norm) and GPT (4 layers, width 64, context 64, batch 8). Each variant is traced
``REPEATS`` times in a fresh ``jax.jit``; the first trace of the transformed loss is cold
(activation tables and matcher caches filled), the least of the others warm. Wall seconds on
this machine's CPU; the figures are the ratio's scale, not a timing promise.

Run:  .venv/bin/python benchmarks/transform/trace_cost.py [--out benchmarks/results/transform]
"""
from __future__ import annotations

import time

import _cli
import jax
import jax.numpy as jnp

import jaxmem
from jaxmem import models

REPEATS = 3


def _resnet18():
    m = models.resnet18(num_classes=10)
    x = jnp.ones((4, 32, 32, 3))
    v = jax.jit(m.init, static_argnames="train")(jax.random.key(1), x, train=False)

    def loss(p, bs, x):
        y, _ = m.apply({"params": p, "batch_stats": bs}, x, train=True,
                       mutable=["batch_stats"])
        return jnp.mean(y ** 2)

    return "resnet18 (b4, 32x32)", loss, (v["params"], v["batch_stats"], x)


def _gpt():
    m = models.gpt(n_layer=4, d_model=64, ctx=64)
    tok = jnp.zeros((8, 64), jnp.int32)
    params = jax.jit(m.init)(jax.random.key(1), tok)["params"]

    def loss(p, t):
        return -jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, t))[..., 0])

    return "gpt (4x64, ctx 64, b8)", loss, (params, tok)


def _lower_seconds(fn, args) -> list[float]:
    out = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        jax.jit(jax.grad(fn)).lower(*args)
        out.append(time.perf_counter() - t)
    return out


def run(targets):
    del targets                      # tracing and lowering do not depend on the plan
    rows = []
    for case in (_resnet18, _gpt):
        name, loss, args = case()
        plain = _lower_seconds(loss, args)
        conv = _lower_seconds(jaxmem.transform(loss), args)
        rows.append({"model": name, "plain_s": round(min(plain), 2),
                     "transform_cold_s": round(conv[0], 2),
                     "transform_warm_s": round(min(conv[1:]), 2)})
    return rows


def markdown(rows, targets):
    del targets
    lines = ["# What `jaxmem.transform` costs at trace time", "",
             (f"`jax.jit(jax.grad(f)).lower(...)` wall seconds (jax {jax.__version__}, "
             f"{jax.default_backend()}); command: `.venv/bin/python "
             "benchmarks/transform/trace_cost.py --out benchmarks/results/transform`."), "",
             "| model | plain JAX (s) | `transform`, first trace (s) | `transform`, again (s) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['plain_s']} | {r['transform_cold_s']} | "
                     f"{r['transform_warm_s']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(_cli.main(__doc__, run, markdown, "trace_cost"))
