"""Per-device compiled bytes and collectives of sharded training steps, default vs jaxmem.

For ResNet-50 (CPU-scaled: width 0.25, 64x64 images) and a GPT (4 layers, d_model 256,
ctx 128), one SGD step compiled (never run) on 8 host CPU devices under data parallel
(8x1 mesh), FSDP (8x1, parameters sharded over 'data') and tensor parallel (4x2 mesh,
Megatron rules), for: plain Flax, ``jaxmem.linen.convert(model, fewbit=None)`` (exact),
``convert(model, fewbit=3)`` and ``convert(model, conv_recompute=False)`` (a bottleneck's 1x1
expansion kept instead of recomputed in its BatchNorm's backward, which under TP repeats the
convolution's collective). Beside each, the one-device step of the same global batch
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

Targets (``--target``, default ``h100,cpu``): every compiled figure is measured on each.
``h100`` is XLA:GPU's plan for 8 x H100 compiled on this machine without a GPU: the sharded
steps are lowered on a mesh of compile-only devices
(``jaxmem.measure.target_mesh("h100", (8,))`` reshaped by ``jaxmem.distributed.mesh``) with
abstract arguments, the one-device steps with ``compiled_memory(..., target="h100")``.
``cpu`` is XLA:CPU on 8 host devices. Limits of the GPU plan: no autotuning (cuBLAS/cuDNN
workspaces not counted: ``temp`` is a lower bound), no timing, XLA of this jax version.

Usage: ``python benchmarks/distributed/bench_distributed.py [--models gpt,resnet50]
[--target h100,cpu]``
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
from jaxmem.measure import TARGETS, compiled_memory, residual_bytes, target_mesh
from jaxmem.measure.target import compile_lowered
from jaxmem.models import gpt, resnet50

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "distributed"
MODES = {"dp": {"data": 8}, "fsdp": {"data": 8}, "tp": {"data": 4, "model": 2},
         "dp-ar": {"data": 8}}
#: each layout's ``train_step`` mode and ``shard_update``: "dp-ar" is data parallel with the
#: gradient all-reduced and the update replicated (``shard_update=False``), for comparison
STEP = {"dp": ("dp", True), "fsdp": ("fsdp", True), "tp": ("tp", True), "dp-ar": ("dp", False)}
GLOBAL_BATCH = 16
#: the one-device batch each mode is compared with: the batch a device holds under it
LOCAL = {m: GLOBAL_BATCH // shape["data"] for m, shape in MODES.items()}
VARIANTS = {"default": None, "jaxmem": {"fewbit": None}, "jaxmem+fewbit3": {"fewbit": 3},
            "jaxmem-conv-kept": {"fewbit": None, "conv_recompute": False},
            "jaxmem-late": {"fewbit": None, "reduce_early": False},
            "jaxmem-repeat": {"fewbit": None, "repeat_collectives": True}}
#: ``train_step`` options (not conversion options) of a variant
STEP_OPTIONS = ("reduce_early", "repeat_collectives")


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


def measure(compiled, gemm=""):
    m = compiled.memory_analysis()
    c = jd.collectives(compiled.as_text())
    out = {"temp": int(m.temp_size_in_bytes),
           "total": int(m.temp_size_in_bytes + m.output_size_in_bytes
                        + m.argument_size_in_bytes - m.alias_size_in_bytes),
           "collectives": c.counts, "collective_bytes": c.bytes}
    if gemm:
        out["gemm_backend"] = gemm
    return out


def _none():
    return {k: 0 for k in jd.KINDS}


def measure_one(fn, args, target):
    """The one-device step on a GPU target (``compiled_memory``; no collectives)."""
    c = compiled_memory(fn, *args, donate_argnums=(0, 1), target=target)
    return {"temp": c.temp_bytes, "total": c.total_bytes, "collectives": _none(),
            "collective_bytes": _none(), "gemm_backend": c.gemm_backend}


def target_devices(target):
    """The devices sharded steps are laid out on: 8 host CPUs, or 8 compile-only GPUs."""
    if target == "cpu":
        return None
    return list(target_mesh(target, (NDEV,), ("data",)).devices.flat)


def _local(batch, b):
    """The batch's leading axis cut to ``b`` (shapes only)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype), batch)


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def run_case(case, quick, targets, variants=tuple(VARIANTS)):
    name, model, params, batch, make_loss = case(quick)
    opt = optax.sgd(0.1)
    ostate = jax.eval_shape(opt.init, params)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    # per layout: bytes of the gradient a device computes (its parameters as the loss reads
    # them: all of them under DP and FSDP, its 'model' shard under TP), of the gradient it
    # keeps after the reduction (its update shard), and of the parameters FSDP gathers
    def _bytes(sh):
        return int(sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                       for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(sh))))

    shard_bytes, floor_bytes = {}, {}
    for layout, shape in MODES.items():
        mode, su = STEP[layout]
        step = jd.train_step(lambda p, b: 0.0, optax.sgd(0.1), jd.mesh(**shape), mode,
                             shard_update=su)
        shard_bytes[layout] = _bytes(step.param_shardings(params))
        local = param_bytes if mode == "fsdp" else shard_bytes[layout]
        gathered = param_bytes if mode == "fsdp" else 0
        floor_bytes[layout] = local + _bytes(step.update_shardings(params)) + gathered
    zparams = _zeros(params)
    rows = []
    for variant in variants:
        kw = dict(VARIANTS[variant] or {})
        step_kw = {k: kw.pop(k) for k in STEP_OPTIONS if k in kw}
        m = model if VARIANTS[variant] is None else jaxmem.linen.convert(model, **kw)
        loss = make_loss(m)

        def one_device_step(p, s, b, loss=loss):
            g = jax.grad(loss)(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        row = {"model": name, "variant": variant, "param_bytes": param_bytes,
               "param_shard_bytes": shard_bytes, "floor_bytes": floor_bytes,
               "residual_local": {}, "targets": {},
               "compile_s": {}}
        for b in sorted(set(LOCAL.values())):
            rep = residual_bytes(loss, zparams, _zeros(_local(batch, b)))
            row["residual_local"][str(b)] = int(rep.activation_bytes)
        one = jax.jit(one_device_step, donate_argnums=(0, 1))
        for target in targets:
            t0 = time.time()
            if target == "cpu":
                def single(bt, one=one):
                    return measure(one.lower(params, ostate, bt).compile())
            else:
                def single(bt, f=one_device_step, target=target):
                    return measure_one(f, (params, ostate, bt), target)
            res = {"single": single(batch), "single_local": {}}
            for b in sorted(set(LOCAL.values())):
                res["single_local"][str(b)] = single(_local(batch, b))
            devs = target_devices(target)
            for layout, shape in MODES.items():
                mode, su = STEP[layout]
                step = jd.train_step(loss, opt, jd.mesh(**shape, devices=devs), mode,
                                     shard_update=su, **step_kw)
                lowered = step.lower(params, ostate, batch)
                compiled, gemm = compile_lowered(lowered, target, "auto")
                res[layout] = measure(compiled, gemm)
            row["targets"][target] = res
            row["compile_s"][target] = round(time.time() - t0, 1)
            print(f"{name} {variant} on {target}: done in {row['compile_s'][target]} s",
                  flush=True)
        rows.append(row)
    return rows


def mib(b):
    return f"{b / 2**20:.2f}"


def _saving(r, base, get):
    return 100 * (1 - get(r) / get(base))


def table(rows, target):
    """The three tables of one target (each row's ``targets[target]``)."""
    out = []
    by = {}
    for r in rows:
        if target in r["targets"]:
            by.setdefault(r["model"], {})[r["variant"]] = {**r, **r["targets"][target]}
    locs = sorted(set(LOCAL.values()))
    out.append(f"Per-device `temp` MiB on {LABEL(target)} (saving vs default under the "
               "same layout):")
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
               "`floor` = the gradient a device computes (all parameters under DP and FSDP, "
               "its 'model' shard under TP) + the gradient it keeps after the reduction (its "
               "1/8 update shard; all of it under DP-AR, the all-reduce) + under FSDP the "
               "gathered parameters: buffers that are live together at the end of the "
               "backward when XLA combines the reductions into one (jaxmem's layers under "
               "`reduce_early` reduce each gradient in its layer and, under FSDP, gather each "
               "weight again in the backward: they go below it).")
    out.append("")
    out.append("| model | variant | layout | saving per device | 1 device same batch | points "
               "| at most 5 below | MiB saved per device / 1 device | residual MiB default -> "
               "jaxmem (activation saving) | jaxmem temp MiB / floor MiB |")
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
                floor = base["floor_bytes"][m]
                out.append(f"| {model} | {v} | {m.upper()} (batch {b}/device) | {sh:.1f}% | "
                           f"{one:.1f}% | {sh - one:+.1f} | "
                           f"{'yes' if sh - one >= -5 else 'NO'} | "
                           f"{mib(d_sh)} / {mib(d_one)} | "
                           f"{mib(res_d)} -> {mib(res_j)} ({100 * (1 - res_j / res_d):.1f}%) | "
                           f"{mib(r[m]['temp'])} / {mib(floor)} |")
    out.append("")
    out.append(f"Collectives per device (count / result bytes) of the compiled step on "
               f"{LABEL(target)}:")
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


def LABEL(target):
    return (f"the {target.upper()} plan (8 x {target.upper()})" if target != "cpu"
            else "8 host CPU devices")


def gemm_used(rows, target):
    used = set()
    for r in rows:
        res = r["targets"].get(target, {})
        for v in res.values():
            if isinstance(v, dict) and v.get("gemm_backend"):
                used.add(v["gemm_backend"])
            if isinstance(v, dict):
                used |= {w["gemm_backend"] for w in v.values()
                         if isinstance(w, dict) and w.get("gemm_backend")}
    return "/".join(sorted(used)) or "-"


READING = """\
DP, FSDP and TP reduce-scatter the gradient onto each device's update
shard (`shard_update=True`); DP-AR is the all-reduce step they replace. On the H100 plan
that is what XLA:GPU compiles: one combined reduce-scatter whose result is a device's eighth
of the gradient; the all-reduces left are the scalar loss, the embedding tables' gradients
(scatter-adds; GPT: 0.63 MiB) and ResNet-50's BatchNorm statistics. DP against DP-AR:
the tables' two columns; a stateful optimizer adds its sharded state to
this (Adam: 2/8 instead of 2 x the parameters a device;
`parity_tests/distributed/test_distributed_gpu_plan.py`). XLA:CPU has no reduce-scatter rewrite: it all-reduces the
gradient and slices it (CPU collectives table), so DP and DP-AR compile to the same `temp`
there, and the CPU `floor` of DP is what the step asks for, not what XLA:CPU does; on CPU
DP sits near the all-reduce floor (`jaxmem temp / floor` column), so its percentage shrinks
while the activations shrink as on one device (residual column).

What sets each step's `temp` on the H100 plan is in `live_peaks.md`
(`benchmarks/distributed/live_peaks.py`: the values of a device's temp allocation live
together at its peak, `jaxmem.measure.live_peak_of_lowered`). XLA:GPU packs every step
tightly: at most 1.50 MiB of a temp allocation (GPT FSDP default, 3.7 %) is not live at its
peak, so what jaxmem removes from the live set comes off `temp`. GPT: jaxmem's DP and FSDP
steps peak in the first backward layer's MLP (`h_3`), holding each layer's MLP hidden (1 MiB a
layer at 2 examples a device) and a 2 MiB weight-gradient product; the default's DP step
peaks in `h_0`'s backward with every layer's residuals alive, its FSDP step holds the
parameters it gathered. Under TP a device holds half of the Megatron-split activations, all
of the replicated ones (layer norms, residual stream, embeddings) and the LM head's 2 MiB
logits shard at its peak, so its mix differs from one device at batch 4. ResNet-50: the
default's DP and TP steps peak in the last stage's backward with weight-shaped buffers (the
3x3 kernels of `layer4`, 0.56 MiB each, and the backward-filter convolutions' gradients);
jaxmem's DP step peaks in the first stage (0.12 MiB maps), its FSDP step at `layer4_0`'s
gathered 3x3 kernel (0.56 MiB in two layouts). Collectives (the `<= default`
columns): on the H100 plan jaxmem's steps reduce each parameter gradient in the layer that
forms it (`reduce_early`, on for GPU meshes), so they run more, smaller reductions than the
default's one combined reduce-scatter for about the same bytes (GPT DP: 43 reduce-scatters,
1.71 MB, against 1 of 1.65 MB; 15.66 against 15.59 MB in all), FSDP gathers each kept weight
again in the backward (GPT: 29.29 MB against 15.59), and under TP ResNet-50's bottleneck
expansion, which its BatchNorm's backward recomputes (`conv_recompute=True`), repeats its
forward all-gather (`conv_recompute=False` keeps the forward's communication only). On the
CPU devices (`reduce_early` off) every jaxmem step's collectives are, kind by kind, no more
than the default's except that ResNet-50 TP all-gather."""


def summary(rows, targets):
    """5-10 lines: per model and layout, the GPU plan's default temp and jaxmem saving beside
    the CPU's, and the collective counts."""
    gpu = [t for t in targets if t != "cpu"]
    if not gpu or "cpu" not in targets:
        return []
    g = gpu[0]
    by = {}
    for r in rows:
        if g in r["targets"] and "cpu" in r["targets"]:
            by.setdefault(r["model"], {})[r["variant"]] = r["targets"]
    out = []
    for model, vs in by.items():
        if "default" not in vs or "jaxmem" not in vs:
            continue
        d, j = vs["default"], vs["jaxmem"]
        one = {t: 100 * (1 - j[t]["single"]["temp"] / d[t]["single"]["temp"])
               for t in (g, "cpu")}
        out.append(f"- {model}, one device, batch {GLOBAL_BATCH}: default temp "
                   f"{mib(d[g]['single']['temp'])} MiB on the {g.upper()} plan vs "
                   f"{mib(d['cpu']['single']['temp'])} MiB on CPU; jaxmem saves {one[g]:.1f}% "
                   f"vs {one['cpu']:.1f}%.")
        for m in MODES:
            sv = {t: 100 * (1 - j[t][m]["temp"] / d[t][m]["temp"]) for t in (g, "cpu")}
            nc = {t: sum(d[t][m]["collectives"].values()) for t in (g, "cpu")}
            ncj = {t: sum(j[t][m]["collectives"].values()) for t in (g, "cpu")}
            out.append(f"  - {m.upper()} per device: default temp {mib(d[g][m]['temp'])} vs "
                       f"{mib(d['cpu'][m]['temp'])} MiB, jaxmem saves {sv[g]:.1f}% vs "
                       f"{sv['cpu']:.1f}%; collectives (default / jaxmem) {nc[g]} / {ncj[g]} "
                       f"vs {nc['cpu']} / {ncj['cpu']}.")
    return out


PLAN_LIMITS = ("GPU plan limits: XLA:GPU's memory plan compiled without a GPU (compile-only "
               "devices of the CUDA PJRT plugin, 8 devices in one host topology): no "
               "autotuning, so cuBLAS/cuDNN workspaces are not counted and `temp` is a lower "
               "bound; no timing; the plan belongs to XLA of jax {jax}. Collective counts on "
               "the GPU plan are after XLA:GPU's collective combiners, so fewer and larger "
               "than XLA:CPU's (a combined collective counts once, with all its results' bytes). "
               "Sharded steps that hold `custom_partitioning` ops (jaxmem's bit-packed "
               "residuals) compile for the GPU plan only once JAX's custom-partitioning "
               "callbacks are registered with the directly loaded CUDA plugin "
               "(`jaxmem.measure.target` does that when it loads the plugin); without them "
               "XLA:GPU fails with 'No registered implementation for custom call to "
               "CustomSPMDPartitioning for platform CUDA'.")


def _cpu_only(r):
    """A row of a part measured on CPU only, in the per-target layout."""
    keys = ("single", "single_local", *MODES)
    return {**{k: v for k, v in r.items() if k not in keys},
            "targets": {"cpu": {k: r[k] for k in keys}}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT),
                    help="folder of distributed.{md,json} and parts/ (default: %(default)s)")
    ap.add_argument("--models", default="gpt,resnet50")
    ap.add_argument("--md-only", action="store_true", help="rebuild the tables from parts/")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated variants ({', '.join(VARIANTS)})")
    ap.add_argument("--target", default="h100,cpu",
                    help=f"comma-separated compile targets ({', '.join(TARGETS)})")
    args = ap.parse_args()
    targets = [t for t in args.target.split(",") if t]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"--target: {t!r} is not one of {TARGETS}")
    assert jax.device_count() == NDEV, jax.device_count()
    cases = {"gpt": gpt_case, "resnet50": resnet_case}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": NDEV,
            "quick": args.quick, "targets": targets,
            "command": ".venv/bin/python benchmarks/distributed/bench_distributed.py"
                       + (" --quick" if args.quick else "")
                       + (f" --target {args.target}" if targets != ["h100", "cpu"] else "")
                       + (f" --out {args.out}" if out != OUT else "")}
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    for key in ([] if args.md_only else args.models.split(",")):
        if key not in cases:
            raise SystemExit(f"--models: {key!r} is not one of {sorted(cases)}")
        rows = run_case(cases[key], args.quick, targets, variants)
        (parts / f"{key}.json").write_text(json.dumps(
            {"command": meta["command"] + f" --models {key}"
             + (f" --variants {args.variants}" if variants != list(VARIANTS) else ""),
             "rows": rows}, indent=1))
    rows, commands = [], []
    for key in cases:  # every model measured so far (one run per model may be separate)
        if (parts / f"{key}.json").exists():
            part = json.loads((parts / f"{key}.json").read_text())
            if isinstance(part, list):  # a part measured on 8 host CPU devices only
                part = {"command": "python benchmarks/distributed/bench_distributed.py "
                                   f"--models {key} (CPU only)",
                        "rows": [_cpu_only(r) for r in part]}
            commands.append(part["command"])
            rows += part["rows"]
    order = list(VARIANTS)
    rows.sort(key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))
    rows.sort(key=lambda r: r["model"])
    meta["part_commands"] = commands
    (out / "distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    shown = [t for t in targets if any(t in r["targets"] for r in rows)]
    md = ["# Sharded training steps: per-device compiled bytes and collectives", "",
          "Regenerate with " + ", then ".join(f"`{c}`" for c in commands) + ".", "",
          (f"Command `{meta['command']}` — jax {meta['jax']}; compiled only (XLA "
           "memory_analysis per device) on " + ", ".join(LABEL(t) for t in shown) + "."), "",
          ("Saving = 1 - jaxmem temp / default temp under the same layout. DP and FSDP: "
           f"8x1 mesh, {LOCAL['dp']} examples per device; TP: 4x2 ('data', 'model'), "
           f"{LOCAL['tp']} examples per device and the Megatron-split layers halved. SGD "
           "(no optimizer state), parameters donated. DP, FSDP and TP reduce-scatter the "
           "gradient onto each device's update shard (`shard_update=True`, the default); "
           "DP-AR is data parallel with the gradient all-reduced and the update replicated "
           "(`shard_update=False`), for comparison. On GPU meshes jaxmem's layers reduce "
           "their parameter gradients where their backward forms them under every layout "
           "(`train_step(..., reduce_early=None)`: on for GPU, off on CPU); "
           "`jaxmem-late` is the same model with `reduce_early=False`; `jaxmem-repeat` with "
           "`train_step(..., repeat_collectives=True)` (the attention's `q, k, v` recomputed "
           "where that repeats collectives: under TP the GPT's fused `c_attn` projection, "
           "split three ways, its split's collective-permutes run again; under FSDP each "
           "layer's kept weight shard gathered once more; DP and DP-AR: the `jaxmem` "
           "step)."), "",
          PLAN_LIMITS.format(jax=meta["jax"]), ""]
    for t in shown:
        missing = sorted({f"{r['model']} {r['variant']}" for r in rows
                          if t not in r["targets"]})
        if missing:
            md += [f"Not measured on {LABEL(t)}: " + ", ".join(missing)
                   + " (their figures come from the CPU-only part named above).", ""]
    summ = summary(rows, shown)
    if summ:
        md += ["## Summary: GPU plan vs CPU", ""] + summ + [""]
    for t in shown:
        md += [f"## {LABEL(t)[0].upper() + LABEL(t)[1:]}", ""]
        if t != "cpu":
            md += [f"GEMM backend: {gemm_used(rows, t)}.", ""]
        md += [table(rows, t), ""]
    if shown and out == OUT:
        md += ["## Reading the tables", "", READING, ""]
    elif shown:  # the reading describes the default results' run and its live_peaks.md
        md += ["## Reading the tables", "", ("Not written for this run: the reading of "
               "`benchmarks/results/distributed/distributed.md` describes its own run (and "
               "`live_peaks.md` beside it)."), ""]
    (out / "distributed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
