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
* :func:`structural_lower_bound`, :func:`cut_lower_bound` — lower bounds of the optimal
  peak (tensors forced resident at a node; one minimum cut per node).
* :func:`inplace_update_graph` — the step with in-place weight updates (PyTorch's SGD).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from .graph import Graph

__all__ = ["Reach", "add_early_update_edges", "antichain_lower_bound", "cut_lower_bound",
           "edge_ranges", "expand_order", "inplace_update_graph", "levels", "spans",
           "structural_lower_bound"]


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


class _CutNetwork:
    """The closure network of :func:`cut_lower_bound`, built once, solved per node.

    ``value(i, forced_out)`` is the cheapest resident set at the step of node ``order[i]``
    over sets ``S`` of already-run nodes that are closed under predecessors, contain
    ``order[i]`` and its ancestors, and contain none of its descendants nor any node of
    ``forced_out`` (nor their descendants, by closure).
    """

    def __init__(self, graph: Graph, reach: Reach) -> None:
        import numpy as np

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
        import numpy as np
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
                    time_budget: float | None = None) -> int:
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
    """
    import time as _time

    import numpy as np

    t0 = _time.perf_counter()
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
    best = structural_lower_bound(graph, reach)
    # optimistic value per node: every tensor not produced by a descendant and not
    # consumed entirely by ancestors could be resident
    desc_masks = [_bits_to_bool(reach.desc[i], n) for i in range(n)] if anc is not None else None
    opt = np.zeros(n, dtype=np.int64)
    if anc is not None:
        A = np.stack(anc)
        D = np.stack(desc_masks)
        for k, e in enumerate(tensors):
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
        if time_budget is not None and _time.perf_counter() - t0 > time_budget:
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
    import time as _time

    t0 = _time.perf_counter()
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
        return time_budget is not None and _time.perf_counter() - t0 > time_budget

    def value(members: list[int], beat: int | None) -> int | None:
        """min over members of their cut; None as soon as it cannot exceed ``beat``."""
        lo = None
        for a in members:
            c = net.value(a, forced_out=[b for b in members if b != a])
            lo = c if lo is None else min(lo, c)
            if beat is not None and lo <= beat:
                return None
        return lo

    for v in dict.fromkeys(nodes):
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


def inplace_update_graph(graph: Graph) -> tuple[Graph, dict[str, list[str]]]:
    """The same step with *in-place* weight updates (PyTorch's ``optimizer.step()``, or
    XLA writing a fused ``p - lr * g`` into the donated buffer of ``p``).

    A traced out-of-place update ``o = p + (-lr * g)`` allocates a new parameter ``o``
    (and a temporary ``-lr * g``) while the old ``p`` is still alive. For every step
    output ``o`` whose producer ``u`` reads exactly one donated (non-persistent) input
    ``p`` of the same size, the returned graph

    * makes ``p`` persistent (the weight buffer lives all step, as in PyTorch) and ``o``
      a size-0 output (it is written into ``p``'s storage);
    * merges into ``u`` the producer ``m`` of a same-sized temporary read only by ``u``
      (the ``-lr * g`` of SGD): ``u`` then reads ``g`` directly, and frees it;
    * adds control edges ``r -> u`` from every other reader ``r`` of ``p`` (the old
      value must be read before it is overwritten).

    Returns ``(graph, groups)``: ``groups[u] = [m, u]`` lists the original nodes a merged
    node stands for (in execution order); :func:`expand_order` maps an order back.
    """
    merge: dict[str, str] = {}
    persist: set[str] = set()
    zero: set[str] = set()
    war: list[tuple[str, str]] = []
    for o in graph.edges.values():
        if not o.output or o.persistent or o.size == 0:
            continue
        u = o.src
        if len(graph.fanout(u)) != 1:
            continue
        fi = [graph.edges[e] for e in graph.fanin(u)]
        ps = [e for e in fi if graph.nodes[e.src].kind == "input" and not e.persistent
              and e.size == o.size and e.name not in persist]
        if len(ps) != 1:
            continue
        p = ps[0]
        ts = [e for e in fi if e.size == o.size and e is not p and e.sinks == (u,)
              and graph.nodes[e.src].kind not in ("input", "const")
              and len(graph.fanout(e.src)) == 1 and e.src not in merge]
        if len(ts) == 1:
            merge[ts[0].src] = u
        persist.add(p.name)
        zero.add(o.name)
        war += [(r, u) for r in p.sinks if r != u]
    h = Graph()
    groups: dict[str, list[str]] = {}
    for m, u in merge.items():
        groups[u] = [m, u]
    for v, node in graph.nodes.items():
        if v not in merge:
            h.add_node(v, node.kind, node.meta)
    for e in graph.edges.values():
        if e.src in merge:  # the merged temporary lives inside the update node
            continue
        sinks = [s for s in dict.fromkeys(merge.get(s, s) for s in e.sinks) if s != e.src]
        if e.name in persist:
            h.add_edge(e.name, e.src, sinks, e.size, persistent=True)
        elif e.name in zero:
            h.add_edge(e.name, e.src, sinks, 0)
        else:
            h.add_edge(e.name, e.src, sinks, e.size, persistent=e.persistent, output=e.output)
    for k, (r, u) in enumerate(war):
        r = merge.get(r, r)
        if r != u:
            h.add_edge(f"__war_{k}_{r}->{u}", r, [u], 0)
    h.validate()
    return h, groups


def expand_order(order: Iterable[str], groups: dict[str, list[str]]) -> list[str]:
    """Map an order of :func:`inplace_update_graph`'s graph to the original nodes."""
    out: list[str] = []
    for v in order:
        out.extend(groups.get(v, [v]))
    return out
