"""Does a longer solve close the gap? One model, ordering only, time limits 10 s -> 300 s.

    .venv/bin/python benchmarks/schedule/long_solve.py [model] [batch] [framework]

Writes benchmarks/results/schedule/long_solve_<framework>_<model>_<batch>.json.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "results", "schedule")


def main():
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from jaxmem.bench import schedule as S
    from jaxmem.schedule import optimize

    model = sys.argv[1] if len(sys.argv) > 1 else "vgg11"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    fw = sys.argv[3] if len(sys.argv) > 3 else "jax"
    if fw == "jax":
        from jaxmem.schedule import trace

        step, args = S.jax_step(model, batch)
        graph = trace(step, *args, donate_argnums=(0, 1, 2)).graph
    else:
        from torch_ref.olla import fx_to_graph, trace_training_step

        m, lf, x, y = S.torch_step(model, batch)
        gm, _s, args = trace_training_step(m, lf, x, y)
        graph = fx_to_graph(gm, donate=range(len(args) - 2)).graph
    rows = []
    for limit in (10, 60, 300):
        for form in ("olla", "cumulative"):
            p = optimize(graph, time_limit=limit, placement=False, formulation=form)
            row = {"time_limit": limit, "formulation": form, "program_peak": p.baseline_peak,
                   "peak": p.peak, "lower_bound": p.lower_bound, "gap": p.gap,
                   "status": p.status, "order_s": p.order_seconds, "num_vars": p.num_vars}
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(OUT, exist_ok=True)
    cmd = f".venv/bin/python benchmarks/schedule/long_solve.py {model} {batch} {fw}"
    with open(os.path.join(OUT, f"long_solve_{fw}_{model}_{batch}.json"), "w") as f:
        json.dump({"command": cmd, "model": model, "batch": batch, "framework": fw,
                   "nodes": len(graph.nodes), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
