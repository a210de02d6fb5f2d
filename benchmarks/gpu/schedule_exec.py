"""OLLA plans realised on a device: measured peaks of the op-by-op executor.

    python benchmarks/gpu/schedule_exec.py MODEL BATCH ORDER [OUT.json]

The step of zoo model MODEL at the paper's size (``vgg11`` or ``resnet18`` at width 1,
224x224 images, 1000 classes, SGD, weights donated:
``jaxmem.bench.schedule.jax_step(..., scale="paper")``) is traced and executed op by op
once, on the default device, in ORDER: ``olla`` (``optimize(graph, time_limit=10)``) or
``program``. One process per (config, order): the device's peak counter only grows, so
nothing else big may run in the process before the measured step (no reference ``jit``;
parameters are initialised at batch 1). Reported:

* ``live_peak``: live-buffer peak (``jax.live_arrays``) measured by ``execute``, and the
  plan's prediction (``simulate``) — they agree exactly when the executor realises the plan;
* ``device_peak``: the allocator's ``peak_bytes_in_use`` during the step minus what was in
  use before it, plus those arguments (GPU only): what the device really needed, kernel
  workspaces and allocator rounding included. ``device_peak_valid`` is False when the
  counter had already been higher before the step (then the figure is only an upper bound).

Run with ``XLA_FLAGS=--xla_gpu_autotune_level=0`` so that autotuning scratch (the first
call of each primitive compiles) does not enter the peak.
"""
from __future__ import annotations

import json
import sys
import time

import jax


def device_bytes():
    st = jax.devices()[0].memory_stats()
    return (st["bytes_in_use"], st["peak_bytes_in_use"]) if st else (None, None)


def main():
    name, batch, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if which not in ("olla", "program"):
        raise SystemExit("ORDER must be 'olla' or 'program'")
    from jaxmem.bench.schedule import jax_step
    from jaxmem.schedule import execute, optimize, simulate, trace

    step, args = jax_step(name, batch, scale="paper")
    jax.block_until_ready(args)
    ts = trace(step, *args, donate_argnums=(0, 1, 2))
    row = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
           "model": name, "batch": batch, "order": which, "nodes": len(ts.graph.nodes),
           "program_peak": simulate(ts.graph)}
    if which == "olla":
        t0 = time.perf_counter()
        plan = optimize(ts.graph, time_limit=10, placement=True)
        order = plan.order
        row.update(plan_peak=plan.peak, lower_bound=plan.lower_bound, arena=plan.arena_size,
                   solve_s=round(time.perf_counter() - t0, 1), status=plan.status)
    else:
        order = ts.graph.program_order
    arg_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(args))
    in_use0, peak0 = device_bytes()
    t1 = time.perf_counter()
    out, stats = execute(ts, order, *args, measure=True)
    jax.block_until_ready(out)
    _, peak1 = device_bytes()
    row.update(seconds=round(time.perf_counter() - t1, 1), live_peak=stats.peak_live_bytes,
               predicted=stats.predicted_peak, arg_bytes=arg_bytes)
    if peak1 is not None:
        # the graph's peak counts the (donated/persistent) arguments: so does this figure
        row["device_peak"] = peak1 - in_use0 + arg_bytes
        row["device_peak_valid"] = bool(peak1 > peak0)
    loss = float(jax.tree_util.tree_leaves(out)[-1])
    row["loss"] = loss
    print(json.dumps(row), flush=True)
    if len(sys.argv) > 4:
        with open(sys.argv[4], "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
