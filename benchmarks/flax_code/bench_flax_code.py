"""Flax code as users write it: compiled bytes and step time of the FULL train step.

Command: .venv/bin/python benchmarks/flax_code/bench_flax_code.py [--quick] [--models a,b]
[--target h100,cpu] [--out STEM]. Writes benchmarks/results/flax_code/flax_code{,_quick}.{json,md} (or
``STEM.json`` / ``STEM.md``).

For every model of ``jaxmem.bench.flax_models`` (Linen ResNet, Linen causal LM unrolled and
under ``nn.scan(nn.remat(...))``, NNX CNN, NNX ViT, NNX scanned stack), plus
``linen_lm_remat`` (the LM unrolled with ``nn.remat`` per block: the like-for-like twin the
scanned LM is compared with), the jitted train step
(forward, backward and the optax update) is compiled three ways:

* ``default`` — the untouched model;
* ``exact``   — ``jaxmem.linen.convert(model)`` / ``jaxmem.nnx.convert(module)`` (exact
  techniques: same outputs and gradients);
* ``fewbit3`` — the same with ``fewbit=3`` (3-bit residuals for smooth activations:
  approximate gradients, opt-in).

Compiled bytes are ``temp + output + argument - alias`` of XLA's plan
(``jaxmem.measure.compiled_memory``), on every ``--target`` (default ``h100,cpu``): ``h100``
is XLA:GPU's plan for one H100 compiled here without a GPU (no autotuning: cuBLAS/cuDNN
workspaces not counted, temp a lower bound; no timing), ``cpu`` XLA:CPU's. Step time is a ratio to ``default`` measured side by side
in this run (the three compiled steps called in turn, median of ``--repeats`` calls after one
warm-up call each). Where a model has a depth knob the per-layer slope is
``(bytes(2L) - bytes(L)) / L`` with ``L = SLOPE_DEPTH`` (the base depth unless listed): the
ResNet's slope is taken from 3 to 6 blocks per stage, because at 1 and 2 blocks the
untouched step's peak is set by the stem (7x7 conv at 16x16 and the max-pool), not by the
blocks (temp bytes equal at both depths), so an added block fits under that peak and the
1 -> 2 slope understates the per-block cost (measured default 92 KiB at 1 -> 2, 472 at
2 -> 3, 668 per step from 3 on; converted: 476 per step from 2 on).

Fine-tuning (Linen ResNet): head only (frozen backbone), norm only, early layers frozen and
later ones trained, and input optimisation (parameters frozen, the input trained). Baselines
a user would write: a jitted step taking the gradient of everything and freezing with
``optax.multi_transform({'train': adamw, 'frozen': optax.set_to_zero()}, labels)`` (the
strongest: XLA prunes gradients nobody reads) and with ``optax.masked`` (``masked(adamw,
mask)`` chained with ``masked(set_to_zero(), not mask)``); against the trainable-subset step
``jaxmem.selective.subset.value_and_grad(..., trainable=filter)`` (only the trainable leaves
are differentiated; optimizer state for them only) on the untouched and on the converted model.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import flax
import jax
import optax

import jaxmem
from jaxmem.bench import flax_models as FM
from jaxmem.bench.flax_models import ResNet
from jaxmem.measure import TARGETS, compiled_memory
from jaxmem.selective import subset as S

#: the models measured: ``jaxmem.bench.flax_models.STEPS`` plus the unrolled remat twin of
#: ``linen_lm_scan`` (placed after it)
STEPS = {}
for _k, _v in FM.STEPS.items():
    STEPS[_k] = _v
    if _k == "linen_lm_scan":
        STEPS["linen_lm_remat"] = FM.linen_lm_remat

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "flax_code")
MIB = 2.0**20


def _convert_for(name, fewbit):
    mod = jaxmem.nnx if name.startswith("nnx") else jaxmem.linen
    return lambda m: mod.convert(m, fewbit=fewbit)


VARIANTS = {"default": None, "exact": None, "fewbit3": 3}
# Training-sized batches for the small models: activations, not parameters and optimizer
# state, dominate the step's bytes (as they do when training real models).
BATCH = {"linen_resnet": 32, "linen_lm": 32, "linen_lm_scan": 32, "linen_lm_remat": 32,
         "nnx_cnn": 128,
         "nnx_vit": 32, "nnx_scan": 512}


# Depth from which the per-layer slope is measured (``L`` -> ``2L``); default: base depth.
SLOPE_DEPTH = {"linen_resnet": 3}


def _build(name, variant, depth=None):
    convert = None if variant == "default" else _convert_for(name, VARIANTS[variant])
    return STEPS[name](convert=convert, depth=depth, batch_size=BATCH.get(name))


def _bytes(case, target="cpu") -> dict:
    c = compiled_memory(case.pure_step, *case.pure_args, target=target)
    return {"total": c.total_bytes, "temp": c.temp_bytes, "output": c.output_bytes,
            "argument": c.argument_bytes, "alias": c.alias_bytes,
            "gemm_backend": c.gemm_backend}


def _times(cases: dict, repeats: int) -> tuple[dict, dict]:
    """Median wall seconds and median process CPU seconds per call of each case's jitted
    full step, called side by side. CPU time (all threads of this process) is less
    sensitive than wall time to other processes sharing the cores."""
    fns = {k: (jax.jit(c.pure_step), c.pure_args) for k, c in cases.items()}
    for f, a in fns.values():  # compile + warm up
        jax.block_until_ready(f(*a))
        jax.block_until_ready(f(*a))
    t = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (f, a) in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*a))
            t[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return ({k: statistics.median(v) for k, v in t.items()},
            {k: statistics.median(v) for k, v in cpu.items()})


def bench_models(names, variants, repeats, slopes, targets) -> list[dict]:
    """Per model: ``bytes[target][variant]``, ``bytes_ratio[target][variant]``,
    ``slope[target][variant]`` (compiled figures on each target) and CPU time ratios."""
    rows = []
    for name in names:
        cases = {v: _build(name, v) for v in variants}
        row = {"model": name, "depth": cases["default"].depth, "bytes": {}, "slope": {},
               "bytes_ratio": {}, "slope_ratio": {}}
        for t in targets:
            row["bytes"][t] = {v: _bytes(c, t) for v, c in cases.items()}
            row["bytes_ratio"][t] = {v: row["bytes"][t][v]["total"]
                                     / row["bytes"][t]["default"]["total"] for v in variants}
        secs, cpu = _times(cases, repeats)
        row["seconds"] = secs
        row["cpu_seconds"] = cpu
        row["time_ratio"] = {v: secs[v] / secs["default"] for v in variants}
        row["cpu_ratio"] = {v: cpu[v] / cpu["default"] for v in variants}
        if slopes and row["depth"] is not None:
            L = SLOPE_DEPTH.get(name, row["depth"])
            row["slope_depths"] = [L, 2 * L]
            for v in variants:
                small = None if L == row["depth"] else _build(name, v, depth=L)
                big = _build(name, v, depth=2 * L)
                for t in targets:
                    b1 = (row["bytes"][t][v]["total"] if small is None
                          else _bytes(small, t)["total"])
                    b2 = _bytes(big, t)["total"]
                    row["slope"].setdefault(t, {})[v] = (b2 - b1) / L
            for t in targets:
                sl = row["slope"][t]
                row["slope_ratio"][t] = {v: sl[v] / sl["default"] for v in variants
                                         if sl["default"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# Fine-tuning (Linen ResNet)
# ---------------------------------------------------------------------------------------

def _finetune_setup(depth=1, width=8, image=32, batch=8):
    kx, ky, ki = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, image, image, 3))
    y = jax.random.randint(ky, (batch,), 0, 10)
    ref = ResNet(stage_sizes=(depth, depth), num_filters=width)
    v = ref.init(ki, x, train=False)
    return ref, v, x, y


FINETUNE = {
    # name: (trainable regex on parameter paths, or "input")
    "head_only": r"^Dense_0/",
    "norm_only": r"(bn_init|BatchNorm_|norm_proj)",
    "early_frozen_late_trained": r"^(ResNetBlock_1|Dense_0)/",
    "input_optimisation": "input",
}


def _finetune_steps(model, v, x, y, case):
    """Four jitted steps of one fine-tune case: {label: (fn, args)}."""
    tx = optax.adamw(1e-3)
    stats = v["batch_stats"]
    input_opt = FINETUNE[case] == "input"

    if input_opt:  # optimise the input; the network in eval mode, every parameter frozen
        tree = {"params": v["params"], "x": x}
        trainable = r"^x$"

        def loss(t):
            logits = model.apply({"params": t["params"], "batch_stats": stats}, t["x"],
                                 train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats
    else:
        tree = v["params"]
        trainable = FINETUNE[case]

        def loss(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                                      mutable=["batch_stats"])
            return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
                    upd["batch_stats"])

    mask = S.trainable_mask(tree, trainable)
    labels = jax.tree.map(lambda m: "train" if m else "frozen", mask)

    def full_grad_step(opt):
        def step(t, s):
            (l, new_stats), g = jax.value_and_grad(loss, has_aux=True)(t)
            u, s = opt.update(g, s, t)
            return optax.apply_updates(t, u), s, l, new_stats
        return step, (tree, opt.init(tree))

    multi = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
    inv = jax.tree.map(lambda m: not m, mask)
    masked = optax.chain(optax.masked(tx, mask), optax.masked(optax.set_to_zero(), inv))

    def subset_step(m_loss):
        vg = S.value_and_grad(m_loss, has_aux=True, trainable=trainable)

        def step(t, s):
            (l, new_stats), g = vg(t)
            tr, fr = S.partition(t, trainable)
            u, s = tx.update(g, s, tr)
            return S.combine(optax.apply_updates(tr, u), fr), s, l, new_stats
        return step, (tree, tx.init(S.partition(tree, trainable)[0]))

    return {"optax_masked": full_grad_step(masked),
            "multi_transform": full_grad_step(multi),
            "subset": subset_step(loss)}


FT_LABELS = ("multi_transform", "optax_masked", "subset", "subset_convert")


def bench_finetune(cases, targets) -> list[dict]:
    """Per case: ``bytes[target][label]`` and ``ratio_vs_multi_transform[target][label]``."""
    ref, v, x, y = _finetune_setup()
    conv = jaxmem.linen.convert(ref)
    rows = []
    for case in cases:
        row = {"case": case, "trainable": FINETUNE[case], "bytes": {},
               "ratio_vs_multi_transform": {}}
        steps = _finetune_steps(ref, v, x, y, case)
        steps["subset_convert"] = _finetune_steps(conv, v, x, y, case)["subset"]
        for t in targets:
            b = {label: compiled_memory(fn, *args, target=t).total_bytes
                 for label, (fn, args) in steps.items()}
            row["bytes"][t] = b
            row["ratio_vs_multi_transform"][t] = {k: b[k] / b["multi_transform"] for k in
                                                  ("optax_masked", "subset", "subset_convert")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------

def _env() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "python": sys.version.split()[0], "backend": jax.default_backend(), "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _label(t) -> str:
    return "H100 plan" if t == "h100" else ("CPU" if t == "cpu" else f"{t} plan")


def _misses(models, targets) -> list[str]:
    """The targets each model misses (exact variant), in words, per compile target."""
    out, by = [], {r["model"]: r for r in models}
    for r in models:
        for t in targets:
            br = r["bytes_ratio"][t]["exact"]
            if br > 0.80:
                out.append(f"{r['model']}: exact compiled bytes {br:.2f}x on {_label(t)} "
                           "(> 0.80x)")
        tr = r["time_ratio"]["exact"]
        if tr > 1.10:
            cpu = r.get("cpu_ratio", {}).get("exact")
            extra = f" wall ({cpu:.2f}x process CPU time)" if cpu is not None else ""
            out.append(f"{r['model']}: exact step time {tr:.2f}x{extra} on CPU (> 1.10x)")
    # the scanned model against its like-for-like unrolled twin (same nn.remat per block)
    if "linen_lm_remat" in by and "linen_lm_scan" in by:
        for t in targets:
            a = by["linen_lm_remat"]["bytes_ratio"][t]["exact"]
            b = by["linen_lm_scan"]["bytes_ratio"][t]["exact"]
            if b - a > 0.05:
                out.append(f"linen_lm_scan: exact ratio {b:.2f}x vs unrolled remat twin "
                           f"linen_lm_remat {a:.2f}x on {_label(t)} (more than 5 points)")
    return out


def remat_residuals(depth=2) -> dict:
    """Residual (activation) bytes per added block that autodiff keeps for the training loss
    of the unrolled LM with and without ``nn.remat`` per block, untouched and converted, next
    to the bytes of one block input (``batch x seq x d_model`` f32).

    Under Flax's default ``nn.remat`` (``policy=None``: nothing inside the block is saveable)
    a block keeps only its input for the backward pass and recomputes everything else, so
    jaxmem's per-layer residuals cannot differ from the untouched model's: the whole saving
    of a converted remat block is in the recomputed block's working set during its backward.
    """
    from jaxmem.measure import residual_bytes

    out = {}
    for name in ("linen_lm", "linen_lm_remat"):
        row = {}
        for variant in ("default", "exact"):
            per = []
            for d in (depth, 2 * depth):
                case = _build(name, variant, depth=d)
                f, params = case.loss_of_params(True)
                per.append(residual_bytes(lambda p, f=f: f(p)[0], params).activation_bytes)
            row[variant] = (per[1] - per[0]) / depth
        out[name] = row
    case = _build("linen_lm", "default")
    tokens = case.batch[0]
    out["block_input_bytes"] = int(tokens.shape[0] * tokens.shape[1] * case.model.d_model * 4)

    def param_bytes(d):
        return sum(x.nbytes for x in jax.tree.leaves(_build("linen_lm", "default", d).params()))

    out["block_param_bytes"] = (param_bytes(2 * depth) - param_bytes(depth)) / depth
    print(json.dumps({"remat_residuals": out}), flush=True)
    return out


def _cells(r, targets) -> list[str]:
    """Table cells of one model row: bytes on each target, then the CPU time ratios."""
    wall, cpu = r["time_ratio"], r.get("cpu_ratio", {})

    def t(v):
        if v not in wall:
            return "-"
        return f"{wall[v]:.2f}x / {cpu[v]:.2f}x" if v in cpu else f"{wall[v]:.2f}x"

    def size(tg, v):
        b = r["bytes"][tg]
        if v not in b:
            return "-"
        if v == "default":
            return f"{b[v]['total'] / MIB:.2f}"
        return f"{b[v]['total'] / MIB:.2f} ({r['bytes_ratio'][tg][v]:.2f}x)"

    cells = [r["model"], "-" if r["depth"] is None else str(r["depth"])]
    for tg in targets:
        cells += [size(tg, v) for v in VARIANTS]
    return cells + [t("exact"), t("fewbit3")]


def _slope_cells(r, targets) -> list[str]:
    def slope(tg, v):
        sl, slr = r["slope"].get(tg, {}), r["slope_ratio"].get(tg, {})
        if v not in sl:
            return "-"
        ratio = f" ({slr[v]:.2f}x)" if v != "default" and v in slr else ""
        return f"{sl[v] / 1024:.0f}{ratio}"

    return [r["model"], str(r.get("slope_depths", "-"))] + [
        slope(tg, v) for tg in targets for v in VARIANTS]


def _gemm(res, t) -> str:
    used = {b.get("gemm_backend") for r in res["models"] for b in r["bytes"].get(t, {}).values()}
    return "/".join(sorted(u for u in used if u)) or "-"


def _summary(res) -> list[str]:
    """5-10 lines: the headline GPU-plan vs CPU figures."""
    ts = res["targets"]
    gpu = [t for t in ts if t != "cpu"]
    if not gpu or "cpu" not in ts:
        return []
    g = gpu[0]
    out = []
    for r in res["models"]:
        b, br = r["bytes"], r["bytes_ratio"]
        fb = (f", fewbit3 {br[g]['fewbit3']:.2f}x vs {br['cpu']['fewbit3']:.2f}x"
              if "fewbit3" in br[g] else "")
        gemm = "/".join(sorted({x.get("gemm_backend", "") for x in b[g].values()} - {""}))
        out.append(f"- {r['model']}: default {b[g]['default']['total'] / MIB:.2f} MiB on the "
                   f"{_label(g)} (GEMM {gemm or '-'}) vs {b['cpu']['default']['total'] / MIB:.2f}"
                   f" MiB on CPU; exact {br[g]['exact']:.2f}x vs {br['cpu']['exact']:.2f}x{fb}.")
    return out


VARIANT_NAMES = {"default": "default MiB", "exact": "exact MiB (ratio)",
                 "fewbit3": "fewbit3 MiB (ratio)"}


def _markdown(res) -> str:
    env, cmd, ts = res["environment"], res["command"], res["targets"]
    models = res["models"]
    out = ["# Flax code: full train step, default vs jaxmem\n",
           f"Regenerate with `{cmd}`.\n",
           (f"jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, compiled for "
            + ", ".join(_label(t) for t in ts) + f"; times on CPU {env['cpu']} "
            f"({env['cpu_count']} cores), {env['date']}.\n"),
           ("Compiled bytes = temp + output + argument - alias of the jitted full train step "
            "(optimizer update included), on each target: the H100 plan is XLA:GPU's memory "
            "plan for one H100 compiled on this machine without a GPU "
            "(`jaxmem.measure.compiled_memory(..., target='h100')`), CPU is XLA:CPU's. "
            "Ratios are to `default` on the same target; time ratios (wall / "
            f"process CPU time) are CPU-only, medians of {res['repeats']} side-by-side calls "
            "after warm-up (wall time is noisy on a shared machine). "
            "Slope = bytes per added unit of depth (KiB), from depth L to 2L (L = the base "
            "depth, except "
            + (", ".join(f"{k} L={v}" for k, v in SLOPE_DEPTH.items()) or "none")
            + ": below that the untouched step's peak is set by the stem, not the blocks). "
            "Batch sizes: "
            + ", ".join(f"{k} {v}" for k, v in res["batch_sizes"].items()) + ".\n"),
           (f"GPU plan limits: no autotuning (cuBLAS/cuDNN workspaces not counted: temp is a "
            f"lower bound); no timing; the plan belongs to XLA of jax {env['jax']}. GEMM "
            "backend: " + ", ".join(f"{_label(t)} {_gemm(res, t)}" for t in ts if t != "cpu")
            + ".\n")]
    summ = _summary(res)
    if summ:
        out += ["## Summary: H100 plan vs CPU\n"] + summ + [
            "", ("(cuBLAS where XLA:GPU finds no Triton tiling for a dot without autotuning; "
                 "the cuBLAS workspace is not in the plan.)"), ""]
    out += ["## Compiled bytes and step time\n",
            "| model | depth | "
            + " | ".join(f"{_label(t)} {VARIANT_NAMES[v]}" for t in ts for v in VARIANTS)
            + " | time exact (CPU) | time fewbit3 (CPU) |",
            "|---|---|" + "---|" * (len(ts) * len(VARIANTS) + 2)]
    out += ["| " + " | ".join(_cells(r, ts)) + " |" for r in models]
    if any(r["slope"] for r in models):
        out += ["", "## Per-layer slope (KiB per added unit of depth)\n",
                "| model | depths | "
                + " | ".join(f"{_label(t)} {v}" for t in ts for v in VARIANTS) + " |",
                "|---|---|" + "---|" * (len(ts) * len(VARIANTS))]
        out += ["| " + " | ".join(_slope_cells(r, ts)) + " |" for r in models if r["slope"]]
    out += ["", ("Targets (exact): compiled bytes <= 0.80x, step time <= 1.10x, the scanned "
                 "model within 5 points of its unrolled twin (`linen_lm_scan` vs `linen_lm_remat`: "
                 "both remat every block). Misses:\n")]
    out += [f"- {m}" for m in _misses(models, ts)] or ["- none"]
    by = {r["model"]: r for r in models}
    if "linen_lm" in by and "linen_lm_remat" in by:
        for t in ts:
            a = by["linen_lm"]["bytes"][t]["default"]["total"]
            b = by["linen_lm_remat"]["bytes"][t]["default"]["total"]
            held = ("the plan keeps as much with the remat as without it (the recomputation "
                    "is scheduled early), so the twin's ratio is jaxmem's saving without remat "
                    "in effect" if abs(b - a) <= 0.01 * a else
                    f"the remat holds ({b / a:.2f}x of the bytes without it)")
            out += ["", (f"On {_label(t)}, `linen_lm_remat` compiles (default) to "
                         f"{b / MIB:.2f} MiB against {a / MIB:.2f} MiB for `linen_lm` without "
                         f"remat: {held}.")]
    rr = res.get("remat_residuals")
    if rr:
        out += ["", "## What `nn.remat` already recomputes (unrolled LM, training loss)\n",
                ("Residual (activation) bytes per added block that autodiff keeps "
                 "(`jaxmem.measure.residual_bytes`, traced, the same on every target), KiB; "
                 f"one block input is {rr['block_input_bytes'] / 1024:.0f} KiB. Flax's default "
                 "`nn.remat` (`policy=None`) keeps only each block's input and recomputes the "
                 "rest in the backward pass, so per block there is nothing left for jaxmem to "
                 "shrink (ratio ~1); jaxmem's saving under remat is the recomputed block's "
                 "working set while its backward runs, which shows in the total, not the "
                 "slope.\n"),
                "| model | default KiB/block | exact KiB/block (ratio) |", "|---|---|---|"]
        pb = rr.get("block_param_bytes")
        tail = (f"One block's parameters are {pb / 1024:.0f} KiB: with its gradient and Adam's "
                f"two moments that is {4 * pb / 1024:.0f} KiB per block, most of the compiled "
                "per-layer slope of the scanned remat model above, which jaxmem cannot change "
                "either.") if pb else ""
        for name in ("linen_lm", "linen_lm_remat"):
            d, e = rr[name]["default"], rr[name]["exact"]
            ratio = f"{e / d:.2f}x" if d else "-"
            out.append(f"| {name} | {d / 1024:.0f} | {e / 1024:.0f} ({ratio}) |")
        if tail:
            out += ["", tail]
    if res["finetune"]:
        out += ["", "## Fine-tuning (Linen ResNet, batch 8x32x32x3): compiled bytes of the step\n",
                ("Baselines differentiate everything: `multi_transform` freezes with "
                 "`optax.multi_transform({'train': adamw, 'frozen': set_to_zero()})` (the "
                 "strongest a user writes), `optax_masked` with `masked(adamw) + "
                 "masked(set_to_zero)`. "
                 "`subset` differentiates only the trainable leaves "
                 "(`jaxmem.selective.subset.value_and_grad(trainable=...)`), `subset_convert` the "
                 "same on `jaxmem.linen.convert(model)`. Ratios are to `multi_transform` on the "
                 "same target.\n"),
                "| case | " + " | ".join(f"{_label(t)} {k}" + (" MiB" if k == "multi_transform"
                                                             else "")
                                       for t in ts for k in FT_LABELS) + " |",
                "|---|" + "---|" * (len(ts) * len(FT_LABELS))]
        for r in res["finetune"]:
            cells = []
            for t in ts:
                b, rr_ = r["bytes"][t], r["ratio_vs_multi_transform"][t]
                cells.append(f"{b['multi_transform'] / MIB:.2f}")
                cells += [f"{b[k] / MIB:.2f} ({rr_[k]:.2f}x)" for k in FT_LABELS[1:]]
            out.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    if res["quick"]:
        out.append("\n(quick run: base depth only, no slopes, no few-bit.)")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="exact vs default at base depth only, fewer fine-tune cases")
    ap.add_argument("--models", default=",".join(STEPS), help="comma-separated model names")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--skip-finetune", action="store_true",
                    help="measure the models only (no fine-tuning cases)")
    ap.add_argument("--target", default="h100,cpu",
                    help="comma-separated compile targets for the compiled bytes "
                         f"({', '.join(TARGETS)}); times are always CPU")
    ap.add_argument("--out", default=None,
                    help="output path stem (writes STEM.json and STEM.md); default "
                         "benchmarks/results/flax_code/flax_code[_quick]")
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    for n in names:
        if n not in STEPS:
            raise ValueError(f"--models: unknown model {n!r}; allowed: {sorted(STEPS)}")
    targets = [t for t in args.target.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            raise ValueError(f"--target: unknown target {t!r}; allowed: {TARGETS}")
    variants = ("default", "exact") if args.quick else ("default", "exact", "fewbit3")
    repeats = args.repeats or (5 if args.quick else 7)
    cmd = ".venv/bin/python benchmarks/flax_code/bench_flax_code.py" + (
        " --quick" if args.quick else "") + (
        f" --models {args.models}" if names != list(STEPS) else "") + (
        " --skip-finetune" if args.skip_finetune else "") + (
        f" --repeats {args.repeats}" if args.repeats else "") + (
        f" --target {args.target}" if targets != ["h100", "cpu"] else "") + (
        f" --out {args.out}" if args.out else "")
    t0 = time.perf_counter()
    models = bench_models(names, variants, repeats, slopes=not args.quick, targets=targets)
    remat = remat_residuals() if "linen_lm_remat" in names else None
    ft = [] if args.skip_finetune else bench_finetune(
        ("head_only", "norm_only") if args.quick else tuple(FINETUNE), targets)
    res = {"command": cmd, "quick": args.quick, "targets": targets, "repeats": repeats, "environment": _env(),
           "batch_sizes": {n: BATCH.get(n) for n in names},
           "models": models, "finetune": ft, "remat_residuals": remat,
           "wall_seconds": round(time.perf_counter() - t0, 1)}
    stem = args.out or os.path.join(OUT, "flax_code_quick" if args.quick else "flax_code")
    if stem.endswith((".md", ".json")):
        stem = os.path.splitext(stem)[0]
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(res))
    print(f"wrote {stem}.json/.md in {res['wall_seconds']} s")


if __name__ == "__main__":
    main()
