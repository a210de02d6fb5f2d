"""Bias adds -> :func:`jaxmem.selective.bias_add` (the bias gradient formed where the
cotangent arrives).

Matched: ``y = a + B(b)`` (either operand order), ``a`` the output of a ``dot_general`` /
convolution (through reshapes) and ``B`` a chain of broadcasts, reshapes, axis insertions /
removals and transposes of a value ``b`` that is not a constant and has at most half of
``y``'s elements -- a Dense / convolution bias --, every value inside the chain used by it
only. A bias added to anything else (a residual stream, an embedding lookup) stays: there
the barrier measured no saving, or a loss (``x + f(x) + b`` on the H100 plan: 5.02 against
4.51 B per hidden element per layer).
JAX's autodiff of the plain add keeps nothing either; the re-emitted op differs in order only:
on XLA:GPU ``a``'s cotangent flows on once ``dL/db`` exists, so XLA cannot move the bias
gradient to the end of the backward pass and keep the layer's output cotangent until then.
Exact: the same additions forward, the same sums backward.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmem.transform.graph import Graph, bind_eqn, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.match_fused import _PRODUCTS
from jaxmem.transform.report import Row

__all__ = ["match_biases"]

#: linear, shape-only equations a bias goes through before it is added (not a cast: one left
#: outside keeps its transpose where autodiff puts it, e.g. after ``vmap`` has summed a shared
#: float32 bias's float64 gradients over the batch)
_BROADCAST_LIKE = frozenset({"broadcast_in_dim", "reshape", "expand_dims", "squeeze",
                             "transpose"})


def _size(v) -> int:
    return math.prod(v.aval.shape)


def _chain(graph: Graph, v, add: int, shape: tuple):
    """``(b, [equation indices])`` when ``v`` is ``B(b)`` by broadcast-like equations used by
    the chain only, with at least one broadcast (a ``broadcast_in_dim``, or ``v`` of size-1
    axes the add broadcasts to ``shape``); else ``None``."""
    implicit = tuple(v.aval.shape) != shape
    idxs: list[int] = []
    allowed = {add}
    while True:
        if is_literal(v):
            return None
        i = graph.producer.get(v)
        if i is None:
            break
        eqn = graph.jaxpr.eqns[i]
        if eqn.primitive.name not in _BROADCAST_LIKE or len(eqn.invars) != 1 \
                or not graph.only_used_by(v, allowed):
            break
        idxs.append(i)
        allowed.add(i)
        v = eqn.invars[0]
    names = {graph.jaxpr.eqns[i].primitive.name for i in idxs}
    if "broadcast_in_dim" not in names and not implicit:
        return None
    return v, idxs[::-1]


def _product_output(graph: Graph, v) -> bool:
    """``v`` is the output of a ``dot_general`` / convolution (through reshapes)."""
    while not is_literal(v):
        eqn = graph.eqn(v)
        if eqn is None:
            return False
        if eqn.primitive.name in _PRODUCTS:
            return True
        if eqn.primitive.name != "reshape":
            return False
        v = eqn.invars[0]
    return False


def _one(graph: Graph, i: int, taken: set[int], path: str) -> Match | None:
    eqn = graph.jaxpr.eqns[i]
    if eqn.primitive.name != "add" or len(eqn.invars) != 2:
        return None
    y = eqn.outvars[0]
    if not is_float(y):
        return None
    for a, c in (eqn.invars, eqn.invars[::-1]):
        shape = tuple(y.aval.shape)
        if is_literal(a) or tuple(a.aval.shape) != shape or len(c.aval.shape) != len(shape) \
                or not _product_output(graph, a):
            continue
        found = _chain(graph, c, i, shape)
        if found is None:
            continue
        b, chain = found
        if graph.is_const(b) or not is_float(b) or 2 * _size(b) > _size(y) \
                or set(chain) & taken:
            continue
        eqns = [graph.jaxpr.eqns[j] for j in chain]

        def broadcast(bv, _eqns=eqns, _shape=shape):
            for e in _eqns:
                (bv,) = bind_eqn(e, [bv])
            return jnp.broadcast_to(bv, _shape)   # the add's own size-1 axis broadcast

        def emit(av, bv, _broadcast=broadcast):
            from jaxmem.selective import bias_add
            return [bias_add(av, bv, _broadcast)]

        row = Row("bias", f"bias add {aval_str(y)} + {aval_str(b)}",
                  "bias add (its gradient formed where the cotangent arrives)", True,
                  "nothing kept either way; on XLA:GPU the layer's output cotangent no "
                  "longer waits for the optimizer update", location(eqn), name_stack(eqn),
                  path)
        return Match(frozenset(chain) | {i}, i, [a, b], [y], emit, row)
    return None


def match_biases(graph: Graph, taken: set[int], path: str) -> list[Match]:
    """Bias adds of ``graph`` not among the equations ``taken``."""
    out = []
    for i in range(len(graph.jaxpr.eqns)):
        if i not in taken:
            item = _one(graph, i, taken, path)
            if item is not None:
                out.append(item)
    return out
