"""Resident set and peak memory of a node order (OLLA, section 2.2).

For an order ``v_0, ..., v_{n-1}`` (node ``v_t`` runs at step ``t``) a non-persistent tensor
``e`` is resident over the closed step range

    [ t(src(e)),  max_{s in snks(e)} t(s) ]      (just ``t(src(e))`` when it has no sink;
                                                   up to ``n - 1`` when it is an output)

so the resident set ``RS(t)`` holds the inputs and outputs of ``v_t`` plus every earlier
tensor still needed later. Persistent tensors are resident at every step. The peak is
``max_t sum_{e in RS(t)} S_e``; that is what an allocator with no fragmentation needs.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .graph import Graph

__all__ = ["lifetimes", "memory_profile", "simulate"]


def lifetimes(graph: Graph, order: Sequence[str], check: bool = True) -> dict[str, tuple[int, int]]:
    """``edge -> (first step, last step)`` (inclusive) for every non-persistent edge."""
    if check:
        graph.check_order(order)
    pos = {n: i for i, n in enumerate(order)}
    last = len(order) - 1
    out = {}
    for e in graph.edges.values():
        if e.persistent:
            continue
        start = pos[e.src]
        end = max((pos[s] for s in e.sinks), default=start)
        if e.output:
            end = last
        out[e.name] = (start, end)
    return out


def memory_profile(graph: Graph, order: Sequence[str], check: bool = True) -> np.ndarray:
    """Resident bytes at each step (int64 array of length ``len(order)``)."""
    spans = lifetimes(graph, order, check=check)
    diff = np.zeros(len(order) + 1, dtype=np.int64)
    for name, (a, b) in spans.items():
        size = graph.edges[name].size
        diff[a] += size
        diff[b + 1] -= size
    return np.cumsum(diff[:-1]) + graph.persistent_bytes()


def simulate(graph: Graph, order: Sequence[str] | None = None) -> int:
    """Peak resident bytes of ``order`` (default: program order). ValueError on an
    order that is not topological or does not list every node once."""
    if order is None:
        order = graph.program_order
    if not isinstance(order, (str, bytes)) and isinstance(order, Iterable):
        order = list(order)  # (a generator is read once)
    graph.check_order(order)  # an empty order only for an empty graph
    if len(order) == 0:
        return graph.persistent_bytes()
    return int(memory_profile(graph, order, check=False).max())


class _Tensors:
    """Non-persistent, non-empty tensors of a graph as index arrays (node index space), for
    the vectorised resident-set profile of many orders (local search: ``order``,
    ``relocate``). ``pos[v]`` is node ``v``'s step."""

    def __init__(self, graph: Graph, names: list[str]) -> None:
        idx = {v: i for i, v in enumerate(names)}
        self.n = len(names)
        self.src, self.size, self.out, self.readers = [], [], [], []
        self.touch: list[list[int]] = [[] for _ in names]  # node -> tensors it writes/reads
        for e in graph.edges.values():
            if e.persistent or e.size == 0:
                continue
            k = len(self.src)
            s = idx[e.src]
            rd = [idx[r] for r in e.sinks]  # readers in sink order (sinks are distinct)
            self.src.append(s)
            self.size.append(int(e.size))
            self.out.append(bool(e.output))
            self.readers.append(rd)
            for v in {s, *rd}:
                self.touch[v].append(k)
        self.src = np.asarray(self.src, dtype=np.int64)
        self.size = np.asarray(self.size, dtype=np.int64)
        self.out = np.asarray(self.out, dtype=bool)
        self.persistent = graph.persistent_bytes()
        # flat reader arrays (dead tensors: their producer stands in as the reader)
        flat, starts = [], []
        for k, rd in enumerate(self.readers):
            starts.append(len(flat))
            flat.extend(rd if rd else [int(self.src[k])])
        self.flat = np.asarray(flat, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)

    def ends(self, pos: np.ndarray) -> np.ndarray:
        """Last step of every tensor for node positions ``pos``."""
        if len(self.src) == 0:
            return np.zeros(0, dtype=np.int64)
        b = np.maximum.reduceat(pos[self.flat], self.starts)
        b = np.maximum(b, pos[self.src])
        b[self.out] = self.n - 1
        return b

    def profile(self, pos: np.ndarray) -> np.ndarray:
        if len(self.src) == 0:
            return np.full(self.n, self.persistent, dtype=np.int64)
        a = pos[self.src]
        b = self.ends(pos)
        diff = np.bincount(a, weights=self.size, minlength=self.n + 1)
        diff -= np.bincount(b + 1, weights=self.size, minlength=self.n + 1)
        return np.rint(np.cumsum(diff[:-1])).astype(np.int64) + self.persistent
