"""``dot_general`` / ``conv_general_dilated`` -> :mod:`jaxmem.selective`'s bilinear ops.

A product ``z = f(x, w)`` bilinear in ``(x, w)`` has ``dL/dx = f(., w)^T g`` (needs ``w``)
and ``dL/dw = f(x, .)^T g`` (needs ``x``).  :func:`jaxmem.selective.dot_general` and
:func:`jaxmem.selective.conv_general_dilated` (``custom_vjp`` with symbolic zeros) keep ``x``
only when ``w`` is differentiated and ``w`` only when ``x`` is, and recompute the input of a
selective normalisation from that norm's own residuals instead of storing it twice.  The
equation's parameters are passed through unchanged, so the forward is the very same lax
call and the gradients are JAX's own (bit-identical; a strided channel-last convolution's
input gradient is summed per output phase, equal up to float rounding).

A dense product's weight computed in the step from the function's inputs alone by a few
parameter-sized ops (:func:`weight_subgraph`: a merged LoRA weight ``W + A B / r``, a cast
``W.astype(bfloat16)``, a weight-normalised ``v / |v| g``) is recorded as recomputable from
those inputs (``computed_weights``; :func:`jaxmem._prims.recipes.remember_weight`): the
product keeps the inputs -- parameters, alive for the whole step -- instead of the computed
weight, and recomputes it in its backward pass.
"""
from __future__ import annotations

import numpy as np

from jaxmem.transform.graph import Graph, bind_eqns, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.report import Row

__all__ = ["match_product", "weight_subgraph"]

_PRIMS = {"dot_general": ("dot", "jaxmem.selective.dot_general"),
          "conv_general_dilated": ("conv", "jaxmem.selective.conv_general_dilated")}



#: primitives a computed weight may be made of: elementwise arithmetic, casts, relayouts,
#: products and reductions of parameter-sized arrays (no randomness, no effects, no calls)
_WEIGHT_PRIMS = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sqrt", "rsqrt", "exp", "log",
    "tanh", "logistic", "integer_pow", "pow", "square", "sign", "convert_element_type",
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "copy",
    "dot_general", "reduce_sum", "reduce_max", "select_n", "clamp", "concatenate", "slice",
    "stop_gradient"})
#: relayouts: a weight made by these alone is not recorded (nothing to recompute; a cast is
#: not one of them)
_RELAYOUTS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                        "copy"})
#: the most equations a computed weight may take
_WEIGHT_EQNS = 16


def weight_subgraph(graph: Graph, w) -> tuple[list[int], list] | None:
    """``(equations in order, input variables)`` computing the variable ``w`` from inputs of
    the jaxpr (and constants) alone, through at most :data:`_WEIGHT_EQNS` equations of
    :data:`_WEIGHT_PRIMS`, none with an output or input larger than ``w`` (in elements), at
    least one of them not a pure relayout (a cast counts: ``W.astype(bf16)``);
    ``None`` otherwise."""
    if is_literal(w) or graph.producer.get(w) is None:
        return None
    size = int(np.prod(w.aval.shape))
    invars = set(graph.jaxpr.invars)
    eqns: set[int] = set()
    leaves: list = []
    stack = [w]
    while stack:
        v = stack.pop()
        if is_literal(v) or v in graph.consts:
            continue
        if v in invars:
            if int(np.prod(v.aval.shape)) > size:
                return None
            if v not in leaves:
                leaves.append(v)
            continue
        i = graph.producer.get(v)
        if i is None:
            return None
        if i in eqns:
            continue
        e = graph.jaxpr.eqns[i]
        if (e.primitive.name not in _WEIGHT_PRIMS or e.effects
                or any(int(np.prod(o.aval.shape)) > size for o in e.outvars)):
            return None
        eqns.add(i)
        if len(eqns) > _WEIGHT_EQNS:
            return None
        stack.extend(e.invars)
    names = {graph.jaxpr.eqns[i].primitive.name for i in eqns}
    if not leaves or names <= _RELAYOUTS:
        return None
    return sorted(eqns), leaves


def _weight_fn(graph: Graph, eqns: list[int], leaves: list, w):
    """``fn(*leaf values) -> w``: the equations bound again, in order."""
    region = [graph.jaxpr.eqns[i] for i in eqns]

    def fn(*vals):
        return bind_eqns(region, {**graph.consts, **dict(zip(leaves, vals))})[w]

    return fn


def match_product(graph: Graph, i: int, path: str, recompute: bool = True,
                  project: bool = False, computed_weights: bool = False) -> Match | Row | None:
    """A Match for a float ``dot_general`` / convolution at equation ``i``, a Row saying
    why not for other products, ``None`` for other equations. ``recompute``: a 1x1,
    stride-1 convolution's output may be recomputed by the norm it feeds
    (``transform(..., conv_recompute=...)``); ``project``: a dense product's output may be
    recomputed by the attention it feeds (``transform(..., projections=...)``);
    ``computed_weights``: a dense product's right operand computed from the jaxpr's inputs
    (:func:`weight_subgraph`; the top-level jaxpr only) is recomputed in its backward
    pass instead of kept (``transform(..., computed_weights=...)``)."""
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

    sub = (weight_subgraph(graph, rhs) if computed_weights and name == "dot_general"
           and path == "" else None)
    if name == "dot_general" and sub is not None:
        from jaxmem._prims.recipes import remember_weight
        from jaxmem.selective.linear import dot_with_recipe

        eqns, leaves = sub
        w_fn = _weight_fn(graph, eqns, leaves, rhs)

        def emit(x, w, *leaf_vals):
            remember_weight(w, w_fn, leaf_vals)
            return [dot_with_recipe(x, w, project, **params)]

        row = Row(kind, what, target, True,
                  f"keeps x only if w is differentiated; w, computed from the function's "
                  f"inputs ({len(eqns)} ops), recomputed from them where x is",
                  where, ns, path)
        return Match(frozenset({i}), i, [lhs, rhs, *leaves], list(eqn.outvars), emit, row)
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
