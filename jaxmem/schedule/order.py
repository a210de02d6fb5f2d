"""Greedy node orders: the always-available fallback and the ILP's warm start.

List scheduling over the ready set (nodes whose producers have all run). A node's
*delta* is ``bytes it allocates - bytes it frees`` (outputs minus inputs for which it is
the last remaining reader). Several priority rules are tried and the order with the lowest
simulated peak wins:

* ``program``: lowest program index first (the baseline order itself);
* ``free_first``: nodes with ``delta <= 0`` first (weight updates, frees), then program
  order — "run what frees memory as soon as it can";
* ``min_delta``: smallest delta first, ties by program index;
* ``lookahead``: like ``free_first`` but a node producing big outputs is deferred while a
  ready node with a smaller delta exists.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from .graph import Graph
from .simulate import simulate

__all__ = ["RULES", "best_greedy_order", "greedy_order"]


def _list_schedule(graph: Graph, key: Callable[[int, int, int], tuple]) -> list[str]:
    names = list(graph.nodes)
    index = {n: i for i, n in enumerate(names)}
    preds = {n: set(graph.preds(n)) for n in names}
    indeg = {n: len(p) for n, p in preds.items()}
    remaining = {e.name: len(e.sinks) for e in graph.edges.values()}
    out_bytes = {
        n: sum(graph.edges[e].size for e in graph.fanout(n) if not graph.edges[e].persistent)
        for n in names
    }
    fanin_sizes = {
        n: [(e, graph.edges[e].size) for e in graph.fanin(n)
            if not graph.edges[e].persistent and not graph.edges[e].output]
        for n in names
    }

    def delta(n: str) -> int:
        freed = sum(s for e, s in fanin_sizes[n] if remaining[e] == 1)
        return out_bytes[n] - freed

    ready = {n for n in names if indeg[n] == 0}
    order = []
    # deltas change as other readers run, so recompute over the ready set (O(n * ready));
    # a heap with lazy invalidation keeps it fast on big graphs
    heap = [(key(delta(n), index[n], out_bytes[n]), n) for n in ready]
    heapq.heapify(heap)
    stamp = {n: heap_key for heap_key, n in heap}
    while heap:
        k, n = heapq.heappop(heap)
        if n not in ready or stamp[n] != k:
            continue
        ready.discard(n)
        order.append(n)
        touched = set()
        for e in graph.fanin(n):
            remaining[e] -= 1
            if remaining[e] == 1:
                touched.update(graph.edges[e].sinks)
        for s in graph.succs(n):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.add(s)
                touched.add(s)
        for t in touched:
            if t in ready:
                nk = key(delta(t), index[t], out_bytes[t])
                if stamp.get(t) != nk:
                    stamp[t] = nk
                    heapq.heappush(heap, (nk, t))
    if len(order) != len(names):
        graph.validate()  # raises the cycle error
    return order


RULES: dict[str, Callable[[int, int, int], tuple]] = {
    "program": lambda d, i, o: (i,),
    "free_first": lambda d, i, o: (d > 0, i),
    "min_delta": lambda d, i, o: (d, i),
    "lookahead": lambda d, i, o: (d > 0, max(0, d), i),
}


def greedy_order(graph: Graph, rule: str = "free_first") -> list[str]:
    """One list-scheduling order with priority rule ``rule`` (one of :data:`RULES`)."""
    if rule not in RULES:
        raise ValueError(f"rule: must be one of {sorted(RULES)}, got {rule!r}")
    return _list_schedule(graph, RULES[rule])


def best_greedy_order(graph: Graph) -> tuple[list[str], int, str]:
    """Try every rule (and the program order if it is topological); return
    ``(order, peak, rule)`` of the lowest simulated peak."""
    best = None
    candidates = []
    try:
        graph.check_order(graph.program_order)
        candidates.append(("program_order", graph.program_order))
    except ValueError:
        pass
    for rule in RULES:
        candidates.append((rule, greedy_order(graph, rule)))
    for rule, order in candidates:
        peak = simulate(graph, order)
        if best is None or peak < best[1]:
            best = (order, peak, rule)
    return best
