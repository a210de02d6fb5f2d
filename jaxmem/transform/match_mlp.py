"""Two-layer perceptrons -> :func:`jaxmem.selective.chunked_mlp` (``transform(...,
mlp_chunk=rows)``: both passes ``rows`` rows at a time).

Matched, among the other matchers' re-emitted ops: ``z = f(x W1 [+ b1]) W2``, where

* ``x W1`` and ``. W2`` are dense products (``dot_general`` of ``(..., D)`` by a matrix over
  ``x``'s last axis alone, no batch axes), each re-emitted alone;
* ``+ b1`` (optional) is a re-emitted bias add of a vector broadcast along the last axis (its
  broadcasts, reshapes and transposes followed axis by axis);
* ``f`` is an exact smooth activation (a ReLU-like one keeps a 1-bit mask, less than the chunked
  op's input, and a few-bit one its codes: neither is matched);
* every value between them is read inside the chain alone, and ``x`` has more rows (the
  product of its leading axes) than ``rows``.

The chain's equations are re-emitted as one op keeping ``x`` and the weights (the separate ops
keep ``x`` and an ``R x F`` activation input) whose passes run ``rows`` rows at a time and
whose backward pass recomputes ``x W1``: exact (the same equations per row; the weight
gradients summed over the chunks in float32), one product more in the backward pass where
the block is stored.
"""
from __future__ import annotations

import dataclasses
import math

import jax

from jaxmem.transform.graph import Graph
from jaxmem.transform.match import Match, aval_str

__all__ = ["chunk_mlps"]


def _dense(graph: Graph, item) -> tuple | None:
    """``(x, w, contracted axis of w, params)`` of a Match re-emitting one dense product
    ``x (..., D) @ w`` (``w`` a matrix), else ``None``."""
    if not (isinstance(item, Match) and item.row.kind == "dot" and len(item.eqns) == 1):
        return None
    eqn = graph.jaxpr.eqns[item.anchor]
    if eqn.primitive.name != "dot_general" or len(item.inputs) != 2:
        return None
    x, w = eqn.invars
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nd = len(x.aval.shape)
    if lb or rb or len(w.aval.shape) != 2 or nd < 2 or tuple(lc) != (nd - 1,) \
            or len(rc) != 1:
        return None
    return x, w, int(rc[0]), dict(eqn.params)


def _trailing_vector(graph: Graph, item, shape: tuple) -> bool:
    """Whether a bias Match adds its vector ``b`` (``(F,)``) along the last axis of
    ``shape``: its chain of broadcast-like equations followed axis by axis."""
    b = item.inputs[1]
    if tuple(b.aval.shape) != (shape[-1],):
        return False
    axis, cur = 0, (shape[-1],)
    for j in sorted(item.eqns - {item.anchor}):
        eqn = graph.jaxpr.eqns[j]
        out = tuple(eqn.outvars[0].aval.shape)
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            axis = eqn.params["broadcast_dimensions"][axis]
        elif name == "transpose":
            axis = list(eqn.params["permutation"]).index(axis)
        elif name in ("reshape", "squeeze", "expand_dims"):
            # one axis of size F among size-1 axes before and after
            big = [k for k, d in enumerate(out) if d != 1]
            if sum(d != 1 for d in cur) != 1 or big != [out.index(shape[-1])]:
                return False
            axis = big[0]
        else:
            return False
        cur = out
    return axis == len(shape) - 1 and tuple(cur)[axis] == shape[-1]


def chunk_mlps(graph: Graph, found: list, rows: int) -> list:
    """``found`` (the matchers' Matches and Rows) with each two-layer perceptron (module
    docstring) merged into one Match emitting :func:`jaxmem.selective.chunked_mlp`; the
    merged Matches are kept as Rows noting it."""
    from jaxmem.selective.mlp_chunks import chunked_mlp

    by_output = {item.outputs[0]: k for k, item in enumerate(found)
                 if isinstance(item, Match) and len(item.outputs) == 1}
    out = list(found)
    for k2, second in enumerate(found):
        d2 = _dense(graph, second)
        if d2 is None:
            continue
        a, w2, axis2, params2 = d2
        ka = by_output.get(a)
        act = found[ka] if ka is not None else None
        if act is None or act.fn is None or act.row.kind != "activation" \
                or not graph.only_used_by(a, {second.anchor}):
            continue
        h, names = _before_names(graph, act.inputs[0], set(act.eqns))
        kb = by_output.get(h)
        bias = found[kb] if kb is not None else None
        if bias is None or names is None:
            continue
        if bias.row.kind == "bias":
            y = bias.inputs[0]
            kf = by_output.get(y)
            if kf is None or not _trailing_vector(graph, bias, tuple(h.aval.shape)) \
                    or not graph.only_used_by(y, set(bias.eqns)):
                continue
            first = found[kf]
            taken = [kf, kb, ka]
        else:
            first, kf, bias = bias, kb, None
            taken = [kf, ka]
        d1 = _dense(graph, first)
        if d1 is None or any(out[k] is not found[k] for k in (k2, *taken)):
            continue
        x, w1, axis1, params1 = d1
        n = math.prod(x.aval.shape[:-1])
        z = second.outputs[0]
        if n <= rows or tuple(z.aval.shape[:-1]) != tuple(x.aval.shape[:-1]) \
                or not _chunkable(act.fn, rows, h):
            continue
        f = act.fn

        def emit(xv, w1v, *rest, _f=f, _a=(axis1, axis2), _p=(params1, params2),
                 _bias=bias is not None):
            b1 = rest[0] if _bias else None
            return [chunked_mlp(xv, w1v, b1, rest[-1], _f, rows, w1_axis=_a[0],
                                w2_axis=_a[1], w1_params=_p[0], w2_params=_p[1])]

        what = (f"x {aval_str(x)} @ {aval_str(w1)}{' + b' if bias else ''} -> "
                f"{act.row.matched} -> @ {aval_str(w2)}")
        row = dataclasses.replace(
            second.row, kind="mlp", matched=what, became="jaxmem.selective.chunked_mlp",
            reason=f"x and the weights kept; both passes {rows} of {n} rows at a "
                   f"time, x W1 recomputed in the backward")
        eqns = second.eqns.union(*(found[k].eqns for k in taken), names)
        inputs = [x, w1] + ([bias.inputs[1]] if bias is not None else []) + [w2]
        out[k2] = Match(eqns, second.anchor, inputs, [z], emit, row)
        for k in taken:
            out[k] = dataclasses.replace(found[k].row,
                                         became="part of jaxmem.selective.chunked_mlp")
    return out


def _before_names(graph: Graph, v, readers: set[int]):
    """``(u, names)``: ``v`` is ``u`` behind a chain of ``name`` equations
    (``checkpoint_name``: a layer boundary's tag, dropped inside the merged op) whose values
    are each read by the next alone, the last by ``readers`` alone; ``names`` their indices
    (``None`` when a value is read elsewhere)."""
    names: set[int] = set()
    while True:
        if not graph.only_used_by(v, readers):
            return v, None
        eqn = graph.eqn(v)
        if eqn is None or eqn.primitive.name != "name" or len(eqn.invars) != 1:
            return v, names
        i = graph.producer[v]
        names.add(i)
        readers, v = {i}, eqn.invars[0]


def _chunkable(f, rows: int, h) -> bool:
    """Whether the activation ``f`` maps a ``(rows, F)`` block to one of its shape and
    dtype (its equations re-emitted for another shape)."""
    spec = jax.ShapeDtypeStruct((rows, h.aval.shape[-1]), h.aval.dtype)
    try:
        got = jax.eval_shape(f, spec)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a block stays
        return False
    return tuple(got.shape) == spec.shape and got.dtype == spec.dtype
