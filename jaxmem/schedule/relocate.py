"""Block relocation: move a small group of nodes, as one contiguous block, to its best place.

A local-search neighbourhood for node orders that single-node moves cannot reach. A
training step's weight update is a short side chain ``g = dW(a, dy)`` -> ``t = -lr * g``
-> ``w' = w + t`` whose transient footprint is twice the weight; where the chain sits
decides whether that spike lands on top of the backward pass's high plateau (all
activations alive) or at its low end. Moving the producer ``dW`` alone is impossible (its
reader follows it) and moving the tail alone keeps ``g`` alive longer; moving the whole
chain is what helps. Blocks tried for a node ``u``:

* ``{u}`` itself;
* ``{u} + descendants(u)`` when small (a dangling side chain, moved later or earlier);
* ``{u} + its non-source ancestors`` when small (e.g. a weight transpose feeding ``u``).

For a block ``B`` (kept in its current internal order) and the order ``R`` of the other
nodes, inserting ``B`` before position ``X`` of ``R`` changes only tensors that touch
``B``, so the peak of *every* feasible ``X`` is computed at once in ``O(|R| + |X| |B|)``:

* a tensor read by ``B`` and produced outside is resident at rest steps ``j >= src`` up to
  the block (``j < X``), and after it only up to its last outside reader;
* a tensor produced in ``B`` is resident after the block up to its last outside reader
  (or to the end when it is a step output), never before;
* during the block, everything crossing the gap ``X`` plus ``B``'s own tensors.

``peak(X) = max(prefix max before X, block steps, suffix max from X)``. The move with the
lowest ``(peak, steps at the peak)`` wins; the order stays topological by construction
(``X`` lies after every outside predecessor and not after any outside successor of ``B``).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .graph import Graph, OutOfTime
from .reach import Reach, _bits_to_bool
from .simulate import _Tensors, simulate

__all__ = ["insertion_peaks", "relocate_blocks"]


def insertion_peaks(ts: _Tensors, seq: np.ndarray, in_block: np.ndarray,
                    preds: list[list[int]], succs: list[list[int]],
                    with_block_steps: bool = False):
    """Peak of every feasible placement of the block ``in_block`` (bool per node).

    Returns ``(rest, block, xs, peaks)``: the other nodes and the block's nodes in their
    current relative order, the feasible insertion positions ``X`` (the block goes before
    ``rest[X]``; ``X == len(rest)`` appends it) and the peak for each. Empty ``xs`` when
    no placement is feasible. ``with_block_steps`` adds, per ``X``, the highest resident
    set during the block's own steps.
    """
    rest = seq[~in_block[seq]]
    block = seq[in_block[seq]]
    m, k = len(rest), len(block)
    rpos = np.full(ts.n, -1, dtype=np.int64)
    rpos[rest] = np.arange(m)
    lo = max((int(rpos[q]) + 1 for b in block for q in preds[b] if not in_block[q]), default=0)
    hi = min((int(rpos[s]) for b in block for s in succs[b] if not in_block[s]), default=m)
    if hi < lo:
        empty = np.zeros(0, dtype=np.int64)
        return (rest, block, empty, empty, empty) if with_block_steps else \
            (rest, block, empty, empty)
    bidx = np.full(ts.n, -1, dtype=np.int64)
    bidx[block] = np.arange(k)
    touching = sorted({t for b in block for t in ts.touch[b]})
    tmask = np.zeros(len(ts.src), dtype=bool)
    tmask[touching] = True
    # rest-only profile (tensors not touching the block), over rest positions 0..m-1
    base = np.zeros(m + 1, dtype=np.float64)
    cross = np.zeros(m + 2, dtype=np.float64)  # tensors crossing gap X (src < X <= end)
    if len(ts.src):
        pos_r = rpos.copy()
        a = pos_r[ts.src]
        rd = np.maximum.reduceat(pos_r[ts.flat], ts.starts)
        e = np.maximum(a, rd)
        e[ts.out] = m  # a step output outlives every step, a block appended at the end too
        keep = ~tmask
        base += np.bincount(a[keep], weights=ts.size[keep], minlength=m + 1)
        base -= np.bincount(np.minimum(e[keep], m - 1) + 1, weights=ts.size[keep],
                            minlength=m + 1)
        cross += np.bincount(a[keep] + 1, weights=ts.size[keep], minlength=m + 2)
        cross -= np.bincount(e[keep] + 1, weights=ts.size[keep], minlength=m + 2)
    before = np.zeros(m + 2, dtype=np.float64)
    after = np.zeros(m + 2, dtype=np.float64)
    xs = np.arange(lo, hi + 1)
    spike = np.zeros((len(xs), k), dtype=np.float64)
    steps = np.arange(k)
    for t in touching:
        size = float(ts.size[t])
        s = int(ts.src[t])
        rdr = ts.readers[t]
        out_r = [int(rpos[r]) for r in rdr if not in_block[r]]
        in_r = [int(bidx[r]) for r in rdr if in_block[r]]
        # last rest position it must survive to; a step output survives everything (m)
        r_rest = m if ts.out[t] else max(out_r, default=-1)
        if not in_block[s]:  # produced outside, read by the block
            sp = int(rpos[s])
            before[sp] += size  # resident from its producer up to the block
            if r_rest >= sp:
                after[sp] += size
                after[r_rest + 1] -= size
            last_in = max(in_r)
            live = (steps[None, :] <= last_in) | (r_rest >= xs)[:, None]
            spike += size * live
        else:  # produced in the block
            ps = int(bidx[s])
            last_in = max(in_r, default=ps)
            if r_rest >= 0:
                # resident after the block up to r_rest, i.e. rest positions X .. r_rest
                live_b = steps >= ps
                spike += size * live_b[None, :]
                after[0] += size
                after[r_rest + 1] -= size
            else:
                live_b = (steps >= ps) & (steps <= last_in)
                spike += size * live_b[None, :]
    prof_base = np.cumsum(base)[:m]
    # 'before' holds step additions (resident from src onward for j < X)
    p_before = prof_base + np.cumsum(before)[:m]
    p_after = prof_base + np.cumsum(after)[:m]
    neg = -np.inf
    pre = np.concatenate([[neg], np.maximum.accumulate(p_before)])  # pre[X] = max_{j<X}
    suf = np.concatenate([np.maximum.accumulate(p_after[::-1])[::-1], [neg]])  # max_{j>=X}
    cr = np.cumsum(cross)[:m + 1]  # cr[X]: rest tensors with src <= X-1 and end >= X
    blk = (spike + cr[xs][:, None]).max(axis=1) if k else np.full(len(xs), neg)
    peaks = np.maximum(np.maximum(pre[xs], suf[xs]), blk) + ts.persistent
    if with_block_steps:
        return rest, block, xs, np.rint(peaks).astype(np.int64), \
            np.rint(blk + ts.persistent).astype(np.int64)
    return rest, block, xs, np.rint(peaks).astype(np.int64)


def _candidate_blocks(graph: Graph, names: list[str], max_block: int, reach=None,
                      deadline: float | None = None):
    """Per node: the node itself, with its descendants, with its non-source ancestors."""
    n = len(names)
    reach = reach if reach is not None else Reach(graph, deadline=deadline)
    ridx = np.asarray([reach.index[v] for v in names], dtype=np.int64)
    kinds = [graph.nodes[v].kind for v in names]
    source = np.asarray([k in ("input", "const") for k in kinds], dtype=bool)
    blocks: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for u in range(n):
        if deadline is not None and not u & 255 and time.perf_counter() > deadline:
            raise OutOfTime("candidate blocks")
        if source[u]:
            continue
        blocks[u].append((u, np.asarray([u], dtype=np.int64)))
        d = np.flatnonzero(_bits_to_bool(reach.desc[ridx[u]], n)[ridx])
        if 0 < len(d) < max_block:
            blocks[u].append((u, np.concatenate([[u], d])))
        a = np.flatnonzero(_bits_to_bool(reach.anc[ridx[u]], n)[ridx])
        a = a[~source[a]]
        if 0 < len(a) < max_block:
            blocks[u].append((u, np.concatenate([a, [u]])))
    return blocks


def relocate_blocks(graph: Graph, order: Sequence[str], time_budget: float = 1.0,
                    target: int | None = None, max_block: int = 16,
                    kicks: int = 8, reach=None) -> tuple[list[str], int]:
    """Improve a topological ``order`` by moving blocks of nodes (see the module docstring).

    Descent: each round looks at the nodes that touch a peak step (run there, or produce
    or read a tensor resident there), evaluates every feasible position of each of their
    blocks, and applies the best move if it lowers ``(peak, number of peak steps)``.
    Kicks: when no single move helps (e.g. three weight-update chains sit on the same
    plateau and moving one keeps its small inputs alive under the other two), up to
    ``kicks`` blocks at the peak are moved to their best *other* position even though
    that is worse, the descent is rerun, and the result is kept only if it beats the
    order before the kick. Stops at ``target``, when nothing helps, or after
    ``time_budget`` seconds. Returns ``(order, peak)``; never worse than the input.
    """
    graph.check_order(order)
    t0 = time.perf_counter()
    deadline = t0 + time_budget
    names = list(graph.nodes)
    n = len(names)
    idx = {v: i for i, v in enumerate(names)}
    ts = _Tensors(graph, names)
    seq = np.asarray([idx[v] for v in order], dtype=np.int64)
    if n < 2:
        return [names[i] for i in seq], int(ts.profile(np.arange(n, dtype=np.int64)).max(
            initial=ts.persistent))
    preds = [[idx[p] for p in graph.preds(v)] for v in names]
    succs = [[idx[s] for s in graph.succs(v)] for v in names]
    try:
        blocks = _candidate_blocks(graph, names, max_block, reach, deadline)
    except OutOfTime:
        return list(order), simulate(graph, order)

    def positions(sq: np.ndarray) -> np.ndarray:
        p = np.empty(n, dtype=np.int64)
        p[sq] = np.arange(n)
        return p

    def score(p: np.ndarray) -> tuple[int, int]:
        prof = ts.profile(p)
        pk = int(prof.max())
        return pk, int((prof == pk).sum())

    def peak_blocks(sq: np.ndarray, pos: np.ndarray, pk: int):
        """Distinct candidate blocks of the nodes that touch a step at peak ``pk``."""
        prof = ts.profile(pos)
        hot = np.flatnonzero(prof == pk)
        rel = np.zeros(n, dtype=bool)
        rel[sq[hot]] = True
        if len(ts.src):
            a, b = pos[ts.src], ts.ends(pos)
            live = np.zeros(len(ts.src), dtype=bool)
            for t in hot:
                live |= (a <= t) & (b >= t)
            for k in np.flatnonzero(live):
                rel[ts.src[k]] = True
                rel[ts.readers[k]] = True
        seen: set[tuple[int, ...]] = set()
        out = []
        for u in np.flatnonzero(rel):
            for _u, blk in blocks[u]:
                key = tuple(sorted(blk.tolist()))
                if key not in seen:
                    seen.add(key)
                    out.append(blk)
        return out

    def placements(sq: np.ndarray, blk: np.ndarray, with_block_steps: bool = False):
        in_block = np.zeros(n, dtype=bool)
        in_block[blk] = True
        return insertion_peaks(ts, sq, in_block, preds, succs, with_block_steps)

    def descend(sq: np.ndarray, cur: tuple[int, int]):
        pos = positions(sq)
        while time.perf_counter() < deadline:
            if target is not None and cur[0] <= target:
                break
            best = None
            for blk in peak_blocks(sq, pos, cur[0]):
                if time.perf_counter() > deadline:
                    break
                rest, block, xs, peaks = placements(sq, blk)
                if len(xs) == 0:
                    continue
                lowest = int(peaks.min())
                if lowest > cur[0]:
                    continue
                # only the lowest-peak positions can beat the current score: score them
                for x in xs[peaks == lowest][:8]:
                    s2 = np.concatenate([rest[:x], block, rest[x:]])
                    p2 = positions(s2)
                    sc = score(p2)
                    if sc < cur and (best is None or sc < best[0]):
                        best = (sc, s2, p2)
            if best is None:
                break
            cur, sq, pos = best
        return sq, cur

    cur = score(positions(seq))
    seq, cur = descend(seq, cur)
    while time.perf_counter() < deadline and (target is None or cur[0] > target):
        pos = positions(seq)
        kicked = []
        for blk in peak_blocks(seq, pos, cur[0]):
            rest, block, xs, peaks, own = placements(seq, blk, True)
            x_now = int(np.isin(rest, seq[:pos[block[0]]]).sum())  # X of the current spot
            # the kick: a position where the block's own steps are below the current peak
            # and the peak elsewhere rises least; the cheapest kicks are tried first
            now = xs == x_now
            if not now.any() or int(own[now][0]) < cur[0]:
                continue  # the block does not sit on a peak step
            cand = np.flatnonzero(~now & (own < cur[0]))
            if len(cand):
                j = cand[np.lexsort((own[cand], peaks[cand]))[0]]
                kicked.append((int(peaks[j]), rest, block, int(xs[j])))
        kicked.sort(key=lambda k: k[0])
        improved = False
        for _pk, rest, block, x in kicked[:kicks]:
            if time.perf_counter() > deadline:
                break
            s2 = np.concatenate([rest[:x], block, rest[x:]])
            s2, sc = descend(s2, score(positions(s2)))
            if sc < cur:
                seq, cur, improved = s2, sc, True
                break
        if not improved:
            break
    return [names[i] for i in seq], cur[0]
