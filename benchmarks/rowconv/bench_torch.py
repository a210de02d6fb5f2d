"""rowconv: JAX vs the PyTorch reference (torch_ref.rowconv) on the VGG-16 trunk (CPU).

Both frameworks: untiled train step vs OverL-H (a row-tiled block per pooling stage, N rows).
Memory: JAX compiled bytes; torch bytes saved for backward (torch_ref.measure.saved_bytes).
Time: step time ratio tiled/untiled within each framework (interleaved repeats, min), plus
JAX/torch absolute times for reference.

Writes benchmarks/results/rowconv/torch_vs_jax.{json,md}.
Regenerate:  .venv/bin/python benchmarks/rowconv/bench_torch.py [--side 512] [--rows 8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import torch
from torch import nn

from jaxmem import rowconv as rc
from jaxmem.bench import rowconv as B
from jaxmem.measure import compiled_memory
from torch_ref.measure import saved_bytes
from torch_ref.rowconv import RowSequential

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "rowconv")


def torch_vgg_segments(width):
    segs, cur, cin = [], [], 3
    for item in rc.trunks.VGG16:
        if item == "M":
            cur.append(nn.MaxPool2d(2))
            segs.append(nn.Sequential(*cur))
            cur = []
        else:
            c = max(1, int(round(item * width)))
            cur += [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU()]
            cin = c
    return segs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=float, default=1 / 8)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    side, N = a.side, a.rows
    # ---- torch
    segs = torch_vgg_segments(a.width)
    plain = nn.Sequential(*segs)
    heights, h = [], side
    for _ in segs:
        heights.append(h)
        h //= 2
    tiled = nn.Sequential(*[RowSequential(s, max(1, min(N, hh // 16))) for s, hh in
                            zip(segs, heights)])
    x = torch.randn(1, 3, side, side)

    def tstep(m):
        def f():
            for p in m.parameters():
                p.grad = None
            m(x).square().mean().backward()
        return f

    t_saved = {k: saved_bytes(lambda m=m: m(x).square().mean()).total_bytes
               for k, m in (("untiled", plain), ("OverL-H", tiled))}
    fns = {"untiled": tstep(plain), "OverL-H": tstep(tiled)}
    ts = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(3):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    torch_t = {k: min(v) for k, v in ts.items()}
    # ---- jax (same architecture; rows per segment clipped the same way)
    hl = rc.trunks.vgg_layers(width=a.width, checkpoints_at_pools=True)
    shape = (1, side, side, 3)
    rows = rc.segment_rows(hl, shape, N, "overlap")
    params, xj = B.setup(hl, shape)
    fj = {"untiled": jax.jit(B.make_step(hl, 1, "overlap")),
          "OverL-H": jax.jit(B.make_step(hl, rows, "overlap"))}
    jcm = {k: compiled_memory(B.make_step(hl, 1 if k == "untiled" else rows, "overlap"),
                              params, xj).total_bytes for k in fj}
    tr = B.time_ratios({k: (lambda f=f: f(params, xj)) for k, f in fj.items()}, (), 3)
    res = {"command": "python benchmarks/rowconv/bench_torch.py " + " ".join(sys.argv[1:]),
           "side": side, "rows": N, "width": a.width,
           "torch": {k: {"time_s": torch_t[k], "time_ratio": torch_t[k] / torch_t["untiled"],
                         "saved_bytes": t_saved[k]} for k in fns},
           "jax": {k: {"time_s": tr[k][0], "time_ratio": tr[k][1],
                       "compiled_bytes": jcm[k]} for k in fj}}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "torch_vs_jax.json"), "w") as f:
        json.dump(res, f, indent=2)
    L = [f"# rowconv: JAX vs torch_ref, VGG-16 trunk width {a.width}, {side}x{side}, N={N}", "",
         f"Command: `{res['command']}`", "",
         "| framework | config | memory measure | MiB | step s | time ratio |",
         "|---|---|---|---|---|---|"]
    for k in fns:
        r = res["torch"][k]
        L.append(f"| torch | {k} | saved for backward | {r['saved_bytes'] / 2**20:.1f} | "
                 f"{r['time_s']:.3f} | {r['time_ratio']:.2f}x |")
    for k in fj:
        r = res["jax"][k]
        L.append(f"| jax | {k} | compiled (temp+out+arg) | {r['compiled_bytes'] / 2**20:.1f} | "
                 f"{r['time_s']:.3f} | {r['time_ratio']:.2f}x |")
    with open(os.path.join(OUT, "torch_vs_jax.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
