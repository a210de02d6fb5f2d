"""What recomputing the planner's units buys on jaxmem's converted step (H100 plan by default).

The planner traces ResNet-50 (``bench_plan.resnet_case``) under the conversion it would plan
(``jaxmem.plan``'s converted variant), prints each unit's profiled bytes (stored / ``dots`` /
``recompute``), then compiles ``value_and_grad`` of hand-made plans:

* ``segment a..b``: units ``a..b-1`` recomputed as one chunk, the rest stored, on the
  converted trace (unfenced and fenced);
* ``per-layer``: the unconverted trace with each stored unit converted on its own (the
  planner's per-unit ``exact`` conversion), with and without a segment.

    .venv/bin/python benchmarks/plan/converted_units.py [--batch 32] [--target h100]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_plan

from jaxmem.planner import api as _api
from jaxmem.planner import candidates as _cand
from jaxmem.planner import trace as _trace
from jaxmem.planner.steps import compiled_total, make_step

MIB = 2.0**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--target", default="h100")
    a = ap.parse_args()
    name, loss, args = bench_plan.resnet_case(False, a.batch)
    settings = _api._Settings(target=a.target)
    cache: dict = {}
    default = _api._baseline(loss, args, a.target, cache).total_bytes
    _, factory, converted = _api._variant(loss, args, settings, cache)
    print(f"{name} on {a.target}: default {default / MIB:.2f} MiB, converted "
          f"{converted / MIB:.2f} MiB ({converted / default:.2f}x)")
    tr = _trace.trace(loss, args, factory())
    prof = _cand.profile_units(tr, 0)
    labels = prof.labels
    print("unit: stored / dots / recompute MiB")
    for i, (lbl, keep) in enumerate(zip(labels, prof.keep)):
        print(f"  {i:2d} {lbl}: " + " / ".join(f"{k / MIB:.2f}" for k in keep))

    def compile_plan(segment, per_layer, fence):
        lo, hi = segment or (0, 0)
        runs = [((lbl,), "store") for lbl in labels]
        if segment:
            runs = runs[:lo] + [(tuple(labels[lo:hi]), "segment")] + runs[hi:]
        convs = {lbl: _trace.Conversion("exact") for lbl in labels[:lo] + labels[hi:]} \
            if per_layer else {}
        step = make_step(loss, None if per_layer else factory, prof.cut_labels, runs, convs,
                         fence=fence)
        return compiled_total(jax.value_and_grad(step), args, a.target) / MIB

    for segment, per_layer, fences in (((0, 4), False, (False, True)),
                                       ((0, 8), False, (False, True)),
                                       (None, True, (False,)), ((0, 5), True, (False,))):
        what = "per-layer conversion" if per_layer else "converted step"
        seg = f"segment {labels[segment[0]]}..{labels[segment[1] - 1]}" if segment else "none"
        got = ", ".join(f"{'fenced' if f else 'unfenced'} {compile_plan(segment, per_layer, f):.2f}"
                        for f in fences)
        print(f"{what}, recomputed: {seg}: {got} MiB", flush=True)


if __name__ == "__main__":
    main()
