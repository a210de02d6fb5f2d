"""Depth-first walk of a layer tree with branches.

A node may carry ``branch`` (a list of nodes, or ``None``) and ``shortcut`` (a list of nodes,
possibly empty, or ``None``): a residual block is one node whose ``branch`` is its main path
and whose ``shortcut`` is the skip path.  :func:`walk` yields every node in pre-order::

    walk([a, b(branch=[c, d], shortcut=[e]), f]) -> a, b, c, d, e, f

A ``shortcut`` is visited only under a node with a ``branch``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["walk"]


def walk(nodes: Iterable[Any]) -> Iterator[Any]:
    """Every node of ``nodes`` and, after each, its ``branch`` then ``shortcut`` subtrees."""
    for nd in nodes:
        yield nd
        if getattr(nd, "branch", None) is not None:
            yield from walk(nd.branch)
            if getattr(nd, "shortcut", None):
                yield from walk(nd.shortcut)
