"""Dataflow graph of a training step (framework neutral: plain Python).

A :class:`Graph` is the paper's DAG ``G = (V, E)`` (OLLA, section 3.1):

* a *node* is an operator (or a source: an input, a weight, a constant);
* an *edge* is a tensor: exactly one source node ``src(e)``, any number of sink nodes
  ``snks(e)``, and a size ``S_e`` in bytes. Size-0 edges are *control edges*: they only
  constrain the order (the paper uses them to force early weight updates, section 4.3).

Two flags extend the paper's model to what a caller of a training step sees:

* ``persistent=True``: the tensor is resident for the whole step, whatever the order
  (weights and inputs the caller keeps, constants). It adds a constant to every step's
  resident set and is placed once at the bottom of the arena.
* ``output=True``: the tensor is returned by the step, so once created it stays resident
  until the end of the step.

Nodes keep their insertion order: that is the *program order* (PyTorch's eager order, or
the order of a jaxpr's equations), the baseline every optimisation is compared with.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Edge", "Graph", "GraphError", "Node"]


class GraphError(ValueError):
    """An invalid graph (unknown node, duplicate name, negative size, cycle, ...)."""


class OutOfTime(Exception):
    """Internal: a budgeted stage passed its deadline (its caller keeps its best so far)."""


def check_size(where: str, value) -> int:
    """``value`` as a Python int number of bytes (>= 0): Python and numpy integers are
    accepted; bools, floats (even integral ones), strings and anything else are refused
    with a TypeError, negative sizes with a ValueError (a :class:`GraphError`)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{where}: size must be an int number of bytes (Python or numpy integer), got "
            f"{value!r} of type {type(value).__name__}")
    value = operator.index(value)
    if value < 0:
        raise GraphError(f"{where}: size must be >= 0 bytes, got {value}")
    return value


def _check_name(where: str, what: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where}: {what} must be a non-empty str, got {value!r}")
    return value


def _name_list(where: str, what: str, values) -> tuple[str, ...]:
    """A str or an iterable of str as a tuple of distinct names (order kept)."""
    if isinstance(values, str):
        values = [values]
    if values is None or isinstance(values, (bytes, dict)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{where}: {what} must be a node name (str) or an iterable of node names, "
            f"got {values!r}")
    values = list(values)
    for v in values:
        _check_name(where, f"every entry of {what}", v)
    return tuple(dict.fromkeys(values))


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    kind: str = "op"
    meta: dict | None = dataclasses.field(default=None, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class Edge:
    name: str
    src: str
    sinks: tuple[str, ...]
    size: int
    persistent: bool = False
    output: bool = False


class Graph:
    """A DAG of operators (nodes) exchanging tensors (edges with one source, many sinks).

    Example (the issue's 7-node graph; program order peaks at 150 bytes, the best at 130)::

        g = Graph()
        for n in "ABCDEFG":
            g.add_node(n)
        g.add_edge("ab", "A", ["B"], 10)
        g.add_edge("bc", "B", ["C"], 20)
        ...
    """

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.edges: dict[str, Edge] = {}
        self._fanin: dict[str, list[str]] = {}
        self._fanout: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ building
    def add_node(self, name: str, kind: str = "op", meta: dict | None = None) -> str:
        """Add an operator ``name``; ``kind`` is free text ("op", "input", "weight",
        "update", ...) used by heuristics (kind == "update" marks weight updates)."""
        _check_name("add_node", "name", name)
        if not isinstance(kind, str):
            raise TypeError(f"add_node {name!r}: kind must be a str, got {kind!r}")
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"add_node {name!r}: meta must be a dict or None, got {meta!r}")
        if name in self.nodes:
            raise GraphError(f"add_node: duplicate node name {name!r}")
        self.nodes[name] = Node(name, kind, meta)
        self._fanin[name] = []
        self._fanout[name] = []
        return name

    def add_edge(
        self,
        name: str,
        src: str,
        sinks: Iterable[str] | str,
        size: int,
        *,
        persistent: bool = False,
        output: bool = False,
    ) -> str:
        """Add tensor ``name`` produced by node ``src`` and read by nodes ``sinks``.

        Args:
          sinks: a node name or an iterable of node names (duplicates are merged).
          size: bytes, a Python or numpy int >= 0 (floats and bools raise TypeError);
            0 makes a control edge.
          persistent: resident for the whole step (weights/inputs held by the caller).
          output: returned by the step (resident from creation until the end).
        """
        _check_name("add_edge", "name", name)
        if name in self.edges:
            raise GraphError(f"add_edge: duplicate edge name {name!r}")
        _check_name(f"add_edge {name!r}", "src", src)
        sinks = _name_list(f"add_edge {name!r}", "sinks", sinks)
        size = check_size(f"add_edge {name!r}", size)
        if src not in self.nodes:
            raise GraphError(f"add_edge {name!r}: src {src!r} is not a node of the graph")
        for s in sinks:
            if s not in self.nodes:
                raise GraphError(f"add_edge {name!r}: sink {s!r} is not a node of the graph")
            if s == src:
                raise GraphError(f"add_edge {name!r}: self loop on node {s!r}")
        self.edges[name] = Edge(name, src, sinks, size, bool(persistent), bool(output))
        self._fanout[src].append(name)
        for s in sinks:
            self._fanin[s].append(name)
        return name

    def add_sinks(self, edge: str, sinks: Sequence[str]) -> None:
        """Add readers to an existing edge (used for aliases that extend a lifetime)."""
        e = self._edge("add_sinks", edge)
        sinks = _name_list(f"add_sinks {edge!r}", "sinks", sinks)
        new = tuple(s for s in sinks if s not in e.sinks)
        for s in new:
            if s not in self.nodes:
                raise GraphError(f"add_sinks {edge!r}: sink {s!r} is not a node")
            if s == e.src:
                raise GraphError(f"add_sinks {edge!r}: self loop on node {s!r}")
            self._fanin[s].append(edge)
        self.edges[edge] = dataclasses.replace(e, sinks=e.sinks + new)

    # ------------------------------------------------------------------ queries
    def _edge(self, where: str, edge) -> Edge:
        if not isinstance(edge, str) or edge not in self.edges:
            raise GraphError(f"{where}: {edge!r} is not an edge of the graph")
        return self.edges[edge]

    def _node(self, where: str, node) -> str:
        if not isinstance(node, str) or node not in self.nodes:
            raise GraphError(f"{where}: {node!r} is not a node of the graph")
        return node

    def fanin(self, node: str) -> list[str]:
        """Edges read by ``node`` (``fi(v)``)."""
        try:
            return self._fanin[node]
        except (KeyError, TypeError):
            self._node("fanin", node)
            raise

    def fanout(self, node: str) -> list[str]:
        """Edges written by ``node`` (``fo(v)``)."""
        try:
            return self._fanout[node]
        except (KeyError, TypeError):
            self._node("fanout", node)
            raise

    def preds(self, node: str) -> list[str]:
        """Producers of ``node``'s inputs (distinct, in fanin order)."""
        return list(dict.fromkeys(self.edges[e].src for e in self.fanin(node)))

    def succs(self, node: str) -> list[str]:
        """Readers of ``node``'s outputs (distinct, in fanout order)."""
        return list(
            dict.fromkeys(s for e in self.fanout(node) for s in self.edges[e].sinks)
        )

    @property
    def program_order(self) -> list[str]:
        """Nodes in insertion order (must be topological for a valid baseline)."""
        return list(self.nodes)

    def persistent_bytes(self) -> int:
        return sum(e.size for e in self.edges.values() if e.persistent)

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Graph({len(self.nodes)} nodes, {len(self.edges)} edges)"

    # ------------------------------------------------------------------ checks
    def topological_order(self) -> list[str]:
        """A topological order (Kahn, ties by insertion order); GraphError on a cycle."""
        import heapq

        index = {n: i for i, n in enumerate(self.nodes)}
        indeg = {n: len(self.preds(n)) for n in self.nodes}
        heap = [index[n] for n, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        names = list(self.nodes)
        order = []
        while heap:
            n = names[heapq.heappop(heap)]
            order.append(n)
            for s in self.succs(n):
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, index[s])
        if len(order) != len(self.nodes):
            raise GraphError(f"graph has a cycle: {' -> '.join(self._find_cycle(indeg))}")
        return order

    def _find_cycle(self, indeg: dict[str, int]) -> list[str]:
        """One cycle among the nodes Kahn's algorithm could not schedule (each of them
        has an unscheduled predecessor, so walking predecessors must close a loop)."""
        stuck = {n for n, d in indeg.items() if d > 0}
        walk, seen = [], {}
        v = next(n for n in self.nodes if n in stuck)
        while v not in seen:
            seen[v] = len(walk)
            walk.append(v)
            v = next(p for p in self.preds(v) if p in stuck)
        cycle = walk[seen[v]:][::-1]  # predecessor walk reversed: edges point forward
        index = {n: i for i, n in enumerate(self.nodes)}
        k = min(range(len(cycle)), key=lambda j: index[cycle[j]])  # start at the first added
        cycle = cycle[k:] + cycle[:k]
        return cycle + [cycle[0]]

    def validate(self) -> None:
        """Raise :class:`GraphError` if the graph is not a DAG."""
        self.topological_order()

    def check_order(self, order: Sequence[str]) -> None:
        """Raise ValueError unless ``order`` runs every node once, producers first."""
        if isinstance(order, str) or not isinstance(order, Iterable):
            raise TypeError(f"order: must be a sequence of node names, got {order!r}")
        order = list(order)
        bad = [v for v in order if not isinstance(v, str)]
        if bad:
            raise TypeError(f"order: node names must be str, got {bad[0]!r}")
        if len(order) != len(self.nodes) or set(order) != set(self.nodes):
            missing = set(self.nodes) - set(order)
            extra = set(order) - set(self.nodes)
            raise ValueError(
                f"order: must list every node exactly once (missing {sorted(missing)[:5]}, "
                f"unknown {sorted(extra)[:5]}, {len(order)} given for {len(self.nodes)} nodes)"
            )
        pos = {n: i for i, n in enumerate(order)}
        for e in self.edges.values():
            for s in e.sinks:
                if pos[s] <= pos[e.src]:
                    raise ValueError(
                        f"order: not topological: edge {e.name!r} runs sink {s!r} "
                        f"before its source {e.src!r}"
                    )

    def copy(self) -> Graph:
        g = Graph()
        g.nodes = dict(self.nodes)
        g.edges = dict(self.edges)
        g._fanin = {k: list(v) for k, v in self._fanin.items()}
        g._fanout = {k: list(v) for k, v in self._fanout.items()}
        return g
