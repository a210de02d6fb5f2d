"""In-place weight updates: the step as PyTorch's ``optimizer.step()`` runs it.

* :func:`inplace_update_graph` — rewrite out-of-place updates into in-place ones;
* :func:`expand_order` — map an order of the rewritten graph back to the original nodes.
"""
from __future__ import annotations

from collections.abc import Iterable

from .graph import Graph

__all__ = ["expand_order", "inplace_update_graph"]


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
