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
#: a transform figure "keeps" the conversion's ratio when within this fraction of it
KEEP = 0.01


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


def verdicts(rows, targets) -> list[dict]:
    """Per model, target and measure: does the transform keep (within ``KEEP``) or improve
    the conversion's ratio (exact vs exact, fewbit vs fewbit)?"""
    out = []
    for r in rows:
        for t in targets:
            for mine, theirs in (("transform", "convert"),
                                 ("transform_fewbit3", "convert_fewbit3")):
                for k in ("total", "temp"):
                    a, b = r["ratio"][t][mine][k], r["ratio"][t][theirs][k]
                    out.append({"model": r["model"], "target": t, "variant": mine,
                                "measure": k, "transform": a, "convert": b,
                                "verdict": "improves" if a < b - KEEP * b else
                                "keeps" if a <= b + KEEP * b else "regresses"})
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
             "(what `benchmarks/flax_code` measures), `transform` = `jaxmem.transform` of the "
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
    lines += ["## Keep or improve the conversion's ratio?", "",
              (f"`keeps`: within {KEEP:.0%} of `convert`'s ratio (exact vs exact, fewbit3 vs "
               "fewbit3); `improves`: lower by more; `regresses`: higher by more."), "",
              ("| model | plan | variant | total: transform vs convert | temp: transform vs "
               "convert |"), "|---|---|---|---|---|"]
    by = {(v["model"], v["target"], v["variant"], v["measure"]): v for v in verdict}
    for r in rows:
        for t in targets:
            for mine in ("transform", "transform_fewbit3"):
                cells = [r["model"], t, mine]
                for k in ("total", "temp"):
                    v = by[(r["model"], t, mine, k)]
                    cells.append(f"{v['transform']:.2f}x vs {v['convert']:.2f}x "
                                 f"**{v['verdict']}**")
                lines.append("| " + " | ".join(cells) + " |")
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
