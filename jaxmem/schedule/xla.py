"""Re-emit a traced step in a planned order as one traceable function (for ``jax.jit``).

XLA schedules a jitted computation itself, so the order of equations in a jaxpr is only
a hint. :func:`as_function` rebuilds the step from a node order and can insert
``lax.optimization_barrier`` fences: the order is cut into ``chunks`` consecutive
pieces and, at each cut, every value still needed later passes through one barrier, so
nothing after the cut can be hoisted above it and nothing before it sunk below. This is
the experiment behind "can the plan lower XLA's compiled bytes?" (see README.md (schedule section)
and ``benchmarks/schedule/xla_barriers.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax

from .executor import _bind
from .jaxpr_graph import TracedStep

__all__ = ["as_function"]


def as_function(ts: TracedStep, order: Sequence[str] | None = None, chunks: int = 1):
    """A function of the *flat* inputs returning the flat outputs, evaluating the
    equations in ``order`` (default: program order) with ``chunks - 1`` barrier cuts."""
    g = ts.graph
    order = list(order) if order is not None else g.program_order
    g.check_order(order)
    if not (isinstance(chunks, int) and chunks >= 1):
        raise ValueError(f"chunks: must be an int >= 1, got {chunks!r}")
    pos = {v: t for t, v in enumerate(order)}
    last = {}
    for vid, ename in ts.edge_of.items():
        e = g.edges[ename]
        last[vid] = len(order) if (e.output or e.persistent) else max(
            (pos[s] for s in e.sinks), default=pos[e.src])
    op_steps = [t for t, v in enumerate(order) if v in ts.node_eqn]
    cuts = set()
    if chunks > 1 and op_steps:
        k = len(op_steps)
        cuts = {op_steps[(i * k) // chunks] for i in range(1, chunks)}
    in_pos = {name: k for k, name in enumerate(n for n in g.nodes if n.startswith("in:"))}
    const_of = {g.edges[ts.edge_of[i]].src: i for i in ts.consts if i in ts.edge_of}

    def fn(*flat_args):
        env = {}

        def read(a):
            if isinstance(a, tuple):
                return a[1]
            if a in ts.views:
                veq, src = ts.views[a]
                return _bind(veq, [read(src)] + [b[1] for b in veq.invars[1:]])[0]
            return env[a]

        for t, node in enumerate(order):
            if t in cuts:
                keys = [k for k in env if last.get(k, len(order)) >= t]
                vals = jax.lax.optimization_barrier([env[k] for k in keys])
                env.update(zip(keys, vals))
            if node in in_pos:
                env[ts.in_ids[in_pos[node]]] = flat_args[in_pos[node]]
            elif node in const_of:
                env[const_of[node]] = ts.consts[const_of[node]]
            else:
                eq = ts.node_eqn[node]
                outs = _bind(eq, [read(a) for a in eq.invars])
                for o, val in zip(eq.outvars, outs):
                    if o is not None:
                        env[o] = val
        return [read(a) for a in ts.out_ids]

    return fn
