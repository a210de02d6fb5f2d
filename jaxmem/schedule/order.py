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
import time
from collections.abc import Callable

from .graph import Graph, OutOfTime
from .simulate import _Tensors, simulate

__all__ = ["RULES", "best_greedy_order", "greedy_order"]


def _list_schedule(graph: Graph, key: Callable[[int, int, int], tuple],
                   deadline: float | None = None) -> list[str]:
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
    pops = 0
    while heap:
        pops += 1
        if deadline is not None and not pops & 255 and time.perf_counter() > deadline:
            raise OutOfTime("greedy order")
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


def best_greedy_order(graph: Graph, deadline: float | None = None
                      ) -> tuple[list[str], int, str]:
    """Try the program order (when topological; else Kahn's order) and every rule;
    return ``(order, peak, rule)`` of the lowest simulated peak. Past ``deadline`` (a
    ``time.perf_counter()`` value) the rules not yet run are skipped; the first candidate
    (linear time) is always there."""
    try:
        graph.check_order(graph.program_order)
        first = ("program_order", graph.program_order)
    except ValueError:
        first = ("topological", graph.topological_order())
    best = (first[1], simulate(graph, first[1]), first[0])
    for rule, key in RULES.items():
        if deadline is not None and time.perf_counter() > deadline:
            break
        try:
            order = _list_schedule(graph, key, deadline)
        except OutOfTime:
            break
        peak = simulate(graph, order)
        if peak < best[1]:
            best = (order, peak, rule)
    return best


def improve_order(graph: Graph, order: list[str], time_budget: float = 1.0,
                  target: int | None = None, reach=None) -> tuple[list[str], int]:
    """Local search on a topological ``order``: repeatedly move one node that touches the
    peak step — a producer of a tensor resident there to just before its first reader, or
    a reader that frees one to just after its last producer — or a block (that reader with
    its ancestors scheduled after the peak step, moved before it; that producer with its
    descendants scheduled before the peak step, moved after it), and keep the move when
    ``(peak, steps at the peak, total resident area)`` does not get worse and one of
    them improves. Stops at ``target`` (a lower bound), when no move helps, or after
    ``time_budget`` seconds (``reach``: a prebuilt :class:`~jaxmem.schedule.reach.Reach`
    of ``graph``). Returns ``(order, peak)``; the order stays topological."""
    import time as _time

    import numpy as np

    t0 = _time.perf_counter()
    names = list(graph.nodes)
    idx = {v: i for i, v in enumerate(names)}
    prof = _Tensors(graph, names)
    preds = [[idx[p] for p in graph.preds(v)] for v in names]
    succs = [[idx[s] for s in graph.succs(v)] for v in names]
    readers: list[list[int]] = []
    for k in range(len(prof.src)):
        lo = prof.starts[k]
        hi = prof.starts[k + 1] if k + 1 < len(prof.starts) else len(prof.flat)
        readers.append([int(x) for x in prof.flat[lo:hi]])
    from .reach import Reach

    if reach is None:
        try:
            reach = Reach(graph, deadline=t0 + time_budget)
        except OutOfTime:
            return list(order), simulate(graph, order)
    ridx = [reach.index[v] for v in names]
    anc = [reach.anc[ridx[i]] for i in range(len(names))]
    desc = [reach.desc[ridx[i]] for i in range(len(names))]
    seq = [idx[v] for v in order]
    pos = np.empty(len(seq), dtype=np.int64)
    pos[seq] = np.arange(len(seq))

    def block_move(kind: str, u: int, t_star: int):
        # pull: u and its ancestors between the peak step and u go just before the peak
        # step; push: u and its descendants between u and the peak step go just after it
        s_node = seq[t_star]
        if kind == "pull":
            if anc[u] >> ridx[s_node] & 1:
                return None
            window = seq[t_star + 1:int(pos[u])]
            blk = [x for x in window if anc[u] >> ridx[x] & 1] + [u]
            bs = set(blk)
            return seq[:t_star] + blk + [x for x in seq[t_star:] if x not in bs]
        if desc[u] >> ridx[s_node] & 1:
            return None
        window = seq[int(pos[u]) + 1:t_star]
        blk = [u] + [x for x in window if desc[u] >> ridx[x] & 1]
        bs = set(blk)
        return [x for x in seq[:t_star + 1] if x not in bs] + blk + seq[t_star + 1:]

    def score(p):
        pk = int(p.max())
        return (pk, int((p == pk).sum()), int(p.sum()))

    cur = score(prof.profile(pos))
    tabu: set = set()
    while _time.perf_counter() - t0 < time_budget:
        if target is not None and cur[0] <= target:
            break
        p = prof.profile(pos)
        pk = int(p.max())
        peak_steps = np.flatnonzero(p == pk)
        t_star = int(peak_steps[len(peak_steps) // 2])
        a, b = pos[prof.src], prof.ends(pos)
        live = np.flatnonzero((a < t_star) & (b > t_star))
        moves = []
        for k in live[np.argsort(-prof.size[live])]:
            u = int(prof.src[k])
            moves.append((u, "late"))
            for r in readers[k]:
                if pos[r] > t_star:
                    moves.append((r, "early"))
        for k in live[np.argsort(-prof.size[live])]:
            moves.append((int(prof.src[k]), "push"))
            moves += [(r, "pull") for r in readers[k] if pos[r] > t_star]
        improved = False
        for u, kind in dict.fromkeys(moves):
            if (u, kind, cur) in tabu:
                continue
            tabu.add((u, kind, cur))
            if _time.perf_counter() - t0 > time_budget:
                break
            if kind in ("push", "pull"):
                s2 = block_move(kind, u, t_star)
                if s2 is None:
                    continue
                pos2 = np.empty(len(s2), dtype=np.int64)
                pos2[s2] = np.arange(len(s2))
                sc = score(prof.profile(pos2))
                if sc < cur:
                    seq, pos, cur = s2, pos2, sc
                    improved = True
                    break
                continue
            old = int(pos[u])
            if kind == "late":
                far = min((int(pos[s]) for s in succs[u]), default=prof.n) - 1
                targets = [far, t_star] if far > t_star else [far]
            else:
                far = max((int(pos[q]) for q in preds[u]), default=-1) + 1
                targets = [far, t_star] if far < t_star else [far]
            for new in targets:
                if (kind == "late" and new <= old) or (kind == "early" and new >= old):
                    continue
                s2 = seq[:old] + seq[old + 1:]
                s2.insert(new, u)
                pos2 = pos.copy()
                lo, hi = min(old, new), max(old, new)
                pos2[s2[lo:hi + 1]] = np.arange(lo, hi + 1)
                sc = score(prof.profile(pos2))
                if sc < cur:
                    seq, pos, cur = s2, pos2, sc
                    improved = True
                    break
            if improved:
                break
        if not improved:
            break
    out = [names[i] for i in seq]
    return out, cur[0]
