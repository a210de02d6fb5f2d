"""``dot_general`` / ``conv_general_dilated`` -> :mod:`jaxmem.selective`'s bilinear ops.

A product ``z = f(x, w)`` bilinear in ``(x, w)`` has ``dL/dx = f(., w)^T g`` (needs ``w``)
and ``dL/dw = f(x, .)^T g`` (needs ``x``).  :func:`jaxmem.selective.dot_general` and
:func:`jaxmem.selective.conv_general_dilated` (``custom_vjp`` with symbolic zeros) keep ``x``
only when ``w`` is differentiated and ``w`` only when ``x`` is, and recompute the input of a
selective normalisation from that norm's own residuals instead of storing it twice.  The
equation's parameters are passed through unchanged, so the forward is the very same lax
call and the gradients are JAX's own (bit-identical; a strided channel-last convolution's
input gradient is summed per output phase, equal up to float rounding).
"""
from __future__ import annotations

from jaxmem.transform.graph import Graph, location, name_stack
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.report import Row

__all__ = ["match_product"]

_PRIMS = {"dot_general": ("dot", "jaxmem.selective.dot_general"),
          "conv_general_dilated": ("conv", "jaxmem.selective.conv_general_dilated")}



def match_product(graph: Graph, i: int, path: str, recompute: bool = True,
                  project: bool = False) -> Match | Row | None:
    """A Match for a float ``dot_general`` / convolution at equation ``i``, a Row saying
    why not for other products, ``None`` for other equations. ``recompute``: a 1x1,
    stride-1 convolution's output may be recomputed by the norm it feeds
    (``transform(..., conv_recompute=...)``); ``project``: a dense product's output may be
    recomputed by the attention it feeds (``transform(..., projections=...)``)."""
    eqn = graph.jaxpr.eqns[i]
    name = eqn.primitive.name
    if name not in _PRIMS:
        return None
    kind, target = _PRIMS[name]
    lhs, rhs = eqn.invars
    what = f"{name} {aval_str(lhs)} x {aval_str(rhs)} -> {aval_str(eqn.outvars[0])}"
    where, ns = location(eqn), name_stack(eqn)
    if not (is_float(lhs) and is_float(rhs)):
        return Row(kind, what, "", False, "integer operands: not differentiated", where, ns,
                   path)
    params = dict(eqn.params)

    if name == "dot_general":
        from jaxmem.selective.linear import dot_with_recipe

        def emit(x, w):
            return [dot_with_recipe(x, w, project, **params)]
    else:
        from jaxmem.selective.linear import conv_with_recipe

        def emit(x, w):
            return [conv_with_recipe(x, w, recompute, **params)]

    row = Row(kind, what, target, True, "keeps x only if w is differentiated, w only if x is",
              where, ns, path)
    return Match(frozenset({i}), i, [lhs, rhs], list(eqn.outvars), emit, row)
