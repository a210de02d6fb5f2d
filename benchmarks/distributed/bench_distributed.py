"""Per-device compiled bytes and collectives of sharded training steps, default vs jaxmem.

For ResNet-50 (CPU-scaled: width 0.25, 64x64 images) and a GPT (4 layers, d_model 256,
ctx 128), one SGD step compiled (never run) on 8 host CPU devices under data parallel
(8x1 mesh), FSDP (8x1, parameters sharded over 'data') and tensor parallel (4x2 mesh,
Megatron rules), for: plain Flax, ``jaxmem.linen.convert(model, fewbit=None)`` (exact) and
``convert(model, fewbit=3)``. Beside each, the one-device step of the same global batch
and of the per-device batches (2 and 4).

Figures: XLA's ``memory_analysis()`` of the compiled step, per device: ``temp`` (activations
and backward intermediates, what jaxmem shrinks) and ``total = temp + output + argument -
alias``; the collectives of the compiled HLO (count and result bytes per device) from
``jaxmem.distributed.collectives``. Saving = ``1 - jaxmem temp / default temp``.

Like for like: a device under DP/FSDP holds 1/8 of the global batch, under TP (4x2) 1/4 of
it, so each sharded column is compared with the one-device step at that *per-device* batch
(same activations per device; the parameter/gradient part of ``temp`` does not shrink with
the batch). Beside it, the activation-only saving: the residual bytes autodiff keeps
(``jaxmem.measure.residual_bytes``, activations only) of the loss at the per-device batch.

Usage: ``python benchmarks/distributed/bench_distributed.py [--models gpt,resnet50]``
(re-executes itself with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``); each model
is stored in ``results/distributed/parts/<model>.json`` and the tables are rebuilt from every
part measured so far into ``benchmarks/results/distributed/distributed.{md,json}``
(``--md-only``: rebuild without measuring). ``--quick`` shrinks the models.
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
import numpy as np
import optax

import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem.measure import residual_bytes
from jaxmem.models import gpt, resnet50

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "distributed"
MODES = {"dp": {"data": 8}, "fsdp": {"data": 8}, "tp": {"data": 4, "model": 2}}
GLOBAL_BATCH = 16
#: the one-device batch each mode is compared with: the batch a device holds under it
LOCAL = {m: GLOBAL_BATCH // shape["data"] for m, shape in MODES.items()}
VARIANTS = {"default": None, "jaxmem": {"fewbit": None}, "jaxmem+fewbit3": {"fewbit": 3}}


def _sds(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def resnet_case(quick):
    model = resnet50(width=0.125 if quick else 0.25, num_classes=100)
    hw = 32 if quick else 64
    x = jax.ShapeDtypeStruct((GLOBAL_BATCH, hw, hw, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((GLOBAL_BATCH,), jnp.int32)
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
    tok = jax.ShapeDtypeStruct((GLOBAL_BATCH, 128), jnp.int32)
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


def _local(batch, b):
    """The batch's leading axis cut to ``b`` (shapes only)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype), batch)


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def run_case(case, quick):
    name, model, params, batch, make_loss = case(quick)
    opt = optax.sgd(0.1)
    ostate = jax.eval_shape(opt.init, params)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    # bytes of one device's parameter shard (= its gradient buffer) under each layout
    shard_bytes = {}
    for mode, shape in MODES.items():
        sh = jd.param_shardings(params, jd.mesh(**shape), mode)
        shard_bytes[mode] = int(sum(
            np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
            for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(sh))))
    zparams = _zeros(params)
    rows = []
    for variant, kw in VARIANTS.items():
        m = model if kw is None else jaxmem.linen.convert(model, **kw)
        loss = make_loss(m)

        def one_device_step(p, s, b, loss=loss):
            g = jax.grad(loss)(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        t0 = time.time()
        one = jax.jit(one_device_step, donate_argnums=(0, 1))
        single = measure(one.lower(params, ostate, batch).compile())
        row = {"model": name, "variant": variant, "param_bytes": param_bytes,
               "param_shard_bytes": shard_bytes,
               "single": single, "single_local": {}, "residual_local": {}}
        for b in sorted(set(LOCAL.values())):
            row["single_local"][str(b)] = measure(
                one.lower(params, ostate, _local(batch, b)).compile())
            rep = residual_bytes(loss, zparams, _zeros(_local(batch, b)))
            row["residual_local"][str(b)] = int(rep.activation_bytes)
        for mode, shape in MODES.items():
            step = jd.train_step(loss, opt, jd.mesh(**shape), mode)
            row[mode] = measure(step.lower(params, ostate, batch).compile())
        row["compile_s"] = round(time.time() - t0, 1)
        print(f"{name} {variant}: done in {row['compile_s']} s", flush=True)
        rows.append(row)
    return rows


def mib(b):
    return f"{b / 2**20:.2f}"


def _saving(r, base, get):
    return 100 * (1 - get(r) / get(base))


def table(rows):
    out = []
    by = {}
    for r in rows:
        by.setdefault(r["model"], {})[r["variant"]] = r
    locs = sorted(set(LOCAL.values()))
    out.append("Per-device `temp` MiB (saving vs default under the same layout):")
    out.append("")
    out.append(f"| model | variant | 1 device, batch {GLOBAL_BATCH} | "
               + " | ".join(f"1 device, batch {b}" for b in locs) + " | "
               + " | ".join(f"{m.upper()} per device (batch {LOCAL[m]})" for m in MODES) + " |")
    out.append("|---|---|---|" + "---|" * (len(locs) + len(MODES)))
    for model, vs in by.items():
        base = vs["default"]
        for v, r in vs.items():
            def cell(get, r=r, v=v, base=base):
                t = get(r)
                return mib(t) + ("" if v == "default" else f" ({_saving(r, base, get):.1f}%)")
            cells = [cell(lambda x: x["single"]["temp"])]
            cells += [cell(lambda x, b=b: x["single_local"][str(b)]["temp"]) for b in locs]
            cells += [cell(lambda x, m=m: x[m]["temp"]) for m in MODES]
            out.append(f"| {model} | {v} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Like for like: each layout's per-device saving next to the one-device saving at "
               "the batch a device holds (points = sharded minus one-device), the same in MiB "
               "saved, and the activation-only saving (residual bytes autodiff keeps at that "
               "batch; with the batch split over 'data' these are a device's residuals). "
               "`floor` = 2 x the parameter bytes a device holds (DP: the gradient and its "
               "all-reduced copy; FSDP: the full gradient before its reduce-scatter and the "
               "gathered parameters; TP: 2 x the device's parameter shard): a `temp` no model "
               "change can go under, since both buffers live at the end of the backward.")
    out.append("")
    out.append("| model | variant | layout | saving per device | 1 device same batch | points "
               "| within 5 | MiB saved per device / 1 device | residual MiB default -> jaxmem "
               "(activation saving) | jaxmem temp MiB / floor MiB |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for model, vs in by.items():
        base = vs["default"]
        for v, r in vs.items():
            if v == "default":
                continue
            for m in MODES:
                b = str(LOCAL[m])
                sh = _saving(r, base, lambda x, m=m: x[m]["temp"])
                one = _saving(r, base, lambda x, b=b: x["single_local"][b]["temp"])
                d_sh = base[m]["temp"] - r[m]["temp"]
                d_one = base["single_local"][b]["temp"] - r["single_local"][b]["temp"]
                res_d, res_j = base["residual_local"][b], r["residual_local"][b]
                shard = base["param_shard_bytes"][m]
                floor = 2 * (base["param_bytes"] if m == "fsdp" else shard)
                out.append(f"| {model} | {v} | {m.upper()} (batch {b}/device) | {sh:.1f}% | "
                           f"{one:.1f}% | {sh - one:+.1f} | "
                           f"{'yes' if abs(sh - one) <= 5 else 'NO'} | "
                           f"{mib(d_sh)} / {mib(d_one)} | "
                           f"{mib(res_d)} -> {mib(res_j)} ({100 * (1 - res_j / res_d):.1f}%) | "
                           f"{mib(r[m]['temp'])} / {mib(floor)} |")
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


READING = """\
Reading the tables. A device's `temp` is the larger of two peaks: the activation peak of
the backward and the gradient peak at its end (`floor`: the gradient and its all-reduced
copy under DP; the full gradient before its reduce-scatter and the gathered parameters
under FSDP). Where jaxmem's activation peak falls under the floor (DP for both models,
FSDP for ResNet-50 and for GPT with few-bit, TP for ResNet-50) the step stops at the floor,
the same for jaxmem and jaxmem+fewbit3, so the percentage shrinks while the activations
shrink exactly as on one device (residual column: the batch split over 'data' splits the
residuals, so a device keeps the one-device residuals of its batch). Where the activation
peak stays above the floor (GPT FSDP, exact jaxmem) the MiB saved per device equal the MiB
saved on one device at that batch. Under TP a device holds half of the Megatron-split
activations and all of the replicated ones (layer norms, residual stream, embeddings), so
its mix differs from one device at batch 4. Per-buffer listings of the compiled steps
(`benchmarks/distributed/peak_buffers.py`) show parameters and gradients, not residuals,
at the peak of the jaxmem steps that sit on the floor. One jaxmem residual is replicated
where its activation is sharded: ResNet-50 under TP has one all-gather more than the
default (`u8[4,16,16,8] -> u8[4,16,16,16]` over 'model', 16 KiB, HLO op_name
`jvp(ResNet)/reshape`): the stem's max-pool argmax codes (`jaxmem.selective.max_pool`),
whose channels follow the channel-split conv, are flattened by `pack_codes`
(`codes.reshape(-1)`) before packing, and a flat layout cannot keep a channel split. Packing
along the last axis would keep it. Under DP and FSDP the flat order is batch-major and the
batch split survives (no extra collective). The TP step still has fewer all-reduces
(201 vs 254) and fewer collective bytes in total than the default."""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="gpt,resnet50")
    ap.add_argument("--md-only", action="store_true", help="rebuild the tables from parts/")
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
    for key in ([] if args.md_only else args.models.split(",")):
        if key not in cases:
            raise SystemExit(f"--models: {key!r} is not one of {sorted(cases)}")
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
          ("Saving = 1 - jaxmem temp / default temp under the same layout. DP and FSDP: "
           f"8x1 mesh, {LOCAL['dp']} examples per device; TP: 4x2 ('data', 'model'), "
           f"{LOCAL['tp']} examples per device and the Megatron-split layers halved. SGD "
           "(no optimizer state), parameters donated."), "", table(rows), "", READING, ""]
    (OUT / "distributed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
