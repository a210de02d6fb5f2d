"""jaxmem.schedule — OLLA: optimise the lifetime and location of a training step's arrays.

Framework-neutral core (plain Python + numpy + OR-Tools CP-SAT; importing it never
imports jax or torch):

* :class:`Graph` — dataflow graph (nodes = operators, edges = tensors in bytes);
* :func:`simulate` — peak resident bytes of a node order;
* :func:`optimize` -> :class:`Schedule` — ILP node ordering (eq. 14) + arena placement (eq. 15);
* :func:`place` — placement alone for fixed lifetimes;
* :func:`relocate_blocks`, :func:`improve_order` — local search on orders;
  :func:`cut_lower_bound`, :func:`antichain_lower_bound` — proven bounds of the best peak.

JAX front end (imported lazily): :func:`trace` (jaxpr -> Graph), :func:`execute` and
:class:`Scheduled` (run a step in the planned order, freeing buffers after last use);
:func:`apply_order` (re-emit a step in the order under ``jax.jit``, kept only where the
target's compiled plan, e.g. ``target="h100"``, is smaller).
"""
from __future__ import annotations

from jaxmem import _deprecation

from .bounds import antichain_lower_bound, cut_lower_bound, structural_lower_bound
from .graph import Edge, Graph, GraphError, Node
from .inplace import expand_order, inplace_update_graph
from .order import best_greedy_order, greedy_order, improve_order
from .place import best_fit_online, check_placement, peak_of_spans, place
from .plan import Schedule, node_lower_bound, optimize, validate_plan
from .relocate import relocate_blocks
from .simulate import lifetimes, memory_profile, simulate

_LAZY = {
    "trace": "jaxmem.schedule.jaxpr_graph",
    "TracedStep": "jaxmem.schedule.jaxpr_graph",
    "UnsupportedPrimitiveError": "jaxmem.schedule.jaxpr_graph",
    "execute": "jaxmem.schedule.executor",
    "Scheduled": "jaxmem.schedule.executor",
    "as_function": "jaxmem.schedule.xla",
    "apply_order": "jaxmem.schedule.xla",
    "AppliedOrder": "jaxmem.schedule.xla",
}

__all__ = [
    "Edge",
    "Graph",
    "GraphError",
    "Node",
    "Schedule",
    "antichain_lower_bound",
    "best_fit_online",
    "best_greedy_order",
    "check_placement",
    "cut_lower_bound",
    "expand_order",
    "greedy_order",
    "improve_order",
    "inplace_update_graph",
    "lifetimes",
    "memory_profile",
    "node_lower_bound",
    "optimize",
    "peak_of_spans",
    "place",
    "relocate_blocks",
    "simulate",
    "structural_lower_bound",
    "validate_plan",
]


def _lazy(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxmem.schedule' has no attribute {name!r}")


__getattr__ = _deprecation.deprecated_attributes(
    "jaxmem.schedule", {"Plan": ("jaxmem.schedule.plan:Schedule", "jaxmem.schedule.Schedule")},
    fallback=_lazy)
