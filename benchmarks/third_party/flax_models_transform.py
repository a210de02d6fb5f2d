"""Flax code as users write it under ``jaxmem.transform``: XLA's plan of the full train step.

For every model of ``jaxmem.bench.flax_models.STEPS`` (Linen ResNet, Linen causal LM
unrolled and under ``nn.scan(nn.remat(...))``, NNX CNN, NNX ViT, NNX scanned stack) the
jitted FULL train step (forward, backward, optax update) is compiled five ways:

* ``default``            -- the untouched model (``Case.pure_step``);
* ``convert``            -- ``jaxmem.linen.convert(model)`` / ``jaxmem.nnx.convert(module)``
  (exact; the path ``benchmarks/flax_code/bench_flax_code.py`` measures);
* ``convert_fewbit3``    -- the same with ``fewbit=3``;
* ``transform``          -- the untouched model, its training loss wrapped in
  ``jaxmem.transform`` (exact);
* ``transform_fewbit3``  -- ``jaxmem.transform(loss, fewbit=3)``.

The transformed step differentiates ``jaxmem.transform(loss)`` where the model's own step
differentiates ``loss``: Linen, ``loss(params, state, batch, rng, train)`` of the case;
NNX, a pure ``loss(params, rest, batch)`` that merges the module inside (the non-parameter
state it updates -- batch statistics, RNG counts -- is returned and written back), with
``jax.value_and_grad`` in place of ``nnx.value_and_grad``.  ``rewrite`` is that step with
the identity in place of ``jaxmem.transform``: it must compile to ``default``'s bytes (the
rewrite itself changes nothing), and is checked.

Compiled bytes (``jaxmem.measure.compiled_memory``): ``temp`` (what activations and the
backward's working set cost) and ``total = temp + output + argument - alias`` (what
``bench_flax_code.py`` reports), for XLA:CPU and for XLA:GPU's H100 plan compiled here
without a GPU (``target="h100"``; no autotuning).  The exact transform's loss and
gradients are checked against the untouched model's (``Case.loss_of_params``, train mode,
same dropout key) before anything is measured.

"Keep or improve": each transform ratio (total bytes, exact and ``fewbit3``, per plan) is
compared with the ratio the same model had *before* ``jaxmem.transform`` existed -- the
name-based conversion of ``benchmarks/flax_code``, as committed in
``benchmarks/results/flax_code/`` (:data:`PRE_TRANSFORM`, bytes copied from those JSON
files, same batch sizes).  ``convert`` is ``jaxmem.transform`` lifted over the model's
variables, so ``convert`` vs ``transform`` is only a sanity column (the two wrappings of
the same transformation must agree).

Run (about 5 minutes on 2 shared cores):

    .venv/bin/python benchmarks/third_party/flax_models_transform.py [--models a,b]
        [--targets cpu,h100] [--out benchmarks/results/third_party] [--update]

Writes ``flax_models.json`` and ``flax_models.md`` in ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import sys
import time

import flax
import jax
import numpy as np
import optax
from flax import nnx

import jaxmem
from jaxmem.bench import flax_models as FM
from jaxmem.measure import compiled_memory

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "third_party")
MIB = 2.0**20
#: the batch sizes of ``benchmarks/flax_code/bench_flax_code.py`` (activations dominate)
BATCH = {"linen_resnet": 32, "linen_lm": 32, "linen_lm_scan": 32, "nnx_cnn": 128,
         "nnx_vit": 32, "nnx_scan": 512}
VARIANTS = ("default", "convert", "convert_fewbit3", "transform", "transform_fewbit3")
#: a transform ratio "keeps" a reference ratio when within this fraction of it (relative:
#: ``|transform / reference - 1| <= KEEP``); lower by more "improves", higher "regresses"
KEEP = 0.01

#: The figures before ``jaxmem.transform`` existed: the name-based conversion
#: (``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` patching Flax modules and functions by
#: name) measured by ``benchmarks/flax_code/bench_flax_code.py`` with the batch sizes of
#: ``BATCH``.  Compiled total bytes of the full train step, ``(converted, default)`` per
#: ``(plan, variant)``; the reference ratio is their quotient.  Sources (committed JSON):
#: H100 plan and CPU, exact -- ``benchmarks/results/flax_code/flax_code_quick.json``
#: (2026-11-24 23:08 UTC: linen_resnet, nnx_cnn, linen_lm, nnx_vit) and
#: ``flax_code_quick_scan.json`` (2026-11-24 23:32 UTC: linen_lm_scan, nnx_scan); CPU,
#: fewbit3 -- ``benchmarks/results/flax_code/flax_code.json`` (2026-11-24 04:54 UTC, the
#: full run).  No H100-plan few-bit figure was measured then (the quick runs skip few-bit):
#: those rows have no reference.
PRE_TRANSFORM_SOURCES = {
    ("h100", "exact"): "flax_code_quick{,_scan}.json, 2026-11-24",
    ("cpu", "exact"): "flax_code_quick{,_scan}.json, 2026-11-24",
    ("cpu", "fewbit3"): "flax_code.json, 2026-11-24",
}
PRE_TRANSFORM = {
    ("h100", "exact"): {
        "linen_resnet": (1500156, 1998580), "nnx_cnn": (3532780, 6182636),
        "linen_lm": (3305716, 4038388), "nnx_vit": (7553724, 8380604),
        "linen_lm_scan": (2134300, 2523676), "nnx_scan": (1225716, 2958644)},
    ("cpu", "exact"): {
        "linen_resnet": (1952844, 3613940), "nnx_cnn": (4694404, 13083652),
        "linen_lm": (4162564, 5612420), "nnx_vit": (4508148, 5936692),
        "linen_lm_scan": (2973108, 3634324), "nnx_scan": (1240132, 3205596)},
    ("cpu", "fewbit3"): {
        "linen_resnet": (1952844, 3613940), "nnx_cnn": (4694404, 13083652),
        "linen_lm": (3163140, 5612420), "nnx_vit": (3515892, 5936692),
        "linen_lm_scan": (2448900, 3634324), "nnx_scan": (1002772, 3205596)},
}


def reference(model: str, target: str, variant: str) -> dict | None:
    """The pre-transform figure of ``model`` on ``target`` for ``variant``
    (``"transform"`` -> exact, ``"transform_fewbit3"`` -> fewbit3), or ``None``."""
    key = (target, "fewbit3" if variant.endswith("fewbit3") else "exact")
    entry = PRE_TRANSFORM.get(key, {}).get(model)
    if entry is None:
        return None
    total, default = entry
    return {"ratio": total / default, "total": total, "default": default,
            "source": PRE_TRANSFORM_SOURCES[key]}


def _identity(f):
    return f


# ------------------------------------------------------------------ the train steps
def _linen_step(case, wrap):
    """The case's Linen train step with ``wrap(loss_fn)`` differentiated."""
    loss_fn, tx = wrap(case.loss_fn), case.tx

    def train_step(state, batch, rng):
        (loss, (_, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state, batch, rng, True)
        upd, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = dict(state, params=optax.apply_updates(state["params"], upd),
                   opt_state=opt_state)
        if updates is not None:
            new.update(updates)
        return new, loss

    return train_step


def _nnx_loss(case, gd):
    def loss(params, rest, batch):
        # fresh Variables for the state the model mutates (batch statistics, RNG counts)
        m = nnx.merge(gd, params, jax.tree.map(lambda a: a, rest))
        value, logits = case.loss_fn(m, batch)
        return value, (logits, nnx.state(m, nnx.Not(nnx.Param)))
    return loss


def _nnx_step(case, wrap):
    """The case's NNX train step (``Case.pure_step``) with a pure loss of the parameters,
    ``wrap(loss)`` differentiated by ``jax.value_and_grad``."""
    graphdef = case.graphdef

    def pure(state, *batch):
        model, optimizer = nnx.merge(graphdef, state)
        model.train()
        gd, params, rest = nnx.split(model, nnx.Param, ...)
        (value, (_, new_rest)), grads = jax.value_and_grad(
            wrap(_nnx_loss(case, gd)), has_aux=True)(params, rest, batch)
        nnx.update(model, new_rest)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value

    return pure


def _step(case, wrap):
    return (_linen_step if case.api == "linen" else _nnx_step)(case, wrap)


def _transformer(fewbit):
    return lambda f: jaxmem.transform(f, fewbit=fewbit)


def _build(name, variant):
    """``(step, args)`` of one variant (a fresh case per call: NNX steps mutate)."""
    if variant.startswith("convert"):
        mod = jaxmem.nnx if name.startswith("nnx") else jaxmem.linen
        fb = 3 if variant.endswith("fewbit3") else None
        case = FM.STEPS[name](convert=lambda m: mod.convert(m, fewbit=fb),
                              batch_size=BATCH[name])
        return case.pure_step, case.pure_args
    case = FM.STEPS[name](batch_size=BATCH[name])
    if variant == "default":
        return case.pure_step, case.pure_args
    wrap = {"rewrite": _identity, "transform": _transformer(None),
            "transform_fewbit3": _transformer(3)}[variant]
    return _step(case, wrap), case.pure_args


# ------------------------------------------------------------------ checks and report
def _check_exact(name) -> float:
    """Largest difference of the loss (relative) and of every gradient leaf (relative to the
    largest gradient entry), transform vs the untouched model (train mode, same dropout
    key)."""
    case = FM.STEPS[name](batch_size=BATCH[name])
    f, params = case.loss_of_params(train=True)
    g = jaxmem.transform(f)
    ref = jax.jit(jax.value_and_grad(lambda p: f(p)[0]))(params)
    got = jax.jit(jax.value_and_grad(lambda p: g(p)[0]))(params)
    # relative to the largest gradient (a mathematically zero leaf -- a conv bias before
    # a batch norm -- holds rounding only)
    scale = max(float(np.max(np.abs(np.asarray(b, np.float64))))
                for b in jax.tree_util.tree_leaves(ref[1]))
    worst = abs(float(got[0]) - float(ref[0])) / max(abs(float(ref[0])), 1e-30)
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(ref[1])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return worst


def _report(name, fewbit) -> dict:
    """Rows of ``jaxmem.transform``'s report on the training loss: converted / left per
    kind, and the reasons of what is left."""
    case = FM.STEPS[name](batch_size=BATCH[name])
    if case.api == "linen":
        def loss(params, state, batch, rng):  # ``train=True`` bound, not an argument
            return case.loss_fn(params, state, batch, rng, True)

        rep = jaxmem.transform(loss, fewbit=fewbit).report(
            case.state["params"], case.state, case.batch, case.rng)
    else:
        case.model.train()
        gd, params, rest = nnx.split(case.model, nnx.Param, ...)
        rep = jaxmem.transform(_nnx_loss(case, gd), fewbit=fewbit).report(
            params, rest, case.batch)
    count = collections.Counter((r.kind, r.converted) for r in rep)
    left = collections.Counter(f"{r.kind}: {r.reason}" for r in rep.unconverted()
                               if r.kind != "higher-order" or "derivative rule" not in r.reason)
    return {"converted": {k: n for (k, c), n in sorted(count.items()) if c},
            "left": {k: n for (k, c), n in sorted(count.items()) if not c},
            "left_reasons": dict(left.most_common())}


def _bytes(step, args, target) -> dict:
    c = compiled_memory(step, *args, target=target)
    return {"temp": c.temp_bytes, "total": c.total_bytes, "argument": c.argument_bytes,
            "output": c.output_bytes, "alias": c.alias_bytes}


def measure(names, targets) -> list[dict]:
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = {"model": name, "batch": BATCH[name], "bytes": {}, "ratio": {}}
        row["exact_max_rel_diff"] = _check_exact(name)
        row["report"] = {"exact": _report(name, None), "fewbit3": _report(name, 3)}
        for t in targets:
            b = {v: _bytes(*_build(name, v), t) for v in VARIANTS + ("rewrite",)}
            row["bytes"][t] = b
            row["ratio"][t] = {v: {k: b[v][k] / b["default"][k] for k in ("temp", "total")}
                               for v in VARIANTS}
            row.setdefault("rewrite_equal", {})[t] = (
                b["rewrite"]["total"] == b["default"]["total"])
        row["seconds"] = time.perf_counter() - t0
        print(f"{name}: {row['seconds']:.0f} s  " + "  ".join(
            f"{t} " + " ".join(f"{v}={row['ratio'][t][v]['total']:.2f}" for v in VARIANTS[1:])
            for t in targets), flush=True)
        rows.append(row)
    return rows


def _verdict(a: float, b: float) -> str:
    return ("improves" if a < b * (1 - KEEP) else "keeps" if a <= b * (1 + KEEP)
            else "regresses")


def verdicts(rows, targets) -> list[dict]:
    """Per model, plan and transform variant: does the transform's total-bytes ratio keep
    (within ``KEEP``, relative) or improve the pre-transform ratio (:data:`PRE_TRANSFORM`)?
    ``convert`` (the same transformation lifted over the model's variables) is carried as a
    sanity check: it must agree with ``transform`` (``convert_agrees``, within ``KEEP``)."""
    out = []
    for r in rows:
        for t in targets:
            for mine, conv in (("transform", "convert"),
                               ("transform_fewbit3", "convert_fewbit3")):
                a, c = r["ratio"][t][mine]["total"], r["ratio"][t][conv]["total"]
                ref = reference(r["model"], t, mine)
                row = {"model": r["model"], "target": t, "variant": mine, "measure": "total",
                       "transform": a, "convert": c,
                       "convert_agrees": abs(a - c) <= KEEP * c,
                       "reference": None, "reference_source": None,
                       "reference_default_equal": None, "verdict": "no reference"}
                if ref is not None:
                    row.update(reference=ref["ratio"], reference_source=ref["source"],
                               reference_default_equal=(
                                   ref["default"] == r["bytes"][t]["default"]["total"]),
                               verdict=_verdict(a, ref["ratio"]))
                out.append(row)
    return out


def _env() -> dict:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def markdown(rows, verdict, targets, env) -> str:
    lines = ["# Flax models (`jaxmem.bench.flax_models`) under `jaxmem.transform`", "",
             ("Regenerate with `.venv/bin/python benchmarks/third_party/"
              "flax_models_transform.py`."), "",
             f"jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, {env['date']}. "
             "Full jitted train step (gradient and optax update), compiled bytes of XLA's "
             "plan: `total` = temp + output + argument - alias, `temp` = temporaries; ratios "
             "to `default`. `convert` = `jaxmem.linen.convert` / `jaxmem.nnx.convert` "
             "(`jaxmem.transform` lifted over the model's variables; what "
             "`benchmarks/flax_code` measures), `transform` = `jaxmem.transform` of the "
             "untouched model's loss. Batch sizes as `benchmarks/flax_code`: " +
             ", ".join(f"{r['model']} {r['batch']}" for r in rows) + "."
             + (f" Rows re-measured on {env['date']} with `--update`: "
                f"{', '.join(env['updated'])}; the others from the preceding full run."
                if env.get("updated") else ""), ""]
    for t in targets:
        lines += [f"## {t} plan" if t != "cpu" else "## XLA:CPU", "",
                  ("| model | default total MiB | convert | transform | convert fewbit3 | "
                   "transform fewbit3 | default temp MiB | convert | transform | "
                   "convert fewbit3 | transform fewbit3 |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            b, q = r["bytes"][t], r["ratio"][t]
            cells = [r["model"], f"{b['default']['total'] / MIB:.2f}"]
            for k in ("total", "temp"):
                if k == "temp":
                    cells.append(f"{b['default']['temp'] / MIB:.2f}")
                for v in ("convert", "transform", "convert_fewbit3", "transform_fewbit3"):
                    cells.append(f"{b[v][k] / MIB:.2f} ({q[v][k]:.2f}x)")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Keep or improve the pre-transform ratio?", "",
              ("Reference: the ratio (total bytes / `default`, same plan) of the name-based "
               "conversion that preceded `jaxmem.transform`, committed in "
               "`benchmarks/results/flax_code/` (H100 plan and CPU exact: "
               "`flax_code_quick.json` / `flax_code_quick_scan.json`; CPU fewbit3: "
               "`flax_code.json`; all 2026-11-24; no H100-plan few-bit figure was measured "
               "then). "
               f"`keeps`: within {KEEP:.0%} of the reference ratio (relative: transform <= "
               f"reference x {1 + KEEP:g}); `improves`: lower by more; `regresses`: higher "
               "by more. Ratios to 4 decimals. Sanity: `convert` (the same transformation "
               "lifted over the model's variables) agrees with `transform` within "
               f"{KEEP:.0%}."), "",
              ("| model | plan | variant | transform | pre-transform reference | verdict | "
               "convert (sanity) |"), "|---|---|---|---|---|---|---|"]
    by = {(v["model"], v["target"], v["variant"]): v for v in verdict}
    for r in rows:
        for t in targets:
            for mine in ("transform", "transform_fewbit3"):
                v = by[(r["model"], t, mine)]
                ref = "-" if v["reference"] is None else f"{v['reference']:.4f}x"
                if v["reference"] is not None and not v["reference_default_equal"]:
                    ref += " (default step differs)"
                sanity = f"{v['convert']:.4f}x " + ("agrees" if v["convert_agrees"]
                                                     else "**differs**")
                lines.append(f"| {r['model']} | {t} | {mine} | {v['transform']:.4f}x | {ref} "
                             f"| **{v['verdict']}** | {sanity} |")
    lines += ["", "## What the transform converts (training loss, exact)", "",
              "| model | exact: loss / gradient max rel. diff | converted | left (reasons) |",
              "|---|---|---|---|"]
    for r in rows:
        rep = r["report"]["exact"]
        conv = ", ".join(f"{k} {n}" for k, n in rep["converted"].items())
        left = "; ".join(f"{k} ({n})" for k, n in rep["left_reasons"].items()) or "-"
        lines.append(f"| {r['model']} | {r['exact_max_rel_diff']:.1e} | {conv} | {left} |")
    bad = [f"{r['model']} ({t})" for r in rows for t in targets if not r["rewrite_equal"][t]]
    lines += ["", "The step rewritten around a pure loss (identity in place of the transform) "
              "compiles to the default step's total bytes for every model and plan"
              + ("." if not bad else f" except: {', '.join(bad)}."), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(FM.STEPS))
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--update", action="store_true",
                    help="re-measure --models only, keeping the other rows of --out's JSON")
    a = ap.parse_args(argv)
    names = [m for m in a.models.split(",") if m]
    targets = [t for t in a.targets.split(",") if t]
    unknown = [m for m in names if m not in FM.STEPS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {list(FM.STEPS)}")
    env = _env()
    t0 = time.perf_counter()
    rows = measure(names, targets)
    path = os.path.join(a.out, "flax_models.json")
    if a.update and os.path.exists(path):
        with open(path) as fh:
            old = {r["model"]: r for r in json.load(fh)["models"]}
        old.update({r["model"]: r for r in rows})
        rows = [old[m] for m in FM.STEPS if m in old]
        env["updated"] = names
    verdict = verdicts(rows, targets)
    env["wall_seconds"] = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"env": env, "targets": targets, "variants": VARIANTS, "models": rows,
                   "verdicts": verdict}, fh, indent=1)
    with open(os.path.join(a.out, "flax_models.md"), "w") as fh:
        fh.write(markdown(rows, verdict, targets, env))
    print(f"wrote {a.out}/flax_models.{{json,md}} in {env['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
