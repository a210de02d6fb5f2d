"""rowconv benchmark: VGG-16 / ResNet-50 trunks at high resolution (CPU-scaled widths).

Writes benchmarks/results/rowconv/{trunks.json, trunks.md, trunks.png}:
  * compiled bytes and step-time ratio vs rows N for OverL / 2PS and their -H hybrids;
  * measured peak (process high-water mark, fresh subprocess) for a few configs;
  * the largest square image side whose train step fits a fixed compiled-bytes budget.

Regenerate:  .venv/bin/python benchmarks/rowconv/bench_trunks.py [--side 1024] [--quick]
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
from jaxmem.measure import compiled_memory, peak_memory

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


def largest_side(name, width, rows, mode, hybrid, budget, step=64, hi=4096):
    """Largest side (multiple of ``step``) whose compiled train step fits ``budget``."""
    best = None
    lo_s, hi_s = 1, hi // step
    while lo_s <= hi_s:
        mid = (lo_s + hi_s) // 2
        side = mid * step
        layers = trunk(name, width, hybrid)
        shape = (1, side, side, 3)
        r = rows if rows == 1 else rc.segment_rows(layers, shape, rows, mode)
        params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
        x = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
        cm = compiled_memory(B.make_step(layers, r, mode), params, x)
        print(f"  {name} {mode} rows={rows} hybrid={hybrid} side={side}: "
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
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    result = {"command": "python benchmarks/rowconv/bench_trunks.py " + " ".join(sys.argv[1:]),
              "jax": jax.__version__, "width": a.width, "side": a.side, "sweeps": {},
              "peak": [], "largest_side": []}
    ns = (4, 8) if a.quick else (2, 4, 8, 16)
    for name, side in (("vgg16", a.side), ("resnet50", a.side // 2)):
        shape = (1, side, side, 3)
        plain = (2, 4) if name == "vgg16" else (2,)
        layers, hl = trunk(name, a.width), trunk(name, a.width, True)
        print(f"== {name} {shape}", flush=True)
        rows = B.sweep(layers, shape, configs(ns, plain), repeats=3, progress=print,
                       hybrid_layers=hl)
        for r in rows:
            print(r, flush=True)
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
            s = largest_side("vgg16", a.width, rows, mode, hybrid, budget)
            result["largest_side"].append({"model": "vgg16", "budget_bytes": budget,
                                           "rows": rows, "mode": mode, "hybrid": hybrid,
                                           "side": s})
            print(result["largest_side"][-1], flush=True)
    result["seconds"] = time.time() - t0
    with open(os.path.join(OUT, "trunks.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    write_md(result)
    plot(result)


def write_md(res):
    L = [f"# rowconv trunks (width {res['width']}, CPU, jax {res['jax']})", "",
         f"Command: `{res['command']}`", ""]
    for name, sw in res["sweeps"].items():
        L += [f"## {name} {tuple(sw['shape'])}", "",
              "| config | rows per segment | compiled MiB | bytes ratio (untiled/tiled) | "
              "step-time ratio |", "|---|---|---|---|---|"]
        for r in sw["rows"]:
            L.append(f"| {r['config']} | {r['rows']} | {r['compiled_bytes'] / 2**20:.1f} | "
                     f"{r['bytes_ratio']:.2f}x | {r['time_ratio']:.2f}x |")
        L.append("")
    if res["peak"]:
        L += ["## measured peak (VmHWM delta, fresh process)", "",
              "| rows | mode | hybrid | peak MiB |", "|---|---|---|---|"]
        for p in res["peak"]:
            L.append(f"| {p['rows']} | {p['mode']} | {p['hybrid']} | "
                     f"{p['peak_bytes'] / 2**20:.1f} |")
        L.append("")
    if res["largest_side"]:
        L += ["## largest side within a compiled-bytes budget", "",
              "| rows | mode | hybrid | budget MiB | largest side |", "|---|---|---|---|---|"]
        for p in res["largest_side"]:
            L.append(f"| {p['rows']} | {p['mode']} | {p['hybrid']} | "
                     f"{p['budget_bytes'] / 2**20:.0f} | {p['side']} |")
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
        for r in sw["rows"]:
            ax.scatter(r["time_ratio"], r["compiled_bytes"] / 2**20)
            ax.annotate(r["config"], (r["time_ratio"], r["compiled_bytes"] / 2**20),
                        fontsize=7)
        ax.set_xlabel("step-time ratio vs untiled")
        ax.set_ylabel("compiled MiB")
        ax.set_title(f"{name} {tuple(sw['shape'])}")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "trunks.png"), dpi=100)


if __name__ == "__main__":
    main()
