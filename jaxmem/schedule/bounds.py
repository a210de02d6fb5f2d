"""Lower bounds of the optimal peak of every topological order.

* :func:`structural_lower_bound` — tensors forced resident at a node, plus update pairs;
* :func:`cut_lower_bound` — one minimum cut (a closure problem) per node;
* :func:`antichain_lower_bound` — the minimum of such cuts over the members of an antichain.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np

from .graph import Graph
from .reach import Reach, _bits_to_bool

__all__ = ["antichain_lower_bound", "cut_lower_bound", "structural_lower_bound"]


def structural_lower_bound(graph: Graph, reach: Reach | None = None,
                           deadline: float | None = None) -> int:
    """A lower bound of the peak of *every* topological order.

    When node ``v`` runs, resident are: its inputs and outputs, every tensor produced by
    an ancestor of ``v`` and read by a descendant of ``v`` (it must survive ``v``'s step),
    every step output produced by an ancestor, and the persistent tensors. Moreover for an
    *update pair* — a tensor ``d`` read by the producer of a step output ``o`` (old and new
    weight) — one of the two is resident at every step after ``d`` exists, so
    ``min(S_d, S_o)`` is added where neither is already counted (each ``d`` used once).
    None of this depends on the order, so ``max_v`` bounds the optimum from below.

    Cost ``O(|V| |E|)``, by blocks of nodes; past ``deadline`` (a ``time.perf_counter()``
    value) the maximum over the nodes done so far is returned (still a lower bound).
    """

    reach = reach or Reach(graph)
    n = len(reach.order)
    persistent = graph.persistent_bytes()
    if n == 0:
        return persistent
    idx = reach.index
    tensors = [e for e in graph.edges.values() if not e.persistent and e.size > 0]
    names = {e.name for e in tensors}
    # update pairs: tensor d read by the producer of output o (old weight -> new weight).
    # Once d exists, d is resident until src(o) runs and o from then on: at every later
    # step at least min(S_d, S_o) of the pair is resident, even where neither is forced.
    pairs = []
    used: set[str] = set()
    for o in tensors:
        if not o.output:
            continue
        cands = [graph.edges[d] for d in graph.fanin(o.src)
                 if d not in used and d in names and not graph.edges[d].output]
        if not cands:
            continue
        d = max(cands, key=lambda x: min(x.size, o.size))
        used.add(d.name)
        pairs.append((d, o))
    in_pair = {e.name for p in pairs for e in p}
    sink_idx = {e.name: [idx[k] for k in e.sinks] for e in tensors}
    best = 0
    block = max(64, min(n, (1 << 22) // n))
    for r0 in range(0, n, block):
        if deadline is not None and time.perf_counter() > deadline:
            break
        rows = np.arange(r0, min(n, r0 + block))
        # A[r, u]: u is an ancestor of node rows[r]; D[r, u]: u is rows[r] or a descendant
        A = np.stack([_bits_to_bool(reach.anc[i], n) for i in rows])
        D = np.stack([_bits_to_bool(reach.desc[i], n) for i in rows])
        D[np.arange(len(rows)), rows] = True
        total = np.zeros(len(rows), dtype=np.int64)
        forced: dict[str, np.ndarray] = {}
        for e in tensors:
            s = idx[e.src]
            live = A[:, s].copy()
            if not e.output:
                if sink_idx[e.name]:
                    live &= D[:, sink_idx[e.name]].any(axis=1)
                else:
                    live[:] = False
            if r0 <= s < r0 + len(rows):
                live[s - r0] = True  # its own producer's step
            total += live * e.size
            if e.name in in_pair:
                forced[e.name] = live
        for d, o in pairs:
            sd = idx[d.src]
            exists = A[:, sd].copy()
            if r0 <= sd < r0 + len(rows):
                exists[sd - r0] = True
            neither = exists & ~forced[d.name] & ~forced[o.name]
            total += neither * min(d.size, o.size)
        best = max(best, int(total.max()))
    return best + persistent


class _CutNetwork:
    """The closure network of :func:`cut_lower_bound`, built once, solved per node.

    ``value(i, forced_out)`` is the cheapest resident set at the step of node ``order[i]``
    over sets ``S`` of already-run nodes that are closed under predecessors, contain
    ``order[i]`` and its ancestors, and contain none of its descendants nor any node of
    ``forced_out`` (nor their descendants, by closure).
    """

    def __init__(self, graph: Graph, reach: Reach) -> None:

        self.graph, self.reach = graph, reach
        order = reach.order
        n = len(order)
        idx = reach.index
        self.persistent = graph.persistent_bytes()
        tensors = [e for e in graph.edges.values() if not e.persistent and e.size > 0]
        self.tensors = tensors
        g = 0
        for e in tensors:
            g = math.gcd(g, e.size)
        total = sum(e.size for e in tensors) // max(g, 1)
        unit = max(g, 1)
        if total > 2**30:  # int32 capacities: round sizes down (still a lower bound)
            unit = g * (-(-total // 2**30))
        self.unit = unit
        cap = {e.name: e.size // unit for e in tensors}
        self.big = sum(cap.values()) + 1
        self.src_n, self.snk_n = n + len(tensors), n + len(tensors) + 1
        self.N = self.snk_n + 1
        rows, cols, caps = [], [], []
        for u in order:
            for p in graph.preds(u):
                rows.append(idx[u]); cols.append(idx[p]); caps.append(self.big)
        self.ecap_pos = {}
        for k, e in enumerate(tensors):
            w = n + k
            s = idx[e.src]
            if e.output:
                self.ecap_pos[e.name] = len(caps)
                rows.append(s); cols.append(self.snk_n); caps.append(cap[e.name])
                continue
            if not e.sinks:
                continue
            self.ecap_pos[e.name] = len(caps)
            rows.append(s); cols.append(w); caps.append(cap[e.name])
            for r in e.sinks:
                rows.append(w); cols.append(idx[r]); caps.append(self.big)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.cols = np.asarray(cols, dtype=np.int64)
        self.caps = np.asarray(caps, dtype=np.int64)
        # per node (order index): its own input+output tensors, resident at its step
        self.local = [set(graph.fanin(v)) | set(graph.fanout(v)) for v in order]
        self.local_bytes = [sum(graph.edges[e].size for e in es if not graph.edges[e].persistent)
                            for es in self.local]

    def value(self, i: int, forced_out: Iterable[int] = ()) -> int:
        from scipy.sparse import csr_array
        from scipy.sparse.csgraph import maximum_flow

        graph, idx = self.graph, self.reach.index
        v = self.reach.order[i]
        const = self.persistent + self.local_bytes[i]
        c = self.caps.copy()
        for e in self.local[i]:
            p = self.ecap_pos.get(e)
            if p is not None:
                c[p] = 0
        extra_r = [self.src_n] + [idx[s] for s in graph.succs(v)] + [int(j) for j in forced_out]
        extra_c = [i] + [self.snk_n] * (len(extra_r) - 1)
        R = np.concatenate([self.rows, np.asarray(extra_r, dtype=np.int64)])
        Cc = np.concatenate([self.cols, np.asarray(extra_c, dtype=np.int64)])
        V = np.concatenate([c, np.full(len(extra_r), self.big, dtype=np.int64)])
        keep = V > 0
        M = csr_array((V[keep], (R[keep], Cc[keep])), shape=(self.N, self.N))
        M.sum_duplicates()
        M.data = np.minimum(M.data, 2**31 - 1).astype(np.int32)
        flow = maximum_flow(M, self.src_n, self.snk_n).flow_value
        return const + int(flow) * self.unit


def cut_lower_bound(graph: Graph, reach: Reach | None = None,
                    time_budget: float | None = None, floor: int | None = None) -> int:
    """A lower bound of the peak of every topological order by one minimum cut per node.

    At the step of node ``v`` in any order, the set ``S`` of nodes already run (``v``
    included) is closed under predecessors, contains ``v``'s ancestors and none of its
    descendants. Resident then are ``v``'s inputs and outputs, the persistent tensors,
    the step outputs produced in ``S``, and every tensor produced in ``S`` with a reader
    outside ``S``. The cheapest such ``S`` is a minimum s-t cut (a closure problem with
    one auxiliary vertex per tensor for its several readers):

    * ``u -> p`` (infinite) for every predecessor ``p`` of ``u`` (closure);
    * ``src(e) -> w_e`` with capacity ``S_e`` and ``w_e -> r`` (infinite) for every
      reader ``r``: ``S_e`` is paid when ``src(e)`` is in ``S`` and a reader is not;
    * ``src(e) -> sink`` with capacity ``S_e`` for step outputs;
    * ``source -> v`` and ``s -> sink`` for the successors ``s`` of ``v`` (infinite).

    ``max_v`` of (cut + the constant part) bounds the optimal peak from below. It is never
    weaker than :func:`structural_lower_bound`'s forced part (a forced tensor crosses
    every such cut) and is exact on the paper's examples where the peak sits at a
    single node. ``time_budget`` (seconds) stops early with the best bound so far.
    ``floor``: a known lower bound (default: :func:`structural_lower_bound`).
    """

    t0 = time.perf_counter()
    reach = reach or Reach(graph)
    order = reach.order
    n = len(order)
    persistent = graph.persistent_bytes()
    if n == 0:
        return persistent
    idx = reach.index
    net = _CutNetwork(graph, reach)
    tensors = net.tensors
    if not tensors:
        return persistent
    # candidate order: nodes with the largest optimistic value first; prune the rest
    anc = [_bits_to_bool(reach.anc[i], n) for i in range(n)] if n <= 4000 else None
    sizes = np.array([e.size for e in tensors], dtype=np.int64)
    src_i = np.array([idx[e.src] for e in tensors])
    best = structural_lower_bound(graph, reach) if floor is None else int(floor)
    # optimistic value per node: every tensor not produced by a descendant and not
    # consumed entirely by ancestors could be resident
    desc_masks = [_bits_to_bool(reach.desc[i], n) for i in range(n)] if anc is not None else None
    opt = np.zeros(n, dtype=np.int64)
    if anc is not None:
        A = np.stack(anc)
        D = np.stack(desc_masks)
        for k, e in enumerate(tensors):
            if time_budget is not None and time.perf_counter() - t0 > time_budget:
                return int(best)
            s = src_i[k]
            maybe = ~D[:, s]
            if not e.output:
                if not e.sinks:
                    maybe[:] = False
                else:
                    rd = [idx[r] for r in e.sinks]
                    maybe &= ~A[:, rd].all(axis=1)
            maybe[s] = True
            opt += maybe * sizes[k]
    else:
        opt[:] = sum(sizes)
    opt += persistent
    cand = np.argsort(-opt, kind="stable")
    for i in cand:
        if opt[i] <= best:
            break
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            break
        best = max(best, net.value(int(i)))
    return int(best)


def antichain_lower_bound(graph: Graph, nodes: Iterable[str], reach: Reach | None = None,
                          time_budget: float | None = None, floor: int = 0,
                          max_size: int = 4, max_partners: int = 120,
                          stop_at: int | None = None) -> int:
    """A lower bound from sets of mutually incomparable nodes (antichains).

    :func:`cut_lower_bound` lets every node pick its own cheapest "already run" set, so at
    a weight update's step it may assume the whole backward pass is done, and at the
    backward's next node that the update is. For an antichain ``A`` every order runs some
    ``a`` in ``A`` first, and at ``a``'s step no other member of ``A`` (nor any of their
    descendants) has run. Hence

        peak >= min_{a in A} cut(a | A - {a} not run)

    (each term one minimum cut, :func:`cut_lower_bound`'s network with the other members
    tied to the sink). ``A = {v}`` is the plain cut bound; pairs already certify the
    optimum of ResNet-18's batch-1 step, where every order must either update a big
    weight while the forward activations are alive or keep its gradient alive into the
    next layer's backward. Starting from each of ``nodes`` (e.g. the peak steps of the best
    order known), members are added greedily (the partner that raises the bound most,
    candidates ranked by their own input+output bytes, at most ``max_partners`` tried per
    round) up to ``max_size``. Returns the best bound found, at least ``floor``, as soon
    as it reaches ``stop_at`` (e.g. the peak of a known order) or ``time_budget`` runs out.
    """

    t0 = time.perf_counter()
    reach = reach or Reach(graph)
    n = len(reach.order)
    best = int(floor)
    if n < 2:
        return best
    net = _CutNetwork(graph, reach)
    if not net.tensors:
        return best
    idx = reach.index
    nodes = list(nodes)
    unknown = [v for v in nodes if v not in idx]
    if unknown:
        raise ValueError(f"nodes: {unknown[:3]!r} are not nodes of the graph")
    by_size = sorted(range(n), key=lambda j: -net.local_bytes[j])

    def out_of_time() -> bool:
        if stop_at is not None and best >= stop_at:
            return True
        return time_budget is not None and time.perf_counter() - t0 > time_budget

    def value(members: list[int], beat: int | None) -> int | None:
        """min over members of their cut; None as soon as it cannot exceed ``beat``."""
        lo = None
        for a in members:
            if out_of_time():
                return None
            c = net.value(a, forced_out=[b for b in members if b != a])
            lo = c if lo is None else min(lo, c)
            if beat is not None and lo <= beat:
                return None
        return lo

    for v in dict.fromkeys(nodes):
        if out_of_time():
            break
        members = [idx[v]]
        comparable = reach.anc[members[0]] | reach.desc[members[0]] | (1 << members[0])
        best = max(best, net.value(members[0]))
        # grow the antichain greedily to max_size (a weak intermediate set can still
        # become strong once the next member removes its cheap way out)
        while len(members) < max_size and not out_of_time():
            cand = [j for j in by_size if not comparable >> j & 1][:max_partners]
            top, top_j = None, None
            for j in cand:
                if out_of_time():
                    return best
                val = value(members + [j], top)
                if val is not None:
                    top, top_j = val, j
            if top_j is None:
                break
            best = max(best, top)
            members.append(top_j)
            comparable |= reach.anc[top_j] | reach.desc[top_j] | (1 << top_j)
    return int(best)
