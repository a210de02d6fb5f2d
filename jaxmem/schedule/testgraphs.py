"""Seeded synthetic graphs for tests and benchmarks of the scheduler.

* :func:`chain` — a path ``n0 -> n1 -> ...``: it has exactly one order;
* :func:`random_dag` — every node writes one or two tensors read by 1-3 of the next
  ``reach`` nodes (2% of them step outputs).

Tensor sizes are multiples of 4 bytes, uniform in ``[4, 400]``.
"""
from __future__ import annotations

import random

from .graph import Graph

__all__ = ["chain", "random_dag"]


def chain(n: int, seed: int = 0) -> Graph:
    """A chain of ``n`` nodes; edge ``e{i}`` goes from ``n{i}`` to ``n{i+1}``."""
    rng = random.Random(seed)
    g = Graph()
    for i in range(n):
        g.add_node(f"n{i}")
    for i in range(n - 1):
        g.add_edge(f"e{i}", f"n{i}", [f"n{i + 1}"], 4 * rng.randint(1, 100))
    return g


def random_dag(n: int, seed: int = 0, reach: int = 50) -> Graph:
    """A DAG of ``n`` nodes: each writes one or two tensors read by 1-3 of the next
    ``reach`` nodes."""
    rng = random.Random(seed)
    g = Graph()
    for i in range(n):
        g.add_node(f"n{i}")
    k = 0
    for i in range(n - 1):
        for _ in range(1 + (rng.random() < 0.3)):
            hi = min(n - 1, i + reach)
            sinks = {f"n{rng.randint(i + 1, hi)}" for _ in range(rng.randint(1, 3))}
            g.add_edge(f"e{k}", f"n{i}", sorted(sinks), 4 * rng.randint(1, 100),
                       output=rng.random() < 0.02)
            k += 1
    return g
