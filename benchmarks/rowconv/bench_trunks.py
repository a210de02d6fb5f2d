"""rowconv benchmark: VGG-16 / ResNet-50 trunks at high resolution (CPU-scaled widths).

Writes benchmarks/results/rowconv/{trunks.json, trunks.md, trunks.png}:
  * compiled bytes and step-time ratio vs rows N for OverL / 2PS and their -H hybrids;
  * measured peak (process high-water mark, fresh subprocess) for a few configs;
  * the largest square image side whose train step fits a fixed compiled-bytes budget.

Compiled bytes are measured for every ``--target`` (default ``h100,cpu``): ``h100`` is
XLA:GPU's memory plan for an H100 compiled on this machine without a GPU
(``jaxmem.measure.compiled_memory(..., target="h100")``), ``cpu`` XLA:CPU's. Step times and
the measured peak are CPU-only (nothing runs on the GPU plan).

Regenerate:  .venv/bin/python benchmarks/rowconv/bench_trunks.py [--side 1024] [--quick]
[--target h100,cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from jaxmem import rowconv as rc
from jaxmem.bench import rowconv as B
from jaxmem.measure import TARGETS, compiled_memory, peak_memory

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "results", "rowconv")


def trunk(name, width, hybrid=False):
    if name == "vgg16":
        return rc.trunks.vgg_layers(width=width, checkpoints_at_pools=hybrid)
    return rc.trunks.resnet50_layers(width=width, checkpoints_at_stages=hybrid)


def peak_target(name, width, side, rows, mode, hybrid):
    """Zero-arg train step for jaxmem.measure.peak_memory (runs in a fresh process)."""
    layers = trunk(name, width, hybrid)
    shape = (1, side, side, 3)
    params, x = B.setup(layers, shape)
    r = rows if rows == 1 else rc.segment_rows(layers, shape, rows, mode)
    f = jax.jit(B.make_step(layers, r, mode))
    return lambda: f(params, x)


def configs(ns, plain_ns):
    c = [("untiled", "overlap", 1, None, False)]
    for n in plain_ns:
        c.append((f"OverL N={n}", "overlap", n, None, False))
        c.append((f"2PS N={n}", "share", n, None, False))
    for n in ns:
        c.append((f"OverL-H N={n}", "overlap", n, None, True))
        c.append((f"2PS-H N={n}", "share", n, None, True))
    return c


def sweep(layers, shape, cfgs, targets, repeats=3, hybrid_layers=None):
    """Rows for each (label, mode, rows, rows_bp, hybrid) config (config 0 is the baseline):
    compiled bytes on each target, step time (CPU) side by side."""
    params, x = B.setup(layers, shape)
    hp = B._hparams(hybrid_layers, layers, params) if hybrid_layers is not None else None
    fns, out = {}, []
    for label, mode, rows, rows_bp, hybrid in cfgs:
        ls = hybrid_layers if hybrid else layers
        if rows != 1:
            rows = rc.segment_rows(ls, shape, rows, mode)
        step = B.make_step(ls, rows, mode, rows_bp)
        p = hp if hybrid else params
        r = {"config": label, "mode": mode if rows != 1 else "untiled", "rows": str(rows),
             "compiled_bytes": {}, "temp_bytes": {}, "gemm_backend": {}, "compile_s": {}}
        for t in targets:
            t0 = time.time()
            cm = compiled_memory(step, p, x, target=t)
            r["compiled_bytes"][t], r["temp_bytes"][t] = cm.total_bytes, cm.temp_bytes
            r["gemm_backend"][t] = cm.gemm_backend
            r["compile_s"][t] = round(time.time() - t0, 1)
            print(f"  {label} on {cm.plan}: {cm.total_bytes / 2**20:.1f} MiB "
                  f"({r['compile_s'][t]} s)", flush=True)
        fns[label] = (jax.jit(step), p)
        out.append(r)
    print("  timing (CPU)", flush=True)
    tr = B.time_ratios({k: (lambda f=f, p=p: f(p, x)) for k, (f, p) in fns.items()}, (),
                       repeats)
    for r in out:
        r["time_s"], r["time_ratio"] = tr[r["config"]]
        r["bytes_ratio"] = {t: out[0]["compiled_bytes"][t] / r["compiled_bytes"][t]
                            for t in targets}
    return out


def largest_side(name, width, rows, mode, hybrid, budget, target, step=64, hi=4096):
    """Largest side (multiple of ``step``) whose compiled train step fits ``budget`` on
    ``target``."""
    best = None
    lo_s, hi_s = 1, hi // step
    while lo_s <= hi_s:
        mid = (lo_s + hi_s) // 2
        side = mid * step
        layers = trunk(name, width, hybrid)
        shape = (1, side, side, 3)
        r = rows if rows == 1 else rc.segment_rows(layers, shape, rows, mode)
        params = jax.eval_shape(lambda ls=layers, s=shape: rc.init(ls, jax.random.PRNGKey(0), s))
        x = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
        cm = compiled_memory(B.make_step(layers, r, mode), params, x, target=target)
        print(f"  {name} {mode} rows={rows} hybrid={hybrid} side={side} {cm.plan}: "
              f"{cm.total_bytes / 2**20:.1f} MiB", flush=True)
        if cm.total_bytes <= budget:
            best, lo_s = side, mid + 1
        else:
            hi_s = mid - 1
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--width", type=float, default=1 / 8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-peak", action="store_true")
    ap.add_argument("--skip-largest", action="store_true")
    ap.add_argument("--target", default="h100,cpu",
                    help="comma-separated compile targets for the compiled bytes "
                         f"({', '.join(TARGETS)}); GPU targets are XLA:GPU's plan without a GPU")
    a = ap.parse_args()
    targets = [t for t in a.target.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"--target: {t!r} is not one of {TARGETS}")
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    result = {"command": ".venv/bin/python benchmarks/rowconv/bench_trunks.py "
                         + " ".join(sys.argv[1:]),
              "jax": jax.__version__, "width": a.width, "side": a.side, "targets": targets,
              "sweeps": {}, "peak": [], "largest_side": []}
    ns = (4, 8) if a.quick else (2, 4, 8, 16)
    for name, side in (("vgg16", a.side), ("resnet50", a.side // 2)):
        shape = (1, side, side, 3)
        plain = (2, 4) if name == "vgg16" else (2,)
        layers, hl = trunk(name, a.width), trunk(name, a.width, True)
        print(f"== {name} {shape}", flush=True)
        rows = sweep(layers, shape, configs(ns, plain), targets, repeats=3, hybrid_layers=hl)
        for r in rows:
            print(json.dumps(r), flush=True)
        result["sweeps"][name] = {"shape": shape, "rows": rows}
    if not a.skip_peak:
        for (rows, mode, hybrid) in ((1, "overlap", False), (16, "share", True),
                                     (16, "overlap", True)):
            pm = peak_memory(peak_target, "vgg16", a.width, a.side, rows, mode, hybrid)
            result["peak"].append({"model": "vgg16", "side": a.side, "rows": rows,
                                   "mode": mode, "hybrid": hybrid,
                                   "peak_bytes": pm.peak_bytes})
            print(result["peak"][-1], flush=True)
    if not a.skip_largest:
        budget = 256 * 2**20
        for rows, mode, hybrid in ((1, "overlap", False), (16, "share", True),
                                   (16, "overlap", True)):
            side = {t: largest_side("vgg16", a.width, rows, mode, hybrid, budget, t)
                    for t in targets}
            result["largest_side"].append({"model": "vgg16", "budget_bytes": budget,
                                           "rows": rows, "mode": mode, "hybrid": hybrid,
                                           "side": side})
            print(result["largest_side"][-1], flush=True)
    result["seconds"] = time.time() - t0
    with open(os.path.join(OUT, "trunks.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    write_md(result)
    plot(result)


PLAN_LIMITS = (
    "GPU plan limits: XLA:GPU's memory plan compiled without a GPU (compile-only devices of "
    "the CUDA PJRT plugin): no autotuning, so cuBLAS/cuDNN workspaces are not counted and "
    "`temp` is a lower bound; no timing (step times below are XLA:CPU's); the plan belongs "
    "to XLA of jax {jax}.")


def _label(t):
    return "H100 plan" if t == "h100" else ("CPU" if t == "cpu" else f"{t} plan")


def _gemm(rows, t):
    used = sorted({r["gemm_backend"][t] for r in rows if r["gemm_backend"].get(t)})
    return "/".join(used) or "-"


def summary(res):
    """5-10 lines: the headline GPU-plan vs CPU figures."""
    ts = res["targets"]
    gpu = [t for t in ts if t != "cpu"]
    if not gpu or "cpu" not in ts:
        return []
    g = gpu[0]
    out = []
    for name, sw in res["sweeps"].items():
        rows = sw["rows"]
        base = rows[0]
        best = {t: max(rows, key=lambda r, t=t: r["bytes_ratio"][t]) for t in (g, "cpu")}
        out.append(
            f"- {name} {tuple(sw['shape'])}: untiled {base['compiled_bytes'][g] / 2**20:.1f} "
            f"MiB on the {_label(g)} vs {base['compiled_bytes']['cpu'] / 2**20:.1f} MiB on CPU; "
            f"best untiled/tiled ratio {best[g]['bytes_ratio'][g]:.2f}x on the {_label(g)} "
            f"({best[g]['config']}) vs {best['cpu']['bytes_ratio']['cpu']:.2f}x on CPU "
            f"({best['cpu']['config']}).")
        by = {r["config"]: r for r in rows}
        for c in ("2PS N=4", "OverL-H N=16", "2PS-H N=16"):
            if c in by:
                r = by[c]
                out.append(f"  - {c}: {r['bytes_ratio'][g]:.2f}x on the {_label(g)}, "
                           f"{r['bytes_ratio']['cpu']:.2f}x on CPU.")
    for p in res["largest_side"]:
        out.append(f"- largest VGG-16 side within {p['budget_bytes'] / 2**20:.0f} MiB, rows "
                   f"{p['rows']} {p['mode']} hybrid {p['hybrid']}: {p['side'].get(g)} on the "
                   f"{_label(g)}, {p['side'].get('cpu')} on CPU.")
    return out


def write_md(res):
    ts = res["targets"]
    L = [f"# rowconv trunks (width {res['width']}, jax {res['jax']})", "",
         f"Command: `{res['command']}`", "",
         ("Compiled bytes (temp + output + argument - alias of the train step "
          "`grad(mean(trunk(x)**2))`) on each target: "
          + ", ".join(_label(t) for t in ts) + ". Step-time ratios are CPU wall-time ratios "
          "to the untiled step, measured side by side (min of 3 interleaved calls)."), "",
         PLAN_LIMITS.format(jax=res["jax"]), ""]
    skipped = [what for flag, what in (("--quick", "rows N = 4 and 8 only for the hybrids"),
                                       ("--skip-peak", "no measured peak"),
                                       ("--skip-largest", "no largest-side search"))
               if flag in res["command"]]
    if skipped:
        L += ["Shortened run (" + "; ".join(skipped) + "): each compile of these trunks takes "
              "25-220 s per target on a shared 2-core machine; the full sweep is the "
              "command without those flags.", ""]
    summ = summary(res)
    if summ:
        L += ["## Summary", ""] + summ + [""]
    for name, sw in res["sweeps"].items():
        rows = sw["rows"]
        L += [f"## {name} {tuple(sw['shape'])}", "",
              "GEMM backend: " + ", ".join(f"{_label(t)} {_gemm(rows, t)}" for t in ts
                                           if t != "cpu") + ".", "",
              "| config | rows per segment | "
              + " | ".join(f"{_label(t)} MiB | {_label(t)} ratio (untiled/tiled)" for t in ts)
              + " | step-time ratio (CPU) |",
              "|---|---|" + "---|---|" * len(ts) + "---|"]
        for r in rows:
            L.append(f"| {r['config']} | {r['rows']} | "
                     + " | ".join(f"{r['compiled_bytes'][t] / 2**20:.1f} | "
                                  f"{r['bytes_ratio'][t]:.2f}x" for t in ts)
                     + f" | {r['time_ratio']:.2f}x |")
        L.append("")
    if res["peak"]:
        L += ["## measured peak on CPU (VmHWM delta, fresh process)", "",
              "| rows | mode | hybrid | peak MiB |", "|---|---|---|---|"]
        for p in res["peak"]:
            L.append(f"| {p['rows']} | {p['mode']} | {p['hybrid']} | "
                     f"{p['peak_bytes'] / 2**20:.1f} |")
        L.append("")
    if res["largest_side"]:
        L += ["## largest side within a compiled-bytes budget", "",
              "| rows | mode | hybrid | budget MiB | "
              + " | ".join(f"largest side, {_label(t)}" for t in ts) + " |",
              "|---|---|---|---|" + "---|" * len(ts)]
        for p in res["largest_side"]:
            L.append(f"| {p['rows']} | {p['mode']} | {p['hybrid']} | "
                     f"{p['budget_bytes'] / 2**20:.0f} | "
                     + " | ".join(str(p["side"].get(t)) for t in ts) + " |")
    with open(os.path.join(OUT, "trunks.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def plot(res):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(res["sweeps"]), figsize=(6 * len(res["sweeps"]), 4))
    if len(res["sweeps"]) == 1:
        axes = [axes]
    for ax, (name, sw) in zip(axes, res["sweeps"].items()):
        for t, mk in zip(res["targets"], "ox^s"):
            xs = [r["time_ratio"] for r in sw["rows"]]
            ys = [r["compiled_bytes"][t] / 2**20 for r in sw["rows"]]
            ax.scatter(xs, ys, marker=mk, label=_label(t))
            if t == res["targets"][0]:
                for r, xv, yv in zip(sw["rows"], xs, ys):
                    ax.annotate(r["config"], (xv, yv), fontsize=7)
        ax.legend(fontsize=8)
        ax.set_xlabel("step-time ratio vs untiled (CPU)")
        ax.set_ylabel("compiled MiB")
        ax.set_title(f"{name} {tuple(sw['shape'])}")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "trunks.png"), dpi=100)


if __name__ == "__main__":
    main()
