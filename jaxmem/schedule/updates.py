"""Early weight updates (OLLA, section 4.3, Functions 3 and 4).

* :func:`levels` — forward and backward levelisation of the graph;
* :func:`add_early_update_edges` — size-0 control edges that force weight updates to run
  early, so their gradients are freed early.
"""
from __future__ import annotations

from collections.abc import Iterable

from .graph import Graph
from .reach import Reach

__all__ = ["add_early_update_edges", "levels"]


def levels(graph: Graph, topo: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Forward levels (longest path from a source) and backward levels (longest path to
    a sink) — the levelisations of Function 3."""
    fwd: dict[str, int] = {}
    for v in topo:
        fwd[v] = max((fwd[p] + 1 for p in graph.preds(v)), default=0)
    bwd: dict[str, int] = {}
    for v in reversed(topo):
        bwd[v] = max((bwd[s] + 1 for s in graph.succs(v)), default=0)
    return fwd, bwd


def add_early_update_edges(graph: Graph, update_nodes: Iterable[str] | None = None) -> Graph:
    """Return a copy of ``graph`` with size-0 control edges ``update -> anchor``.

    For each weight-update node ``u`` (default: nodes of kind ``"update"``) we search
    outwards from its fanin (Function 3) for an *anchor*: a node whose forward level
    exceeds ``u``'s (so no cycle can appear) and whose backward level is as high as
    possible (it runs early). The control edge bounds ``ALAP(u) < ALAP(anchor)``, so the
    update, and with it the freeing of its gradient, cannot drift to the end of the step.
    The search is Function 4's; it only adds an edge when it finds a candidate that
    is not already a descendant of ``u``'s and does not reach ``u`` (acyclicity is
    re-checked).
    """
    g = graph.copy()
    topo = g.topological_order()
    fwd, bwd = levels(g, topo)
    reach = Reach(g, topo)
    if update_nodes is None:
        update_nodes = [v for v, node in g.nodes.items() if node.kind == "update"]
    count = 0
    for u in update_nodes:
        if g.succs(u):
            continue  # already has readers: its ALAP is constrained by them
        min_fwd = fwd[u]
        visited: dict[str, tuple[str | None, int]] = {}

        def find(v: str, visited=visited, min_fwd=min_fwd) -> tuple[str | None, int]:
            # Function 4 (iterative-safe for moderate depths)
            if v in visited:
                return visited[v]
            visited[v] = (None, -1)
            best, best_lvl = None, -1
            for s in g.succs(v):
                if bwd[s] <= best_lvl:
                    continue
                if fwd[s] <= min_fwd:
                    cand, lvl = find(s)
                    if lvl > best_lvl:
                        best, best_lvl = cand, lvl
                else:
                    best, best_lvl = s, bwd[s]
            visited[v] = (best, best_lvl)
            return best, best_lvl

        starts = {u}
        anchor = None
        seen_starts: set[str] = set()
        while anchor is None and starts:
            nxt = {p for v in starts for p in g.preds(v)} - seen_starts
            seen_starts |= nxt
            starts = nxt
            best_lvl = -1
            for s in starts:
                cand, lvl = find(s)
                if cand is not None and lvl > best_lvl and not reach.reaches(cand, u) and cand != u:
                    anchor, best_lvl = cand, lvl
        if anchor is not None:
            g.add_edge(f"__ctrl_{count}_{u}->{anchor}", u, [anchor], 0)
            count += 1
    g.validate()
    return g
