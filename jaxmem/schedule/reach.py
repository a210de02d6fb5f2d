"""Reachability and step ranges (OLLA, sections 4.1 and 4.2).

* :class:`Reach` — ancestor/descendant bitsets (the paper's memoised
  ``IsInTransitiveFanin``), used for precedence pruning and the spans below.
* :func:`spans` — ``SPAN(v) = [ASAP(v), ALAP(v)]``. The paper takes ASAP as the longest
  path from an input; because our schedules run exactly one node per step we use the
  tighter (still exact) bounds ``ASAP(v) = |ancestors(v)|`` and
  ``ALAP(v) = n - 1 - |descendants(v)|``: every ancestor must run before ``v`` and every
  descendant after it. On a chain every span is a single step.
* :func:`edge_ranges` — ``MUL(e) = [ASAP(src), max_s ALAP(s)]`` (where the tensor *may* be
  resident, eq. 11) and ``PRES(e) = [ALAP(src) + 1, max_s ASAP(s)]`` (where it *must* be,
  eq. 12).
"""
from __future__ import annotations

import time

import numpy as np

from .graph import Graph, OutOfTime

__all__ = ["Reach", "edge_ranges", "spans"]


class Reach:
    """Ancestor/descendant bitsets over a topological order (Python ints as bitsets)."""

    def __init__(self, graph: Graph, topo: list[str] | None = None,
                 deadline: float | None = None) -> None:
        """``deadline`` (a ``time.perf_counter()`` value): raise :class:`OutOfTime` past
        it (building costs ``O(n^2 / 64)`` word operations)."""
        self.order = topo if topo is not None else graph.topological_order()
        self.index = {n: i for i, n in enumerate(self.order)}
        n = len(self.order)
        preds = [[self.index[p] for p in graph.preds(v)] for v in self.order]
        succs = [[self.index[s] for s in graph.succs(v)] for v in self.order]
        self.anc = _closure(preds, range(n), deadline)
        self.desc = _closure(succs, range(n - 1, -1, -1), deadline)

    def reaches(self, u: str, v: str) -> bool:
        """True iff ``v`` is in the transitive fanout of ``u`` (u must run before v)."""
        return bool(self.desc[self.index[u]] >> self.index[v] & 1)


def _closure(nbrs: list[list[int]], visit, deadline: float | None) -> list[int]:
    """``bits[i] = OR_{j in nbrs[i]} (bits[j] | 1 << j)``, computed in ``visit`` order
    (every ``j`` in ``nbrs[i]`` visited before ``i``): the transitive closure of ``nbrs``
    as bitsets. :class:`OutOfTime` past ``deadline``."""
    bits = [0] * len(nbrs)
    for i in visit:
        if deadline is not None and not i & 511 and time.perf_counter() > deadline:
            raise OutOfTime("Reach")
        b = 0
        for j in nbrs[i]:
            b |= bits[j] | (1 << j)
        bits[i] = b
    return bits


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


def _bits_to_bool(bits: int, n: int) -> np.ndarray:
    """The bitset ``bits`` as a bool array of length ``n`` (bit ``i`` -> entry ``i``)."""
    raw = bits.to_bytes((n + 7) // 8, "little")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n].astype(bool)
