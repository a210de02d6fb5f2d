"""OLLA plans realised on a device: measured peaks of the op-by-op executor.

    python benchmarks/gpu/schedule_exec.py MODEL BATCH SIZE [OUT.json]

One process per config (the device's peak counter only grows): the step of zoo model MODEL
(``vgg11`` or ``resnet18`` at width 1, ``SIZE`` x ``SIZE`` images, 1000 classes, SGD,
weights donated) is traced, optimised (10 s), then executed op by op twice on the default
device — first in the OLLA order, then in the program order — reporting for each:

* ``live_peak``: live-buffer peak (``jax.live_arrays``) measured by ``execute``;
* ``device_peak``: the allocator's ``peak_bytes_in_use`` above what was in use before the
  step (GPU only; the program-order figure is a max with the OLLA run, which ran first);
* the plan's predicted peaks, and XLA's compiled bytes of the whole-step ``jit``.
"""
from __future__ import annotations

import inspect
import json
import sys
import time

import jax
import jax.numpy as jnp
import optax


def step_and_args(name, batch, size):
    from jaxmem import models as M

    model = {"vgg11": lambda: M.vgg11(width=1.0, num_classes=1000),
             "resnet18": lambda: M.resnet18(width=1.0, num_classes=1000)}[name]()
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (batch, size, size, 3))
    y = jax.random.randint(k2, (batch,), 0, 1000)
    takes_train = "train" in inspect.signature(type(model).__call__).parameters
    variables = model.init(k3, x, train=False) if takes_train else model.init(k3, x)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    tx = optax.sgd(0.1)

    def loss_fn(p, state, x, y):
        kw = {"train": True} if takes_train else {}
        if state:
            out, ns = model.apply({"params": p, **state}, x, mutable=list(state), **kw)
        else:
            out, ns = model.apply({"params": p}, x, **kw), state
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), ns

    def step(params, state, opt, x, y):
        (loss, ns), g = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), ns, opt, loss

    return step, (params, state, tx.init(params), x, y)


def device_bytes():
    st = jax.devices()[0].memory_stats()
    return (st["bytes_in_use"], st["peak_bytes_in_use"]) if st else (None, None)


def main():
    name, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from jaxmem.measure import compiled_memory
    from jaxmem.schedule import execute, optimize, simulate, trace

    step, args = step_and_args(name, batch, size)
    ts = trace(step, *args, donate_argnums=(0, 1, 2))
    t0 = time.perf_counter()
    plan = optimize(ts.graph, time_limit=10, placement=True)
    row = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
           "model": name, "batch": batch, "size": size, "nodes": len(ts.graph.nodes),
           "program_peak": simulate(ts.graph), "plan_peak": plan.peak,
           "lower_bound": plan.lower_bound, "arena": plan.arena_size,
           "solve_s": round(time.perf_counter() - t0, 1), "status": plan.status}
    xla = compiled_memory(step, *args, donate_argnums=(0, 1, 2))
    row["xla_bytes"] = xla.total_bytes
    ref = jax.jit(step)(*args)
    for label, order in (("olla", plan.order), ("program", ts.graph.program_order)):
        fresh = jax.tree_util.tree_map(lambda a: a.copy(), args)
        jax.block_until_ready(fresh)
        in_use0, _ = device_bytes()
        t1 = time.perf_counter()
        out, stats = execute(ts, order, *fresh, measure=True)
        jax.block_until_ready(out)
        _, peak = device_bytes()
        row[f"{label}_seconds"] = round(time.perf_counter() - t1, 1)
        row[f"{label}_live_peak"] = stats.peak_live_bytes
        row[f"{label}_predicted"] = stats.predicted_peak
        row[f"{label}_device_peak"] = None if peak is None else peak - in_use0
        row[f"{label}_matches_jit"] = all(
            bool(jnp.allclose(a, b, rtol=1e-3, atol=1e-4))
            for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)))
        del out, fresh
    print(json.dumps(row), flush=True)
    if len(sys.argv) > 4:
        with open(sys.argv[4], "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
