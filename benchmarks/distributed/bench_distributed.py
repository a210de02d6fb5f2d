"""Per-device compiled bytes and collectives of sharded training steps, default vs jaxmem.

For ResNet-50 (CPU-scaled: width 0.25, 64x64 images) and a GPT (4 layers, d_model 256,
ctx 128), one SGD step compiled (never run) on 8 host CPU devices under data parallel
(8x1 mesh), FSDP (8x1, parameters sharded over 'data') and tensor parallel (4x2 mesh,
Megatron rules), for: plain Flax, ``jaxmem.linen.convert(model, fewbit=None)`` (exact) and
``convert(model, fewbit=3)``. Beside each, the one-device step of the same global batch.

Figures: XLA's ``memory_analysis()`` of the compiled step, per device: ``temp`` (activations
and backward intermediates, what jaxmem shrinks) and ``total = temp + output + argument -
alias``; the collectives of the compiled HLO (count and result bytes per device) from
``jaxmem.distributed.collectives``. Saving = ``1 - jaxmem temp / default temp``.

Usage: ``python benchmarks/distributed/bench_distributed.py`` (re-executes itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``); writes
``benchmarks/results/distributed/distributed.{md,json}``. ``--quick`` shrinks the models.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

NDEV = 8
FLAG = f"--xla_force_host_platform_device_count={NDEV}"
if FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    os.execv(sys.executable, [sys.executable, *sys.argv])

import jax
import jax.numpy as jnp
import optax

import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem.models import gpt, resnet50

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "distributed"
MODES = {"dp": {"data": 8}, "fsdp": {"data": 8}, "tp": {"data": 4, "model": 2}}
VARIANTS = {"default": None, "jaxmem": {"fewbit": None}, "jaxmem+fewbit3": {"fewbit": 3}}


def _sds(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def resnet_case(quick):
    model = resnet50(width=0.125 if quick else 0.25, num_classes=100)
    hw = 32 if quick else 64
    x = jax.ShapeDtypeStruct((16, hw, hw, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((16,), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    stats = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), variables["batch_stats"])

    def make_loss(m):
        def loss(p, batch):
            logits, _ = m.apply({"params": p, "batch_stats": stats}, batch[0],
                                train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
        return loss

    return "ResNet-50 (w0.25, 16x64x64)" if not quick else "ResNet-50 (w0.125, 16x32x32)", \
        model, variables["params"], (x, y), make_loss


def gpt_case(quick):
    model = gpt(vocab=512, ctx=128, d_model=128 if quick else 256, n_head=4,
                n_layer=2 if quick else 4)
    tok = jax.ShapeDtypeStruct((16, 128), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tok)["params"]

    def make_loss(m):
        def loss(p, batch):
            logits = m.apply({"params": p}, batch[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
        return loss

    name = f"GPT ({model.config.n_layer}L, d{model.config.d_model}, 16x128 tokens)"
    return name, model, params, (tok, tok), make_loss


def measure(compiled):
    m = compiled.memory_analysis()
    c = jd.collectives(compiled.as_text())
    return {"temp": int(m.temp_size_in_bytes),
            "total": int(m.temp_size_in_bytes + m.output_size_in_bytes
                         + m.argument_size_in_bytes - m.alias_size_in_bytes),
            "collectives": c.counts, "collective_bytes": c.bytes}


def run_case(case, quick):
    name, model, params, batch, make_loss = case(quick)
    opt = optax.sgd(0.1)
    ostate = jax.eval_shape(opt.init, params)
    rows = []
    for variant, kw in VARIANTS.items():
        m = model if kw is None else jaxmem.linen.convert(model, **kw)
        loss = make_loss(m)

        def one_device_step(p, s, b, loss=loss):
            g = jax.grad(loss)(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        t0 = time.time()
        single = measure(jax.jit(one_device_step, donate_argnums=(0, 1))
                         .lower(params, ostate, batch).compile())
        row = {"model": name, "variant": variant, "single": single}
        for mode, shape in MODES.items():
            step = jd.train_step(loss, opt, jd.mesh(**shape), mode)
            row[mode] = measure(step.lower(params, ostate, batch).compile())
        row["compile_s"] = round(time.time() - t0, 1)
        print(f"{name} {variant}: done in {row['compile_s']} s", flush=True)
        rows.append(row)
    return rows


def mib(b):
    return f"{b / 2**20:.2f}"


def table(rows):
    out = []
    by = {}
    for r in rows:
        by.setdefault(r["model"], {})[r["variant"]] = r
    out.append("| model | variant | 1 device temp MiB (saving) | "
               + " | ".join(f"{m.upper()} temp MiB/dev (saving)" for m in MODES) + " |")
    out.append("|---|---|---|" + "---|" * len(MODES))
    for model, vs in by.items():
        base = vs["default"]
        for v, r in vs.items():
            def cell(key, r=r, v=v, base=base):
                t, b = r[key]["temp"], base[key]["temp"]
                return mib(t) + ("" if v == "default" else f" ({100 * (1 - t / b):.1f}%)")
            out.append(f"| {model} | {v} | {cell('single')} | "
                       + " | ".join(cell(m) for m in MODES) + " |")
    out.append("")
    out.append("Collectives per device (count / result bytes) of the compiled step:")
    out.append("")
    out.append("| model | mode | variant | all-gather | all-reduce | reduce-scatter | "
               "collective-permute | all-to-all | total bytes | <= default |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for model, vs in by.items():
        for mode in MODES:
            base = vs["default"][mode]["collectives"]
            for v, r in vs.items():
                c, b = r[mode]["collectives"], r[mode]["collective_bytes"]
                le = all(c[k] <= base[k] for k in c)
                out.append(f"| {model} | {mode} | {v} | "
                           + " | ".join(f"{c[k]} / {b[k]}" for k in jd.KINDS)
                           + f" | {sum(b.values())} | {'yes' if le else 'NO'} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="gpt,resnet50")
    args = ap.parse_args()
    assert jax.device_count() == NDEV, jax.device_count()
    cases = {"gpt": gpt_case, "resnet50": resnet_case}
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": NDEV,
            "quick": args.quick,
            "command": "python benchmarks/distributed/bench_distributed.py"
                       + (" --quick" if args.quick else "")}
    parts = OUT / "parts"
    parts.mkdir(exist_ok=True)
    for key in args.models.split(","):
        rows = run_case(cases[key], args.quick)
        (parts / f"{key}.json").write_text(json.dumps(rows, indent=1))
    rows = []
    for key in cases:  # every model measured so far (one run per model may be separate)
        if (parts / f"{key}.json").exists():
            rows += json.loads((parts / f"{key}.json").read_text())
    (OUT / "distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["# Sharded training steps: per-device compiled bytes and collectives", "",
          (f"`{meta['command']}` — jax {meta['jax']}, {NDEV} host CPU devices "
           f"({meta['backend']}); compiled only (XLA memory_analysis per device)."), "",
          ("Saving = 1 - jaxmem temp / default temp under the same sharding; the one-device "
           "column is the same global batch on one device."), "", table(rows), ""]
    (OUT / "distributed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
