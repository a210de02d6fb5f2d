"""OLLA on the twin zoo: program order vs optimised order, bound, arena, executor, XLA.

Regenerate (about 15 minutes on 2 CPU cores):

    .venv/bin/python benchmarks/schedule/run_zoo.py

Writes benchmarks/results/schedule/zoo.json, zoo.md and zoo.png (``--render-only``
re-renders zoo.md / zoo.png from zoo.json without measuring).

On a GPU plan (XLA:GPU's, compiled here without a GPU; about 20 minutes on 2 CPU cores):

    .venv/bin/python benchmarks/schedule/run_zoo.py --target h100 [--models mlp,vgg11]

compares, for every zoo model at batch 1 and 32, XLA:GPU's default plan, OLLA's peak and
lower bound, and OLLA's order re-emitted with 1 / 4 / 16 barrier chunks compiled for the
target; the order is kept only where ``jaxmem.schedule.apply_order`` finds the plan lower.
Writes benchmarks/results/gpu_plan/schedule_zoo.{json,md} (``--md-only`` re-renders).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "results", "schedule")
COMMAND = ".venv/bin/python benchmarks/schedule/run_zoo.py"


def _stats(rs):
    return {
        "mean_reduction": statistics.mean(r["reduction"] for r in rs),
        # room: the most any order could save, 1 - lower_bound / program_peak
        "mean_room": statistics.mean(1 - r["lower_bound"] / r["program_peak"] for r in rs),
        "median_order_s": statistics.median(r["order_s"] for r in rs),
        "median_solve_s": statistics.median(r.get("solve_s", r["order_s"] + r["place_s"])
                                            for r in rs),
        "max_gap": max(r["gap"] for r in rs),
        "within_1pct": sum(r["gap"] <= 0.01 for r in rs),
        "zero_fragmentation": sum(r["arena"] == r["opt_peak"] for r in rs),
        "models": len(rs),
    }


def summarize(rows):
    ok = [r for r in rows if isinstance(r.get("reduction"), float)]
    out = {}
    for fw in ("jax", "torch"):
        for b in (1, 32):
            rs = [r for r in ok if r.get("framework") == fw and r.get("batch") == b]
            if rs:
                out[f"{fw}_b{b}"] = _stats(rs)
    for b in (1, 32):
        rs = [r for r in ok if r.get("batch") == b]
        if rs:
            out[f"all_b{b}"] = _stats(rs)
    if ok:
        out["all"] = _stats(ok)
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, b in zip(axes, (1, 32)):
        labels, red, gap = [], [], []
        for r in rows:
            if r.get("batch") == b and isinstance(r.get("reduction"), float):
                labels.append(f"{r['framework']}:{r['model']}")
                red.append(100 * r["reduction"])
                gap.append(100 * r["gap"])
        xs = range(len(labels))
        ax.bar(xs, red, label="reduction vs program order (%)")
        ax.plot(xs, gap, "rx", label="remaining gap to bound (%)")
        ax.axhline(22.5 if b == 1 else 10.1, color="k", ls="--", lw=1, label="OLLA paper average")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"batch {b}")
    axes[0].set_ylabel("%")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------
# --target h100: OLLA's order re-emitted with barriers vs XLA:GPU's own scheduler
# ---------------------------------------------------------------------------------------
GPU_OUT = os.path.join(HERE, "..", "results", "gpu_plan")
GPU_CHUNKS = (1, 4, 16)
#: XLA's own plan "reaches" the OLLA bound when its compiled bytes are within this of it
REACH_TOL = 0.005


def gpu_rows(target, models, batches, time_limit, progress=print, done=()):
    """One row per (model, batch): XLA's default plan on ``target``, OLLA's order / peak /
    proven bound, the order re-emitted with 1/4/16 barrier chunks compiled for ``target``,
    and :func:`jaxmem.schedule.apply_order`'s decision (keep only where the plan is lower)."""
    import time

    from jaxmem.bench.schedule import jax_step
    from jaxmem.schedule import apply_order, optimize, trace

    rows = []
    for name in models:
        for batch in batches:
            if (name, batch) in done:
                continue
            t0 = time.time()
            step, args = jax_step(name, batch)
            donate = (0, 1, 2)   # params, model state, optimizer state
            ts = trace(step, *args, donate_argnums=donate)
            plan = optimize(ts.graph, time_limit=time_limit, placement=False)
            t_order = time.time() - t0
            r = apply_order(step, plan, *args, traced=ts, chunks=GPU_CHUNKS, target=target,
                            donate_argnums=donate)
            row = {"model": name, "batch": batch, "nodes": len(ts.graph.nodes),
                   "graph_program_peak": int(plan.baseline_peak),
                   "graph_opt_peak": int(plan.peak), "graph_lower_bound": int(plan.lower_bound),
                   "status": plan.status, "order_s": round(t_order, 1),
                   "xla_default": r.baseline_bytes, "xla_default_temp": r.baseline_temp_bytes,
                   "olla": {str(k): r.candidates.get(k) for k in GPU_CHUNKS},
                   "olla_temp": {str(k): r.candidate_temp_bytes.get(k) for k in GPU_CHUNKS},
                   "kept": r.applied, "kept_chunks": r.chunks, "kept_bytes": r.compiled_bytes,
                   "kept_temp": r.temp_bytes, "reduction": round(r.reduction, 4),
                   "why": r.why}
            row["seconds"] = round(time.time() - t0, 1)
            progress(json.dumps(row))
            rows.append(row)
    return rows


def _gpu_markdown(res):
    import jax

    t = res["target"]
    lab = f"{t.upper()} plan"
    rows = res["rows"]
    def kib(b):
        return "—" if b is None else f"{b / 1024:.0f}"

    md = [f"<!-- generated by `{res['command']}` -->",
          f"# OLLA's order with barriers vs XLA:GPU's own scheduler ({lab}, zoo)", "",
          (f"Regenerate with `{res['command']}` (jax {jax.__version__}; CP-SAT "
           f"{res['time_limit']:g} s per stage; {res['wall_s']:.0f} s wall on 2 shared CPU "
           "cores)."), "",
          ("Zoo: the CPU-scaled models of `jaxmem.bench.schedule.jax_step` (the sizes of "
           "`benchmarks/results/schedule/zoo.md`, not shrunk further), batch 1 and 32, "
           "optax SGD, params / state / optimizer state donated. All bytes in KiB. "
           "`xla_default`: XLA:GPU's compiled bytes (temp + output + argument - alias) of "
           "the step jitted as written; `temp` its temp part. `graph_opt` / `graph_bound`: "
           "OLLA's op-level resident-set peak of its order and its proven lower bound "
           "(ILP + cut / antichain bounds). `olla_k`: the OLLA order re-emitted "
           "(`schedule.xla.as_function`) with k barrier chunks (k=1: no barrier), "
           f"compiled for the {lab}. `decision`: `schedule.apply_order(..., target="
           f"'{t}')` keeps the order only where its best re-emission is strictly below "
           "`xla_default`."), "",
          ("GPU plan limits: compiled without a GPU (compile-only device of the CUDA PJRT "
           "plugin): no autotuning, so cuBLAS/cuDNN workspaces are not counted and temp "
           "is a lower bound; no timing. XLA fuses elementwise ops, so its buffers are not "
           "the op-level graph's: `graph_bound` bounds orders of the unfused graph, and "
           "`xla <= bound` means XLA:GPU's plan already is at or below what any order of "
           "that graph can reach."), ""]
    kept = [r for r in rows if r["kept"]]
    reach = [r for r in rows if r["xla_default"] <= r["graph_lower_bound"] * (1 + REACH_TOL)]
    own = [r for r in rows if not r["kept"]]
    def barred(r):
        v = [r["olla"][str(k)] for k in GPU_CHUNKS if k > 1 and r["olla"].get(str(k))]
        return min(v) if v else None

    worse = [r for r in rows if barred(r) is not None and barred(r) > r["xla_default"]]
    def nm(r):
        return f"{r['model']} b{r['batch']}"

    md += ["## Summary", "",
           f"- Order kept (lowers the {lab}) on {len(kept)}/{len(rows)}: "
           + (", ".join(f"{nm(r)} −{100 * r['reduction']:.1f}% ({r['kept_chunks']} chunks)"
                        for r in kept) or "none") + ".",
           f"- Order refused (XLA:GPU's own schedule as low or lower) on {len(own)}/"
           f"{len(rows)}: " + (", ".join(nm(r) for r in own) or "none")
           + "; with barriers (best of 4 / 16 chunks) the order would raise the plan on "
           + (", ".join(f"{nm(r)} +{100 * (barred(r) / r['xla_default'] - 1):.0f}%"
                        for r in worse) or "none") + ".",
           f"- XLA:GPU's default plan already at or below OLLA's lower bound (within "
           f"{100 * REACH_TOL:g}%) on {len(reach)}/{len(rows)}: "
           + (", ".join(f"{nm(r)} ({r['xla_default'] / r['graph_lower_bound']:.2f}x)"
                        for r in reach) or "none") + "; above it on "
           + (", ".join(f"{nm(r)} ({r['xla_default'] / r['graph_lower_bound']:.2f}x)"
                        for r in rows if r not in reach) or "none") + ".",
           ("- OLLA's order without barriers (`olla_1`) compiles to XLA's own plan on "
            f"{sum(r['olla']['1'] == r['xla_default'] for r in rows)}/{len(rows)}: "
            "XLA:GPU reschedules a re-emitted jaxpr, only barriers pin the order."), "",
           "## Per model", "",
           ("| model | batch | nodes | graph_program | graph_opt | graph_bound | xla_default "
            "| temp | olla_1 | olla_4 | olla_16 | best temp | decision | change |"),
           "|" + "---|" * 14]
    for r in rows:
        vals = {k: v for k, v in r["olla"].items() if v is not None}
        bk = min(vals, key=lambda k: (vals[k], int(k))) if vals else None
        md.append(
            f"| {r['model']} | {r['batch']} | {r['nodes']} | {kib(r['graph_program_peak'])} | "
            f"{kib(r['graph_opt_peak'])} | {kib(r['graph_lower_bound'])} | "
            f"{kib(r['xla_default'])} | {kib(r['xla_default_temp'])} | "
            + " | ".join(kib(r["olla"][str(k)]) for k in GPU_CHUNKS)
            + f" | {kib(r['olla_temp'][bk]) if bk else '—'} | "
            + (f"keep ({r['kept_chunks']} chunks)" if r["kept"] else "XLA's own")
            + (f" | {-100 * r['reduction']:+.1f}% |" if r["kept"] else " | 0 |"))
    md.append("")
    return "\n".join(md)


def gpu_main(target, models, batches, time_limit, md_only=False):
    import time

    from jaxmem.measure import TARGETS

    if target not in TARGETS or target == "cpu":
        raise SystemExit(f"--target: a GPU plan of {TARGETS}, got {target!r}")
    os.makedirs(GPU_OUT, exist_ok=True)
    jpath = os.path.join(GPU_OUT, "schedule_zoo.json")
    cmd = f"{COMMAND} --target {target}" + (
        f" --time-limit {time_limit:g}" if time_limit != 10.0 else "")
    if md_only:
        with open(jpath) as f:
            res = json.load(f)
    else:
        t0 = time.time()
        rows = []

        def save(wall):
            res = {"command": cmd, "target": target, "time_limit": time_limit,
                   "chunks": list(GPU_CHUNKS), "wall_s": wall, "rows": rows}
            with open(jpath, "w") as f:
                json.dump(res, f, indent=2)
            return res

        for name in models:
            for b in batches:
                rows += gpu_rows(target, [name], [b], time_limit,
                                 progress=lambda m: print(m, flush=True))
                res = save(round(time.time() - t0, 1))
    with open(os.path.join(GPU_OUT, "schedule_zoo.md"), "w") as f:
        f.write(_gpu_markdown(res) + "\n")


def main(argv=None):
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from jaxmem.bench import schedule as S

    argv = sys.argv[1:] if argv is None else argv
    if "--target" in argv:
        import argparse

        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--target", required=True, help="a GPU plan, e.g. h100")
        ap.add_argument("--models", default=",".join(S.ALL_MODELS))
        ap.add_argument("--batches", default="1,32")
        ap.add_argument("--time-limit", type=float, default=10.0)
        ap.add_argument("--md-only", action="store_true")
        a = ap.parse_args(argv)
        gpu_main(a.target, [m for m in a.models.split(",") if m],
                 [int(b) for b in a.batches.split(",") if b], a.time_limit, a.md_only)
        return
    os.makedirs(OUT, exist_ok=True)
    if "--render-only" in argv:  # re-render zoo.md / zoo.png from an existing zoo.json
        from jaxmem.bench import Section

        with open(os.path.join(OUT, "zoo.json")) as f:
            d = json.load(f)
        wall = float(next(n for n in d["notes"] if n.startswith("section wall time")).split()[3])
        d["notes"] = S.notes_for(d["meta"]["time_limit"], wall)
        d["plots"] = []
        sec = Section(**d)
    else:
        sec = S.run(quick=False, progress=lambda m: print(m, flush=True))
    summary = summarize(sec.rows)
    sec.meta["summary"] = summary
    sec.meta["command"] = COMMAND
    sec.notes.append(f"regenerate: `{COMMAND}`")
    with open(os.path.join(OUT, "zoo.json"), "w") as f:
        f.write(sec.to_json())
    png = os.path.join(OUT, "zoo.png")
    plot(sec.rows, png)
    sec.plots.append("zoo.png")
    md = sec.to_markdown()
    md += ("\n## Summary\n\n| setting | mean reduction | mean room (1 - bound/program) | "
           "median order time | median solve time | max gap | gap <= 1% | arena==peak |\n"
           "|---|---|---|---|---|---|---|---|\n")
    for k, v in summary.items():
        md += (f"| {k} | {100 * v['mean_reduction']:.1f}% | {100 * v['mean_room']:.1f}% | "
               f"{v['median_order_s']:.1f} s | {v['median_solve_s']:.1f} s | "
               f"{100 * v['max_gap']:.1f}% | {v['within_1pct']}/{v['models']} | "
               f"{v['zero_fragmentation']}/{v['models']} |\n")
    with open(os.path.join(OUT, "zoo.md"), "w") as f:
        f.write(f"<!-- generated by `{COMMAND}` -->\n" + md)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
