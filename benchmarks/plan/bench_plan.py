"""jaxmem.plan at 50/25/10 % of the default step's compiled bytes, vs uniform JAX remat.

For each model: the untouched ``value_and_grad(loss)`` (default), the planned step, and the
uniform JAX policies a user writes: ``jax.checkpoint`` on every layer unit with
``nothing_saveable`` / ``dots_saveable``, and ``jax.checkpoint(loss,
policy=save_only_these_names(<unit boundaries>))``. Bytes are compiled bytes
(temp + output + argument - alias); times are ratios to the default, measured side by side
(median of interleaved runs).

    .venv/bin/python benchmarks/plan/bench_plan.py [--quick] [--models gpt,resnet50,vit,vgg16]
        [--out DIR] [--target h100] [--fractions 0.5,0.25]

``--target h100`` (or another GPU of :data:`jaxmem.measure.target.GPU_TARGETS`) plans and
measures every step on XLA:GPU's plan for that GPU, compiled here without one: bytes only, no
times (nothing runs), no autotuning (cuBLAS/cuDNN workspaces not counted: a lower bound).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import models
from jaxmem.measure import compiled_memory
from jaxmem.planner import BudgetError, conversion_time, plan
from jaxmem.planner import trace as T

OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "plan"
MIB = 2.0**20


def _token_loss(m):
    """The GPT cases' loss: mean negative log-probability of token 0 over all positions."""
    def loss(p, t):
        lg = m.apply({"params": p}, t)
        return -jnp.mean(jax.nn.log_softmax(lg)[..., 0])

    return loss


def gpt_case(quick, batch=None):
    m = models.gpt(n_layer=4, d_model=64, ctx=64)
    tok = jax.random.randint(jax.random.key(0), (batch or (16 if quick else 32), 64), 0, 256)
    params = m.init(jax.random.key(1), tok)["params"]
    return f"gpt (4x64, ctx 64, b{tok.shape[0]})", _token_loss(m), (params, tok)


def resnet_case(quick, batch=None):
    m = models.resnet50(width=0.125, num_classes=10, stem="cifar")
    x = jax.random.normal(jax.random.key(2), (batch or (4 if quick else 8), 32, 32, 3))
    v = m.init(jax.random.key(3), x, train=False)

    def loss(p, x):
        y, _ = m.apply({"params": p, "batch_stats": v["batch_stats"]}, x, train=True,
                       mutable=["batch_stats"])
        return jnp.mean(y ** 2)

    return f"resnet50 (w 0.125, 32x32, b{x.shape[0]})", loss, (v["params"], x)


def _xent(logits, labels):
    """Mean softmax cross-entropy: ``-mean_i log softmax(logits_i)[labels_i]``."""
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, labels[:, None], axis=1))


def vit_case(quick, batch=None):
    cfg = models.ViTConfig(image_size=32, patch_size=4, d_model=64, n_head=4, n_layer=4,
                           mlp_ratio=4, num_classes=10)
    m = models.ViT(cfg)
    n = batch or (8 if quick else 16)
    x = jax.random.normal(jax.random.key(4), (n, 32, 32, 3))
    y = jax.random.randint(jax.random.key(5), (n,), 0, 10)
    params = m.init(jax.random.key(6), x)["params"]

    def loss(p, x, y):
        return _xent(m.apply({"params": p}, x), y)

    return f"vit (4x64, patch 4, 32x32, b{n})", loss, (params, x, y)


def vgg_case(quick, batch=None):
    del quick, batch  # batch 1 at 512x512 in both modes
    m = models.vgg16(width=0.125, num_classes=10)
    x = jax.random.normal(jax.random.key(7), (1, 512, 512, 3))
    y = jax.random.randint(jax.random.key(8), (1,), 0, 10)
    params = m.init(jax.random.key(9), x)["params"]

    def loss(p, x, y):
        return _xent(m.apply({"params": p}, x), y)

    return "vgg16 (w 0.125, 512x512, b1)", loss, (params, x, y)


def gpt_wide_model(batch=None):
    """``(model, tokens, params)`` of GPT 4 x 128, ctx 128, vocab 2048, batch 8 by default."""
    m = models.gpt(n_layer=4, d_model=128, n_head=4, ctx=128, vocab=2048)
    tok = jax.random.randint(jax.random.key(0), (batch or 8, 128), 0, 2048)
    return m, tok, m.init(jax.random.key(1), tok)["params"]


def gpt_wide_case(quick, batch=None):
    """GPT 4 x 128, ctx 128, vocab 2048: wider than ``gpt`` (twice the FLOPs per residual
    byte of a block), with a vocabulary whose logits are the step's largest array."""
    del quick
    m, tok, params = gpt_wide_model(batch)
    return (f"gpt (4x128, ctx 128, vocab 2048, b{tok.shape[0]})", _token_loss(m),
            (params, tok))


def gpt_wide_chunked_case(quick, batch=None):
    """``gpt_wide`` with the same loss computed by
    :func:`jaxmem.losses.chunked_softmax_cross_entropy` (128-token chunks over the model's
    ``features=True`` output and its tied embedding): no ``tokens x vocab`` array."""
    from jaxmem.losses import chunked_softmax_cross_entropy

    del quick
    m, tok, params = gpt_wide_model(batch)

    def loss(p, t):   # _token_loss's loss: label 0 at every position
        h = m.apply({"params": p}, t, features=True)
        return jnp.mean(chunked_softmax_cross_entropy(
            h, p["wte"]["embedding"].T, jnp.zeros(t.shape, jnp.int32), chunk_size=128))

    return (f"gpt (4x128, ctx 128, vocab 2048, b{tok.shape[0]}, chunked head)", loss,
            (params, tok))


def gpt_wide_transformed_case(quick, batch=None):
    """``gpt_wide``'s whole-head loss as written, under ``jaxmem.transform`` with only its
    language-model head matched (``logits_chunk=128``; every other conversion off): the head
    chunked by what it computes, not by a rewritten loss."""
    import jaxmem

    name, loss, args = gpt_wide_case(quick, batch)
    from jaxmem.transform.options import SWITCHES

    off = dict.fromkeys(SWITCHES, False)
    return (name.replace(")", ", transform(logits_chunk=128))"),
            jaxmem.transform(loss, logits_chunk=128, **off), args)


def gpt_wide_head_case(quick, batch=None):
    """``gpt_wide``'s whole-head loss as written, planned with ``plan(...,
    logits_chunk=128)``: the planner itself may compute the head 128 rows at a time."""
    name, loss, args = gpt_wide_case(quick, batch)
    return name.replace(")", ", plan(logits_chunk=128))"), loss, args


def gpt_chunks_case(quick, batch=None):
    """``gpt``'s loss planned with ``plan(..., attention_chunk=16, mlp_chunk=256)``: under
    the scope its attentions and MLPs run their backward passes in row chunks."""
    name, loss, args = gpt_case(quick, batch)
    return name.replace(")", ", plan(attention_chunk=16, mlp_chunk=256))"), loss, args


def vit_chunks_case(quick, batch=None):
    """``vit``'s loss planned with ``plan(..., attention_chunk=16, mlp_chunk=256)``."""
    name, loss, args = vit_case(quick, batch)
    return name.replace(")", ", plan(attention_chunk=16, mlp_chunk=256))"), loss, args


CASES = {"gpt": gpt_case, "resnet50": resnet_case, "vit": vit_case, "vgg16": vgg_case}
#: cases run only when named in ``--models`` (a plan on the H100 plan takes tens of minutes)
EXTRA_CASES = {"gpt_wide": gpt_wide_case, "gpt_wide_chunked": gpt_wide_chunked_case,
               "gpt_wide_transformed": gpt_wide_transformed_case,
               "gpt_wide_head": gpt_wide_head_case, "gpt_chunks": gpt_chunks_case,
               "vit_chunks": vit_chunks_case}
#: ``plan`` keyword arguments of a case (others: ``plan``'s defaults)
_CHUNKS = {"attention_chunk": 16, "mlp_chunk": 256}
PLAN_KWARGS = {"gpt_wide_head": {"logits_chunk": 128}, "gpt_chunks": _CHUNKS,
               "vit_chunks": _CHUNKS}
ALL_CASES = {**CASES, **EXTRA_CASES}
#: models with smooth activations (GELU): also planned with ``allow_approximate=True``
APPROXIMATE = ("gpt", "vit")


def uniform_steps(loss, args):
    """The uniform policies a user writes: ``jax.checkpoint`` (``nn.remat``) on every block
    with one policy, and ``save_only_these_names`` of the block boundaries on the whole loss."""
    tr = T.trace(loss, args)
    units = T.choose_units(tr)
    names = [T.PREFIX + lbl for lbl in tr.ends]

    def per_block(policy):
        def f(*a):
            flat = jax.tree_util.tree_leaves(a)
            env = {v: c for v, c in zip(tr.closed.jaxpr.constvars, tr.closed.consts)}
            env.update(zip(tr.closed.jaxpr.invars, flat))
            for u in units:
                ins, outs = T.chunk_io(tr.closed.jaxpr, u.start, u.stop)
                g = jax.checkpoint(T.chunk_fn(tr.closed.jaxpr, u.start, u.stop, ins, outs),
                                   policy=policy, prevent_cse=True)
                env.update(zip(outs, g(*[env[v] for v in ins])))
            return env[tr.closed.jaxpr.outvars[0]]
        return f

    def boundary(*a):
        from jaxmem.planner.trace import _linen_tags
        pol = jax.checkpoint_policies.save_only_these_names(*names)
        with _linen_tags():
            return jax.checkpoint(loss, policy=pol)(*a)

    cp = jax.checkpoint_policies
    return {"nothing_saveable per block": per_block(cp.nothing_saveable),
            "dots_saveable per block": per_block(cp.dots_saveable),
            "save_only_these_names(inner layer outputs) per block":
                per_block(cp.save_only_these_names(*names)),
            "save_only_these_names(block outputs) on the loss": boundary}


def uniform_predicted_time(loss, args):
    """The planner's static time estimate (1 + recomputed FLOPs / (3 * step FLOPs), no fence:
    plain ``jax.checkpoint``) of the per-block uniform policies whose recomputation is known:
    ``nothing_saveable`` recomputes what each unit's residuals need (as the planner counts its
    ``recompute``), ``dots_saveable`` a unit's non-matmul FLOPs."""
    from jaxmem.planner.candidates import profile_units
    prof = profile_units(T.trace(loss, args))
    f3 = 3.0 * max(prof.total_flops, 1.0)
    return {"nothing_saveable per block": 1.0 + sum(r[0] for r in prof.recompute) / f3,
            "dots_saveable per block": 1.0 + sum(f[1] for f in prof.flops) / f3}


def total(fn, args, target="cpu"):
    return compiled_memory(jax.value_and_grad(fn), *args, target=target).total_bytes


def times(fns, args, reps):
    """Median seconds of each value-and-grad step in ``fns``, interleaved."""
    jitted = [jax.jit(f) for f in fns]
    for j in jitted:
        jax.block_until_ready(j(*args))
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, j in enumerate(jitted):
            t = time.perf_counter()
            jax.block_until_ready(j(*args))
            ts[i].append(time.perf_counter() - t)
    return [float(np.median(t)) for t in ts]


def run(quick, names=tuple(CASES), target="cpu", fractions=(0.5, 0.25, 0.1), batch=None):
    rows = []
    timed = target == "cpu"
    for key in names:
        t_case = time.perf_counter()
        name, loss, args = ALL_CASES[key](quick, batch)
        default = total(loss, args, target)
        uni = uniform_steps(loss, args)
        uni_bytes = {k: total(f, args, target) for k, f in uni.items()}
        uni_pred = uniform_predicted_time(loss, args)
        print(name, "default", default / MIB, {k: v / MIB for k, v in uni_bytes.items()},
              flush=True)
        runs = [(f, False) for f in fractions]
        if key in APPROXIMATE and timed:
            runs += [(f, True) for f in fractions if f < 0.5]
        for frac, approx in runs:
            budget = int(frac * default)
            row = {"model": name, "fraction": frac, "budget_bytes": budget,
                   "default_bytes": default, "allow_approximate": approx}
            t0 = time.perf_counter()
            try:
                p = plan(loss, *args, budget=frac, allow_approximate=approx, target=target,
                         **PLAN_KWARGS.get(key, {}))
            except BudgetError as e:
                row.update(met=False, smallest_bytes=e.smallest_bytes, error=str(e))
                p = None
            row["plan_seconds"] = time.perf_counter() - t0
            fitting = [k for k, b in uni_bytes.items() if b <= budget]
            row["uniform_fitting"] = {k: uni_bytes[k] for k in fitting}
            row["uniform_predicted_time"] = {k: uni_pred[k] for k in fitting if k in uni_pred}
            fns = [jax.value_and_grad(loss)] + ([p.value_and_grad()] if p else []) + [
                jax.value_and_grad(uni[k]) for k in fitting]
            ts = times(fns, args, 3 if quick else 5) if timed else None

            def ratio(i, ts=ts):
                return None if ts is None else ts[i] / ts[0]

            if p is not None:
                row.update(met=p.compiled_bytes <= budget, compiled_bytes=p.compiled_bytes,
                           predicted_bytes=p.predicted_bytes,
                           prediction_error=p.prediction_error, time_ratio=ratio(1),
                           predicted_time=p.predicted_time, solver=p.solver_status,
                           iterations=p.iterations,
                           gap=p.solver_gap, selective=p.selective,
                           logits_chunk=p.logits_chunk, residual_adds=p.residual_adds,
                           conversion_time=p.conversion_time,
                           traced_time=p.traced_time,
                           approximate=p.approximate, notes=list(p.notes),
                           choices={c.label: c.option + (f" {c.bits} bit" if c.bits else "")
                                    + (f" {c.rows}" if c.rows else "")
                                    + _stages_text(c)
                                    + (" nested" if getattr(c, "nested", False) else "")
                                    + _partial_text(c)
                                    for c in p.choices})
                if p.approximate:
                    g = jax.grad(p.step)(*args)
                    g0 = jax.grad(loss)(*args)
                    row["gradient_rel_error"] = max(
                        float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
                        for a, b in zip(jax.tree_util.tree_leaves(g),
                                        jax.tree_util.tree_leaves(g0)))
            off = 2 if p is not None else 1
            row["uniform_time_ratio"] = {k: ratio(off + i) for i, k in enumerate(fitting)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        rows.append({"model": name, "uniform_bytes": uni_bytes, "default_bytes": default,
                     "uniform_predicted_time": uni_pred})
        print(f"{name}: {time.perf_counter() - t_case:.0f} s", flush=True)
    return rows


def price_conversion(rows, meta):
    """Each met plan's ``conversion_time`` (:func:`jaxmem.planner.conversion_time` of its case
    under the plan's scope: what the conversion adds by itself, which no unit choice changes),
    set in ``rows`` in place; plans without a scope get 0. For rows written before plans
    reported it: nothing is planned again."""
    built, key_of = {}, {}
    for key in meta["models"]:
        name, loss, args = ALL_CASES[key](meta["quick"], meta.get("batch"))
        built[name] = (loss, args)
        key_of[name] = key
    for r in rows:
        if not r.get("met") or "fraction" not in r:
            continue
        loss, args = built[r["model"]]
        r["conversion_time"] = (conversion_time(
            loss, *args, residual_adds=r.get("residual_adds") is not False,
            logits_chunk=r.get("logits_chunk"),
            **{k: v for k, v in PLAN_KWARGS.get(key_of[r["model"]], {}).items()
               if k != "logits_chunk"}) if r.get("selective") else 0.0)
        print(r["model"], r["fraction"], f"conversion {r['conversion_time']:+.3f}", flush=True)


def _summary(choices, selective=False, notes=(), logits_chunk=None, residual_adds=None):
    """``store`` units omitted; the others as ``label: option``; ``scope`` first when the plan
    runs under ``jaxmem.scope()`` (selective differentiation; ``scope (block outputs kept)``
    with ``residual_adds=False``), then ``head in C-row chunks`` when it computes the loss's
    LM head in chunks."""
    if any(n.startswith("the OLLA order alone fits") for n in notes):
        return "untouched step in an OLLA order (nothing recomputed)"
    parts = [f"{k}: {v}" for k, v in choices.items() if v != "store"]
    text = "; ".join(parts) if parts else "all stored"
    if logits_chunk:
        text = f"head in {logits_chunk}-row chunks; {text}"
    scope = "scope (block outputs kept)" if residual_adds is False else "scope"
    return f"{scope}; {text}" if selective else text


def _fmt_time(x):
    return "–" if x is None else f"{x:.2f}x"   # None: not timed (a GPU target's plan)


def _fmt_predicted(r):
    """``(1.221x)``, or with a conversion priced ``(1.221x + 0.25 conv. = 1.47x)`` (three
    decimals: a goal such as 1.15x is judged on them)."""
    conv, traced = r.get("conversion_time"), r.get("traced_time")
    tail = f"; traced {traced:.2f}x" if traced is not None else ""
    if not r.get("selective") or conv is None:
        return f"({r['predicted_time']:.3f}x{tail})"
    return (f"({r['predicted_time']:.3f}x {'+' if conv >= 0 else '-'} {abs(conv):.2f} conv. "
            f"= {r['predicted_time'] + conv:.2f}x{tail})")


def markdown(rows, quick=False, names=tuple(CASES), target="cpu", fractions=(0.5, 0.25, 0.1),
             batch=None, out=None, updated=(), priced=False):
    pcts = "/".join(str(int(f * 100)) for f in fractions)
    head = (f"# jaxmem.plan: budgets of {pcts} % of the default compiled bytes"
            + ("" if target == "cpu" else f", on XLA:GPU's {target} plan"))
    gpu = [] if target == "cpu" else [
        (f"Every figure is XLA:GPU's plan for `{target}` (jax {jax.__version__}), compiled on a "
         "machine without a GPU: the plan is made and checked against it, nothing runs (no "
         "times), no autotuning (cuBLAS/cuDNN workspaces not counted: read bytes as a lower "
         "bound). Only exact options are asked for (no few-bit rows); `plan.notes` in plan.json "
         "say whether recomputed units run fenced on this target (plain `jax.checkpoint` "
         "unless that exceeds the budget and the fence compiles smaller). The uniform column "
         "gives its bytes and the planner's static time estimate (1 + recomputed FLOPs / (3 x "
         "step FLOPs), no fence) for `nothing_saveable` / `dots_saveable` per block."), ""]
    lines = [head, "", *gpu,
             ("Compiled bytes (temp + output + argument - alias) of `value_and_grad(loss)`; "
              "time = median step time / default's, measured side by side. Uniform = the "
              "cheapest uniform JAX remat policy whose compiled bytes fit the budget "
              "(none = no uniform policy fits)."), "",
             "Command: `.venv/bin/python benchmarks/plan/bench_plan.py"
             + (" --quick" if quick else "") + (f" --batch {batch}" if batch else "")
             + ("" if tuple(names) == tuple(CASES) else " --models " + ",".join(names))
             + ("" if target == "cpu" else f" --target {target}")
             + ("" if tuple(fractions) == (0.5, 0.25, 0.1)
                else " --fractions " + ",".join(map(str, fractions)))
             + (f" --out {out}" if out else "" if target == "cpu"
                else f" --out benchmarks/results/plan/{target}")
             + "`" + ("" if not updated else
                      "; then rerun with `--update` (their rows replaced, the others kept): "
                      + "; ".join(f"`{u}`" for u in updated))
             + ("" if not priced else
                "; `conv.` added with `--price-conversion` (nothing planned again)"), "",
             *([("Times were taken on a 2-core machine shared with other jobs: read them as "
                 "rough; a ratio below 1 is contention noise, not a speed-up."), ""]
               if target == "cpu" else []),
             ("| model | budget | met | compiled MiB (x default) | predicted err | time "
              "(predicted) | plan | best uniform per block that fits (time) |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "fraction" not in r:
            continue
        uni = r.get("uniform_time_ratio", {})
        best = min(uni.items(), key=lambda kv: (kv[1] is None, kv[1] or 0.0)) if uni else None
        ustr = f"{best[0]} ({_fmt_time(best[1])})" if best else "none"
        upred = r.get("uniform_predicted_time", {})
        if best and target != "cpu" and upred:   # no times: the least predicted one
            k = min(upred, key=upred.get)
            ustr = f"{k} {r['uniform_fitting'][k] / MIB:.2f} MiB (predicted {upred[k]:.2f}x)"
        pct = f"{int(r['fraction'] * 100)} %" + (" approx." if r.get("allow_approximate")
                                                  else "")
        if r.get("met"):
            err = (f"; gradient error {r['gradient_rel_error']:.1e}"
                   if "gradient_rel_error" in r else "")
            plan_text = _summary(r['choices'], r.get('selective', False), r.get('notes', ()),
                                 r.get('logits_chunk'), r.get('residual_adds'))
            lines.append(
                f"| {r['model']} | {pct} | yes | "
                f"{r['compiled_bytes'] / MIB:.2f} ({r['compiled_bytes'] / r['default_bytes']:.2f}x)"
                f" | {r['prediction_error'] * 100:+.1f} % | {_fmt_time(r['time_ratio'])} "
                f"{_fmt_predicted(r)} | "
                f"{plan_text}"
                f"{err} | {ustr} |")
        else:
            lines.append(
                f"| {r['model']} | {pct} | no (smallest "
                f"{r['smallest_bytes'] / MIB:.2f} MiB, "
                f"{r['smallest_bytes'] / r['default_bytes']:.2f}x) | - | - | - | - | {ustr} |")
    lines += ["", ("`smallest` of an unmet budget is the least compiled total of a plan the "
                   "search compiled (a budget `plan` then meets), not the arguments + outputs "
                   "lower bound. `time (predicted)`: measured ratio, and the planner's static "
                   "estimate (recomputed FLOPs + `fence_cost` 0.1 of a step per fenced "
                   "checkpointed item); `conv.` = the FLOPs the scope's conversion runs by "
                   "itself (recomputations inside converted layers' backward passes, mask "
                   "packing: `jaxmem.planner.conversion_time`, a fraction of a step), which "
                   "the plan's own estimate leaves out; `traced` = the FLOPs of the planned step's "
                   "`value_and_grad` jaxpr over the untouched step's (`MemoryPlan.traced_time`: "
                   "everything it runs, each recomputation counted once; rows planned before it "
                   "was reported have none). `plan` lists the units not stored; `a..b: segment` recomputes units "
                   "a to b as one chunk, `segment nested` also checkpoints its units again inside "
                   "that chunk (for one unit: its children; nested, two-level recomputation); "
                   "`partial (c, d recomputed)` = the unit's children c and d recomputed (each "
                   "run of neighbours as one chunk), its other children stored (GPU targets); "
                   "`scope` = run under `jaxmem.scope()` (selective "
                   "differentiation), which the planner picks when it compiles smaller; "
                   "`scope (block outputs kept)` = the same with `residual_adds=False` (ResNet "
                   "block outputs kept, not recomputed from the add's inputs), planned when "
                   "the default scope is refused; "
                   "`fewbit b bit` = the unit stored with b-bit GELU codes (rows marked "
                   "`approx.`, `allow_approximate=True`; gradient error = largest relative "
                   "L2 error of a gradient leaf vs the exact step); `rows r` = the VGG trunk "
                   "row-tiled into r tiles (exact), `rows r (first s pooling stages)` = only its first "
                   "s pooling stages row-tiled (their units), the rest its own units; `(step): store` with an OLLA note = the "
                   "untouched step in an OLLA order.")]
    lines += ["", ("Uniform JAX policies (plain `jax.checkpoint` on every block, as `nn.remat` "
                   "would), compiled MiB (default in brackets):"), ""]
    for r in rows:
        if "uniform_bytes" in r:
            pred = r.get("uniform_predicted_time", {})
            lines.append(f"- {r['model']} [{r['default_bytes'] / MIB:.2f}]: " + ", ".join(
                f"{k} {v / MIB:.2f}" + (f" (predicted {pred[k]:.2f}x)" if k in pred else "")
                for k, v in r["uniform_bytes"].items()))
    return "\n".join(lines) + "\n"


def _models_arg(text):
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in ALL_CASES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"--models must be a comma-separated subset of {','.join(ALL_CASES)}, got {text!r}")
    return tuple(dict.fromkeys(names))


def _target_arg(text):
    from jaxmem.measure.target import check_target
    try:
        return check_target(text, 1, "--target")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fractions_arg(text):
    from jaxmem.planner.api import budget_spec
    out = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        try:
            kind, v = budget_spec(t, "--fractions")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if kind != "fraction":
            raise argparse.ArgumentTypeError(f"--fractions: {t!r} is not a fraction in (0, 1]")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("--fractions is empty")
    return tuple(out)


def _partial_text(choice):
    """`` (ln_1, ln_2, mlp recomputed)`` of a ``partial`` choice (its recomputed children,
    named within the unit), else empty."""
    if not choice.recomputed:
        return ""
    names = [r[len(choice.label) + 1:] if r.startswith(choice.label + "/") else r
             for r in choice.recomputed]
    return f" ({', '.join(names)} recomputed)"


def _stages_text(choice):
    """`` (first pooling stage)`` / `` (first s pooling stages)`` of a ``rows`` choice over a
    trunk's first stages, else empty."""
    if choice.stages is None:
        return ""
    return f" ({choice.as_option.tiled_stages})"


def _row_key(row):
    """A row's identity: (model, budget fraction, approximate); a model's summary row (its
    uniform policies) has no fraction."""
    return row["model"], row.get("fraction"), row.get("allow_approximate")


def _merged(old_rows, new_rows):
    """``old_rows`` with each row that ``new_rows`` reruns (same :func:`_row_key`) replaced
    in place; the model's other rows are kept, new ones go after the model's last row."""
    new = {_row_key(r): r for r in new_rows}
    out = [new.pop(_row_key(r), r) for r in old_rows]
    for key, row in new.items():
        last = max((i for i, r in enumerate(out) if r["model"] == key[0]), default=None)
        if last is None:
            out.append(row)
        else:
            out.insert(last + (0 if "fraction" not in out[last] else 1), row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", type=_models_arg, default=tuple(CASES),
                    help=f"comma-separated subset of {','.join(ALL_CASES)} (default: "
                         f"{','.join(CASES)})")
    ap.add_argument("--out", type=pathlib.Path, default=OUT,
                    help="folder for plan.json and plan.md (default: benchmarks/results/plan)")
    ap.add_argument("--target", type=_target_arg, default="cpu",
                    help="plan and measure on this target's compiled bytes (cpu or a GPU: "
                         "XLA:GPU's plan, compiled here without one; no times)")
    ap.add_argument("--fractions", type=_fractions_arg, default=(0.5, 0.25, 0.1),
                    help="comma-separated budget fractions in (0, 1] (default 0.5,0.25,0.1)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch of the gpt / resnet50 / vit cases (default: the mode's)")
    ap.add_argument("--update", action="store_true",
                    help="replace only these models' rows in the plan.json already at --out "
                         "(same settings; the other models' rows kept) and rewrite plan.md")
    ap.add_argument("--price-conversion", action="store_true",
                    help="only add conversion_time to the met plans of the plan.json already "
                         "at --out (no plan is made again: no unit choice changes it) and "
                         "rewrite plan.md")
    a = ap.parse_args()
    if a.price_conversion:
        old = json.loads((a.out / "plan.json").read_text())
        meta, rows = old["meta"], old["rows"]
        price_conversion(rows, meta)
        meta["priced"] = True
        names = tuple(m for m in ALL_CASES if m in meta["models"])
        updated, fractions = meta.get("updated", ()), meta["fractions"]
        a.quick, a.target, a.batch = meta["quick"], meta["target"], meta.get("batch")
        _write(a, meta, rows, names, updated, fractions)
        return
    rows = run(a.quick, a.models, a.target, a.fractions, a.batch)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "quick": a.quick,
            "models": list(a.models), "target": a.target, "fractions": list(a.fractions),
            "batch": a.batch}
    names, updated, fractions = a.models, (), a.fractions
    if a.update:
        old = json.loads((a.out / "plan.json").read_text())
        rows = _merged(old["rows"], rows)
        names = tuple(m for m in ALL_CASES if m in old["meta"]["models"] or m in a.models)
        fractions = tuple(old["meta"]["fractions"])
        rerun = f"--models {','.join(a.models)}" + (
            "" if a.fractions == fractions else f" --fractions {','.join(map(str, a.fractions))}")
        updated = (*[u for u in old["meta"].get("updated", ()) if u != rerun], rerun)
        meta.update(models=list(names), updated=list(updated), fractions=list(fractions))
        # rows kept from a priced file keep their conversion_time; new rows carry their own
        meta["priced"] = old["meta"].get("priced", False)
    _write(a, meta, rows, names, updated, fractions)


def _write(a, meta, rows, names, updated, fractions):
    try:
        out = a.out.resolve().relative_to(OUT.parents[2])
    except ValueError:
        out = a.out
    md = markdown(rows, a.quick, names, a.target, fractions, a.batch,
                  None if a.out.resolve() == OUT else out, updated, meta.get("priced", False))
    (a.out / "plan.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (a.out / "plan.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
