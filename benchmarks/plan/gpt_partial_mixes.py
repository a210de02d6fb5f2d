"""Which GPT blocks can run ``partial`` within 25 % of the default, on a target's plan.

The bench's GPT 4x64 (ctx 64, batch 16) under ``jaxmem.scope()``, planned as the planner
plans it at 25 %: the embeddings joined to the first block's segment, the final norm and
the head's product (``ln_f..wte.attend``) one segment, the loss after them stored, and each
block either recomputed whole or ``partial`` (its
attention stored, its layer norms and MLP recomputed: the planner's first ``partial``
candidate). Every mix of the four blocks is compiled for ``--target``; predicted time is the
planner's own (1 + the items' recomputed FLOPs / 3 x the step's forward FLOPs, as
``MemoryPlan.predicted_time``), the conversion's own FLOPs (``conversion_time``) not added.
Where no plan within the budget meets ``--goal``, the smallest plan that would (refused by
the budget) is read with ``jaxmem.measure.live_peak``, its attention
whole and in ``--attention-chunk`` query rows (``linen.convert``'s ``attention_chunk``).

    .venv/bin/python benchmarks/plan/gpt_partial_mixes.py --target h100

writes ``benchmarks/results/plan/<target>/gpt_partial_mixes.md``.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_plan

from jaxmem._glue.options import Options
from jaxmem.linen import scope_options
from jaxmem.measure import live_peak
from jaxmem.planner import api
from jaxmem.planner import candidates as C
from jaxmem.planner import trace as T
from jaxmem.planner.budget import parse_budget
from jaxmem.planner.options import partial_children
from jaxmem.planner.steps import compiled_total, make_step

OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "plan"
MIB = 2.0**20
BLOCKS = ("h_0", "h_1", "h_2", "h_3")


def _runs(mix, partial):
    """The plan's runs: each block recomputed whole or (``mix``) its first ``partial``
    candidate; the embeddings joined to the first block or stored; the head one segment."""
    runs = []
    if mix[0]:
        runs += [(("wte",), "store"), (("wpe",), "store"),
                 (("h_0",), str(partial["h_0"].option))]
    else:
        runs.append((("wte", "wpe", "h_0"), "segment"))
    runs += [((b,), str(partial[b].option) if p else "recompute")
             for b, p in zip(BLOCKS[1:], mix[1:])]
    return runs + [(("ln_f", "wte.attend"), "segment"), (("(rest)",), "store")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--goal", type=float, default=1.15,
                    help="predicted-time goal: the smallest refused plan within it is read")
    ap.add_argument("--attention-chunk", type=int, default=16,
                    help="query rows per chunk for the peak reading of that plan")
    a = ap.parse_args(argv)
    t0 = time.time()
    _, loss, args = bench_plan.gpt_case(True)
    default = compiled_total(jax.value_and_grad(loss), args, a.target)
    budget = parse_budget(a.fraction, default)
    tr = T.trace(loss, args, api._glue_scope())
    prof = C.profile_units(tr)
    cands = C.exact_candidates(prof, 0.0) + C.partial_candidates(prof, 0.0)
    labels = prof.labels
    by_key = {(tuple(labels[u] for u in c.cover), str(c.option)): c for c in cands}
    partial = {}
    for c in cands:   # the first partial candidate of each block: fewest children stored
        if c.option.kind == "partial":
            partial.setdefault(labels[c.cover[0]], c)
    step_flops = 3.0 * prof.total_flops
    rows = []
    for mix in itertools.product((False, True), repeat=len(BLOCKS)):
        runs = _runs(mix, partial)
        cost = sum(by_key[(lbls, opt)].cost for lbls, opt in runs if opt != "store")
        step = make_step(loss, api._glue_scope, prof.cut_labels, runs, {}, fence=False)
        b = compiled_total(jax.value_and_grad(step), args, a.target)
        rows.append((mix, b, 1.0 + cost / step_flops))
        print(mix, f"{b / MIB:.2f} MiB", f"{1.0 + cost / step_flops:.3f}", flush=True)
    p = partial["h_1"]
    kept = [k.split("/")[-1] for k, s in zip(p.children, partial_children(p.option.param))
            if s and k != "h_1"]   # not the residual adds after its last layer (keep nothing)
    lines = [
        (f"# GPT 4x64 at {a.fraction:.0%}: blocks recomputed whole or `partial`, "
        f"{a.target} plan"),
        "",
        (f"Command: `.venv/bin/python benchmarks/plan/gpt_partial_mixes.py --target {a.target}` "
        f"(jax {jax.__version__}; {time.time() - t0:.0f} s). GPT 4x64, ctx 64, batch 16 "
        f"under `jaxmem.scope()`; default {default / MIB:.2f} MiB, budget "
        f"{budget / MIB:.2f} MiB. Every plan: the embeddings joined to the first block's "
        "segment (or stored, where the first block is `partial`), `ln_f..wte.attend` one "
        "segment, the loss after it stored. "
        f"`partial` = the block's {', '.join(kept)} stored, the rest recomputed "
        f"({by_key[(('h_1',), str(p.option))].cost / 1e6:.1f} MFLOP against "
        f"{by_key[(('h_1',), 'recompute')].cost / 1e6:.1f} for the whole block). Compiled = "
        "temp + output + argument - alias of `value_and_grad`; predicted time = the "
        "planner's (1 + recomputed FLOPs / (3 x forward FLOPs)), the conversion's own FLOPs "
        "not added."),
        "",
        "| partial blocks | compiled MiB | within budget | predicted time |",
        "|---|---|---|---|"]
    for mix, b, t in sorted(rows, key=lambda r: (r[2], r[1])):
        names = ", ".join(blk for blk, m in zip(BLOCKS, mix) if m) or "none"
        lines.append(f"| {names} | {b / MIB:.2f} | {'yes' if b <= budget else 'no'} | "
                     f"{t:.3f}x |")
    fit = [r for r in rows if r[1] <= budget]
    best = min(fit, key=lambda r: (r[2], r[1])) if fit else None
    if best is not None:
        lines += ["", (f"Fastest within the budget: {best[2]:.3f}x at {best[1] / MIB:.2f} MiB "
                  f"({sum(best[0])} blocks partial).")]
    over = [r for r in rows if r[1] > budget and r[2] <= a.goal]
    if over and (best is None or best[2] > a.goal):
        # what stops the smallest plan the budget refuses that would meet the time goal: its
        # peak, with the attention whole and in query chunks
        mix, b, t = min(over, key=lambda r: (r[1], r[2]))
        names = ", ".join(blk for blk, m in zip(BLOCKS, mix) if m)
        lines += ["", (f"What is live at the peak of the smallest plan within {a.goal}x over "
                       f"the budget ({names} `partial`, {t:.3f}x; "
                       "`jaxmem.measure.live_peak`):"), ""]
        for chunk in (None, a.attention_chunk):
            opts = Options(attention_chunk=chunk) if chunk else Options()
            factory = functools.partial(scope_options, opts, label="jaxmem.plan")
            step = make_step(loss, factory, prof.cut_labels, _runs(mix, partial), {},
                             fence=False)
            total = compiled_total(jax.value_and_grad(step), args, a.target)
            p = live_peak(jax.value_and_grad(step), *args, target=a.target)
            top = "; ".join(f"{x.bytes / MIB:.2f} MiB {x.shape.split('{')[0]} "
                            f"{x.op_name.split('/GPT/')[-1]}" for x in p.buffers[:4])
            how = (f"attention {chunk} query rows at a time (`attention_chunk={chunk}`)"
                   if chunk else "attention whole (`attention_chunk` 512 > 64 rows)")
            lines.append(f"- {how}: {total / MIB:.2f} MiB compiled; {p.live_bytes / MIB:.2f} "
                         f"MiB of its {p.temp_bytes / MIB:.2f} MiB temp live at "
                         f"{p.instruction}:{p.instruction_name}; largest: {top}")
    out = OUT / a.target / "gpt_partial_mixes.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
