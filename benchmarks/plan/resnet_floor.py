"""What bounds the smallest compiled plan of ResNet-50 (quick case of ``bench_plan.py``).

Builds the planner's steps directly (every unit recomputed; one segment over the whole
network), compiles them and sorts what is live at the peak (``jaxmem.measure.live_peak``) into
kinds: arguments, results of the backward ``cond``s outside their branch (parameter
gradients, the cotangent handed to the next unit), forward values kept for the backward
(unit inputs), and the working set inside the ``cond`` branch that is running (recompute +
VJP of one unit). Then it tries a nested recomputation: a recomputed unit whose own
backward recomputes its children as fenced sub-chunks, so that only the sub-chunks'
inputs and one sub-chunk's working set are live inside the unit's backward.

    .venv/bin/python benchmarks/plan/resnet_floor.py [--check] [--gpt] [--scope]

``--check`` also compares the nested step's gradients with the untouched loss's and with
the planner's per-unit step (fp32, the arguments of ``resnet_case``).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import jaxmem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import gpt_case, resnet_case

from jaxmem.measure import compiled_memory, live_peak
from jaxmem.planner import trace as T
from jaxmem.planner.api import _make_step

MIB = 2.0**20


def peak_kinds(fn, *args) -> dict[str, float]:
    """MiB per kind of what is live at the compiled ``fn``'s peak: its arguments, and the
    values of its temp allocation live there (:func:`jaxmem.measure.live_peak`), sorted by
    the JAX op that defines them."""
    peak = live_peak(fn, *args)
    kinds = {"arguments": compiled_memory(fn, *args).argument_bytes / MIB}
    for b in peak.buffers:
        op = b.op_name
        if b.name.startswith("conditional"):
            k = "cond results (parameter gradients, cotangents)"
        elif "/cond" in op:
            k = "inside the running cond branch (recompute + VJP)"
        elif "jvp(" in op and "transpose(" not in op:
            k = "forward values kept (unit inputs)"
        elif not op:
            k = "unattributed XLA buffers (copies, layout changes)"
        else:
            k = "other backward values"
        kinds[k] = kinds.get(k, 0.0) + b.bytes / MIB
    return kinds


def _bottleneck_part(label: str) -> str:
    """The bottleneck's parts: main branch up to the 3x3 conv, its last conv + BN, the
    downsample branch, the join (add + relu)."""
    child = label.split("/", 1)[1] if "/" in label else ""
    if child.startswith(("conv1", "bn1", "conv2", "bn2")):
        return "main"
    if child.startswith(("conv3", "bn3")):
        return "last"
    if child.startswith("downsample"):
        return "downsample"
    return "join"


def nested_step(loss, args, grouping: str, factory=None):
    """Every top unit recomputed; inside its backward, its children (``grouping``: "each"
    child, or the bottleneck "parts") are recomputed as fenced sub-chunks."""
    tr = T.trace(loss, args, factory() if factory else None)
    top = T.choose_units(tr)
    fine = T.choose_units(tr, max_units=10_000, finer=1)
    jx = tr.closed.jaxpr
    rec = T.POLICIES["recompute"]

    def subs_of(u):
        groups: list[tuple[str, T.Unit]] = []
        for s in (s for s in fine if u.start <= s.start and s.stop <= u.stop):
            k = s.label if grouping == "each" else _bottleneck_part(s.label)
            if groups and groups[-1][0] == k:
                g = groups[-1][1]
                groups[-1] = (k, T.Unit(g.label, g.start, s.stop, g.depth))
            else:
                groups.append((k, s))
        return [g for _, g in groups]

    def unit_fn(u):
        ins, outs = T.chunk_io(jx, u.start, u.stop)
        subs = subs_of(u)
        if len(subs) <= 1:
            return T.chunk_fn(jx, u.start, u.stop, ins, outs), ins, outs

        def f(*vals):
            env = dict(zip(ins, vals))
            for s in subs:
                si, so = T.chunk_io(jx, s.start, s.stop)
                g = T.fenced_checkpoint(T.chunk_fn(jx, s.start, s.stop, si, so), rec)
                env.update(zip(so, g(*[env[v] for v in si])))
            return [env[v] for v in outs]

        return f, ins, outs

    def step(*a):
        env = dict(zip(jx.constvars, tr.closed.consts))
        env.update(zip(jx.invars, jax.tree_util.tree_leaves(a)))
        for u in top:
            f, ins, outs = unit_fn(u)
            env.update(zip(outs, T.fenced_checkpoint(f, rec)(*[env[v] for v in ins])))
        return env[jx.outvars[0]]

    return step


def _max_rel(g0, g1) -> float:
    return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
               for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--gpt", action="store_true", help="GPT (quick) instead of ResNet-50")
    ap.add_argument("--scope", action="store_true", help="trace under jaxmem.scope()")
    a = ap.parse_args()
    name, loss, args = (gpt_case if a.gpt else resnet_case)(True)
    factory = jaxmem.scope if a.scope else None
    cm = compiled_memory(jax.value_and_grad(loss), *args)
    base = cm.total_bytes
    print(f"{name}: default {base / MIB:.2f} MiB; arguments {cm.argument_bytes / MIB:.2f} + "
          f"outputs {cm.output_bytes / MIB:.2f} MiB", flush=True)
    tr = T.trace(loss, args, factory() if factory else None)
    labels = [u.label for u in T.choose_units(tr)]
    cuts = [lbl for lbl in labels if lbl != "(rest)"]
    per_unit = _make_step(loss, factory, cuts, [((lbl,), "recompute") for lbl in labels], {})
    segment = _make_step(loss, factory, cuts, [(tuple(labels), "segment")], {})
    for nm, s in (("every unit recomputed", per_unit), ("one whole-network segment", segment)):
        c = compiled_memory(jax.value_and_grad(s), *args)
        print(f"{nm}: {c.total_bytes / MIB:.2f} MiB ({c.total_bytes / base:.3f}x), "
              f"temp {c.temp_bytes / MIB:.2f} MiB", flush=True)
        for k, v in sorted(peak_kinds(jax.value_and_grad(s), *args).items(), key=lambda t: -t[1]):
            print(f"    {v:6.2f} MiB  {k}", flush=True)
    g0 = g1 = None
    for grouping in ("each",) if a.gpt else ("each", "parts"):
        s = nested_step(loss, args, grouping, factory)
        c = compiled_memory(jax.value_and_grad(s), *args)
        print(f"nested ({grouping}): {c.total_bytes / MIB:.2f} MiB "
              f"({c.total_bytes / base:.3f}x)", flush=True)
        if a.check:
            if g0 is None:
                g0 = jax.jit(jax.grad(loss))(*args)
                g1 = jax.jit(jax.grad(per_unit))(*args)
            g2 = jax.jit(jax.grad(s))(*args)
            print(f"    max rel grad diff vs untouched {_max_rel(g0, g2):.2e}, "
                  f"per-unit plan vs untouched {_max_rel(g0, g1):.2e}, "
                  f"nested vs per-unit plan {_max_rel(g1, g2):.2e}", flush=True)


if __name__ == "__main__":
    main()
