"""Structural analysis used to shrink the ILP (OLLA, section 4).

* :func:`spans` — ``SPAN(v) = [ASAP(v), ALAP(v)]``. The paper takes ASAP as the longest
  path from an input; because our schedules run exactly one node per step we use the
  tighter (still exact) bounds ``ASAP(v) = |ancestors(v)|`` and
  ``ALAP(v) = n - 1 - |descendants(v)|``: every ancestor must run before ``v`` and every
  descendant after it. On a chain every span is a single step.
* :func:`edge_ranges` — ``MUL(e) = [ASAP(src), max_s ALAP(s)]`` (where the tensor *may* be
  resident, eq. 11) and ``PRES(e) = [ALAP(src) + 1, max_s ASAP(s)]`` (where it *must* be,
  eq. 12).
* :class:`Reach` — reachability bitsets (the paper's memoised ``IsInTransitiveFanin``),
  used for precedence pruning of placement pairs (section 4.2).
* :func:`add_early_update_edges` — control edges that force weight updates to run early
  (section 4.3, Functions 3 and 4).
"""
from __future__ import annotations

from collections.abc import Iterable

from .graph import Graph

__all__ = ["Reach", "add_early_update_edges", "edge_ranges", "levels", "spans"]


class Reach:
    """Ancestor/descendant bitsets over a topological order (Python ints as bitsets)."""

    def __init__(self, graph: Graph, topo: list[str] | None = None) -> None:
        self.order = topo if topo is not None else graph.topological_order()
        self.index = {n: i for i, n in enumerate(self.order)}
        n = len(self.order)
        preds = [[self.index[p] for p in graph.preds(v)] for v in self.order]
        anc = [0] * n
        for i in range(n):
            a = 0
            for p in preds[i]:
                a |= anc[p] | (1 << p)
            anc[i] = a
        desc = [0] * n
        succs = [[self.index[s] for s in graph.succs(v)] for v in self.order]
        for i in range(n - 1, -1, -1):
            d = 0
            for s in succs[i]:
                d |= desc[s] | (1 << s)
            desc[i] = d
        self.anc = anc
        self.desc = desc

    def reaches(self, u: str, v: str) -> bool:
        """True iff ``v`` is in the transitive fanout of ``u`` (u must run before v)."""
        return bool(self.desc[self.index[u]] >> self.index[v] & 1)


def spans(graph: Graph, reach: Reach | None = None) -> dict[str, tuple[int, int]]:
    """``node -> (ASAP, ALAP)`` for sequential schedules of ``len(graph)`` steps."""
    reach = reach or Reach(graph)
    n = len(reach.order)
    return {
        v: (reach.anc[i].bit_count(), n - 1 - reach.desc[i].bit_count())
        for i, v in enumerate(reach.order)
    }


def edge_ranges(graph: Graph, span: dict[str, tuple[int, int]]):
    """``edge -> (MUL, PRES)`` step ranges (inclusive; PRES may be empty: lo > hi)."""
    n = len(graph.nodes)
    out = {}
    for e in graph.edges.values():
        a_src, l_src = span[e.src]
        if e.output:
            mul_end = n - 1
            pres_end = n - 1
        elif e.sinks:
            mul_end = max(span[s][1] for s in e.sinks)
            pres_end = max(span[s][0] for s in e.sinks)
        else:
            mul_end = l_src
            pres_end = -1
        out[e.name] = ((a_src, mul_end), (l_src + 1, pres_end))
    return out


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


def _bits_to_bool(bits: int, n: int):
    import numpy as np

    raw = bits.to_bytes((n + 7) // 8, "little")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n].astype(bool)


def structural_lower_bound(graph: Graph, reach: Reach | None = None) -> int:
    """A lower bound of the peak of *every* topological order.

    When node ``v`` runs, resident are: its inputs and outputs, every tensor produced by
    an ancestor of ``v`` and read by a descendant of ``v`` (it must survive ``v``'s step),
    every step output produced by an ancestor, and the persistent tensors. Moreover for an
    *update pair* — a tensor ``d`` read by the producer of a step output ``o`` (old and new
    weight) — one of the two is resident at every step after ``d`` exists, so
    ``min(S_d, S_o)`` is added where neither is already counted (each ``d`` used once).
    None of this depends on the order, so ``max_v`` bounds the optimum from below.
    """
    import numpy as np

    reach = reach or Reach(graph)
    n = len(reach.order)
    if n == 0:
        return graph.persistent_bytes()
    idx = reach.index
    A = np.stack([_bits_to_bool(reach.anc[i], n) for i in range(n)])  # A[v, u]: u anc of v
    D = np.stack([_bits_to_bool(reach.desc[i], n) for i in range(n)])
    D[np.arange(n), np.arange(n)] = True  # descendants or self
    total = np.zeros(n, dtype=np.int64)
    forced: dict[str, np.ndarray] = {}
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        s = idx[e.src]
        live = A[:, s].copy()
        if not e.output:
            if e.sinks:
                live &= D[:, [idx[k] for k in e.sinks]].any(axis=1)
            else:
                live[:] = False
        live[s] = True  # its own producer's step
        total += live * e.size
        forced[e.name] = live
    # update pairs: tensor d read by the producer of output o (old weight -> new weight).
    # Once d exists, d is resident until src(o) runs and o from then on: at every later
    # step at least min(S_d, S_o) of the pair is resident, even where neither is forced.
    used: set[str] = set()
    for o in graph.edges.values():
        if not o.output or o.persistent or o.size == 0:
            continue
        cands = [graph.edges[d] for d in graph.fanin(o.src)
                 if d not in used and d in forced and not graph.edges[d].output]
        if not cands:
            continue
        d = max(cands, key=lambda x: min(x.size, o.size))
        used.add(d.name)
        sd = idx[d.src]
        exists = A[:, sd].copy()
        exists[sd] = True
        neither = exists & ~forced[d.name] & ~forced[o.name]
        total += neither * min(d.size, o.size)
    return int(total.max()) + graph.persistent_bytes()
