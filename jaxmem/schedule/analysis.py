"""Structural analysis used to shrink the ILP and bound its optimum (OLLA, section 4).

The names live in one module per concept and are re-exported here:

* :mod:`jaxmem.schedule.reach` — :class:`Reach`, :func:`spans`, :func:`edge_ranges`;
* :mod:`jaxmem.schedule.updates` — :func:`levels`, :func:`add_early_update_edges`;
* :mod:`jaxmem.schedule.bounds` — :func:`structural_lower_bound`, :func:`cut_lower_bound`,
  :func:`antichain_lower_bound`;
* :mod:`jaxmem.schedule.inplace` — :func:`inplace_update_graph`, :func:`expand_order`.
"""
from __future__ import annotations

from .bounds import antichain_lower_bound, cut_lower_bound, structural_lower_bound
from .inplace import expand_order, inplace_update_graph
from .reach import Reach, edge_ranges, spans
from .updates import add_early_update_edges, levels

__all__ = ["Reach", "add_early_update_edges", "antichain_lower_bound", "cut_lower_bound",
           "edge_ranges", "expand_order", "inplace_update_graph", "levels", "spans",
           "structural_lower_bound"]
