"""Which GPT blocks can run ``partial`` within 25 % of the default, on a target's plan.

The bench's GPT 4x64 (ctx 64, batch 16) under ``jaxmem.scope()``, planned as the planner
plans it at 25 %: the embeddings joined to the first block's segment, the final norm and
the head's product (``ln_f..wte.attend``) one segment, the loss after them stored, and each
block either recomputed whole or ``partial`` (its
attention stored, its layer norms and MLP recomputed: the planner's first ``partial``
candidate). Every mix of the four blocks is compiled for ``--target``; predicted time is the
planner's own (1 + the items' recomputed FLOPs / 3 x the step's forward FLOPs, as
``MemoryPlan.predicted_time``), the conversion's own FLOPs (``conversion_time``) not added.
Every mix is compiled twice: under the scope's defaults and with its attentions and MLPs in row
chunks (``--attention-chunk`` / ``--mlp-chunk``: ``plan(..., attention_chunk=...,
mlp_chunk=...)``), each with its traced FLOPs (``MemoryPlan.traced_time``). Where no plan
within the budget meets ``--goal`` with the defaults, the smallest plan that would (refused by
the budget) is read with ``jaxmem.measure.live_peak``, with and without the chunks.

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
                    help="query rows per chunk of the attentions under the chunked scope")
    ap.add_argument("--mlp-chunk", type=int, default=256,
                    help="rows per chunk of the MLPs under the chunked scope")
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
    chunks = Options(attention_chunk=a.attention_chunk, mlp_chunk=a.mlp_chunk)
    scopes = {"whole": api._glue_scope,
              "chunks": functools.partial(scope_options, chunks, label="jaxmem.plan")}
    f0 = api._step_flops(loss, args)
    rows = []
    for mix in itertools.product((False, True), repeat=len(BLOCKS)):
        runs = _runs(mix, partial)
        cost = sum(by_key[(lbls, opt)].cost for lbls, opt in runs if opt != "store")
        got = {}
        for name, factory in scopes.items():
            step = make_step(loss, factory, prof.cut_labels, runs, {}, fence=False)
            got[name] = (compiled_total(jax.value_and_grad(step), args, a.target),
                         api._step_flops(step, args) / f0)
        rows.append((mix, got, 1.0 + cost / step_flops))
        print(mix, {k: (f"{b / MIB:.2f} MiB", f"{t:.3f}") for k, (b, t) in got.items()},
              f"{1.0 + cost / step_flops:.3f}", flush=True)
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
        "temp + output + argument - alias of `value_and_grad`; predicted = the "
        "planner's (1 + recomputed FLOPs / (3 x forward FLOPs)), the conversion's own FLOPs "
        "not added; traced = the FLOPs of the planned step's `value_and_grad` jaxpr over the "
        "untouched step's (`MemoryPlan.traced_time`: the conversion and every recomputation "
        "counted once). Whole: the scope's defaults; chunks: the scope with "
        f"`attention_chunk={a.attention_chunk}, mlp_chunk={a.mlp_chunk}` "
        "(`plan(..., attention_chunk=..., mlp_chunk=...)`)."),
        "",
        "| partial blocks | predicted | whole: MiB | traced | chunks: MiB | traced |",
        "|---|---|---|---|---|---|"]
    for mix, got, t in sorted(rows, key=lambda r: (r[2], r[1]["whole"][0])):
        names = ", ".join(blk for blk, m in zip(BLOCKS, mix) if m) or "none"
        cells = " | ".join(f"{b / MIB:.2f}{'' if b <= budget else ' (over)'} | {tr:.3f}x"
                           for b, tr in (got["whole"], got["chunks"]))
        lines.append(f"| {names} | {t:.3f}x | {cells} |")
    lines.append("")
    for name in scopes:
        fit = [r for r in rows if r[1][name][0] <= budget]
        if fit:
            best = min(fit, key=lambda r: (r[2], r[1][name][0]))
            least = min(fit, key=lambda r: (r[1][name][1], r[1][name][0]))
            lines.append(
                f"- {name}: fastest within the budget by the planner's prediction "
                f"{best[2]:.3f}x ({sum(best[0])} blocks partial, {best[1][name][0] / MIB:.2f} "
                f"MiB, traced {best[1][name][1]:.3f}x); least traced {least[1][name][1]:.3f}x "
                f"({sum(least[0])} blocks partial, {least[1][name][0] / MIB:.2f} MiB).")
    over = [r for r in rows if r[1]["whole"][0] > budget and r[2] <= a.goal]
    fit = [r for r in rows if r[1]["whole"][0] <= budget]
    best = min(fit, key=lambda r: (r[2], r[1]["whole"][0])) if fit else None
    if over and (best is None or best[2] > a.goal):
        # what stops the smallest plan the budget refuses that would meet the time goal: its
        # peak, with the scope's defaults and with the chunks
        mix, got, t = min(over, key=lambda r: (r[1]["whole"][0], r[2]))
        names = ", ".join(blk for blk, m in zip(BLOCKS, mix) if m)
        lines += ["", (f"What is live at the peak of the smallest plan within {a.goal}x over "
                       f"the budget with the scope's defaults ({names} `partial`, {t:.3f}x; "
                       "`jaxmem.measure.live_peak`):"), ""]
        for name, how in (("whole", "the scope's defaults (attention whole: 512 > 64 rows)"),
                          ("chunks", (f"`attention_chunk={a.attention_chunk}, "
                                      f"mlp_chunk={a.mlp_chunk}`"))):
            step = make_step(loss, scopes[name], prof.cut_labels, _runs(mix, partial), {},
                             fence=False)
            pk = live_peak(jax.value_and_grad(step), *args, target=a.target)
            top = "; ".join(f"{x.bytes / MIB:.2f} MiB {x.shape.split('{')[0]} "
                            f"{x.op_name.split('/GPT/')[-1]}" for x in pk.buffers[:4])
            lines.append(f"- {how}: {got[name][0] / MIB:.2f} MiB compiled; "
                         f"{pk.live_bytes / MIB:.2f} MiB of its {pk.temp_bytes / MIB:.2f} MiB "
                         f"temp live at {pk.instruction}:{pk.instruction_name}; largest: {top}")
    out = OUT / a.target / "gpt_partial_mixes.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
