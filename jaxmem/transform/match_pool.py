"""Max pooling (``reduce_window`` max) -> :func:`jaxmem.selective.max_pool` (argmax codes).

Matched, however it was spelled (``flax.linen.max_pool``, ``nnx.max_pool``,
``lax.reduce_window(x, -inf, lax.max, ...)``, i.e. the ``reduce_window_max`` primitive)::

    y = reduce_window_max(x)     float x, any window / strides / padding, no dilation

JAX's autodiff of ``reduce_window_max`` keeps the input ``x`` (its backward is a
``select_and_scatter_add`` over ``x``); :func:`jaxmem.selective.max_pool` keeps the position
of the maximum inside each window instead, packed in the fewest of 1/2/4/8 bits (4 bits
for a 3x3 window, per *output* element).  Exact: the forward is the same ``reduce_window``
and the gradient goes to the first maximal position of each window in row-major order, the
tie convention of ``select_and_scatter_add`` (a window of equal values -- zeros after a
ReLU -- sends its gradient to its first element, as JAX does).

The pooled axes (window > 1, stride > 1 or padded) may be any axes: the non-pooled axes
before them are merged into the batch axis, those after them into the channel axis
(``(N, C, H, W)`` pools as ``(N * C, H, W, 1)``: reshapes only), and a non-pooled axis
between two pooled ones is moved in front of them (a transpose).

Also matched: a generic ``reduce_window`` whose body is ``max`` of its two arguments with
initial value ``-inf`` (``lax.reduce_window`` with a ``jnp`` array as initial value, or a
body JAX does not recognise as ``lax.max``): the same function as ``reduce_window_max``,
for which JAX itself has no reverse-mode rule; re-emitted, it is differentiable (with
``reduce_window_max``'s gradient).

Left as they were, with a reason: integer inputs, a dilated window or base, more than 256
window positions, a ``reduce_window`` of another body or initial value, and
``reduce_window_min`` (a min pool: not matched).
"""
from __future__ import annotations

import math

import numpy as np

from jaxmem.transform.graph import Graph, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.report import Row

__all__ = ["match_pools"]

_TARGET = "jaxmem.selective.max_pool"


def _max_body(eqn) -> bool:
    """A generic ``reduce_window`` with one operand whose body is ``max(a, b)`` of its two
    arguments (either order)."""
    p = eqn.params
    if len(eqn.invars) != 2 or p.get("consts"):
        return False
    body = p["jaxpr"]
    body = getattr(body, "jaxpr", body)
    if len(body.invars) != 2 or len(body.eqns) != 1 or len(body.outvars) != 1:
        return False
    e = body.eqns[0]
    return (e.primitive.name == "max" and e.outvars[0] is body.outvars[0]
            and set(map(id, e.invars)) == set(map(id, body.invars)))


def _layout(shape, window, strides, pads):
    """``(perm, lead, mid, pooled, trail)``: the pooled axes, the non-pooled axes before /
    between / after them, and the transpose putting ``lead + mid`` first (``None`` when it
    is the identity)."""
    pooled = [d for d in range(len(shape))
              if window[d] != 1 or strides[d] != 1 or tuple(pads[d]) != (0, 0)]
    if not pooled:
        return None
    lo, hi = pooled[0], pooled[-1]
    lead = [d for d in range(lo)]
    mid = [d for d in range(lo, hi) if d not in pooled]
    trail = [d for d in range(hi + 1, len(shape))]
    perm = lead + mid + pooled + trail
    return (None if perm == list(range(len(shape))) else tuple(perm)), lead, mid, pooled, trail


def _emit_fn(shape, window, strides, pads, layout):
    perm, lead, mid, pooled, trail = layout
    nb = math.prod(shape[d] for d in lead + mid)
    nc = math.prod(shape[d] for d in trail)
    win = tuple(window[d] for d in pooled)
    st = tuple(strides[d] for d in pooled)
    pd = tuple(tuple(int(v) for v in pads[d]) for d in pooled)

    def emit(x):
        import jax.numpy as jnp
        from jax import lax

        from jaxmem.selective import max_pool

        if perm is not None:
            x = lax.transpose(x, perm)
        tshape = x.shape
        y = max_pool(jnp.reshape(x, (nb,) + tuple(shape[d] for d in pooled) + (nc,)),
                     win, st, pd)
        n_pre = len(lead) + len(mid)
        y = jnp.reshape(y, tshape[:n_pre] + y.shape[1:-1] + tshape[n_pre + len(pooled):])
        if perm is not None:
            y = lax.transpose(y, tuple(int(a) for a in np.argsort(perm)))
        return [y]

    return emit


def _one(graph: Graph, i: int, path: str) -> Match | Row | None:
    eqn = graph.jaxpr.eqns[i]
    name = eqn.primitive.name
    if name not in ("reduce_window_max", "reduce_window_min", "reduce_window"):
        return None
    p = eqn.params
    x = eqn.invars[0]
    where, ns = location(eqn), name_stack(eqn)
    window, strides = tuple(p["window_dimensions"]), tuple(p["window_strides"])
    pads = tuple(tuple(q) for q in p["padding"])
    what = (f"{name} {aval_str(x)} -> {aval_str(eqn.outvars[0])} window "
            f"{window} strides {strides} padding {pads}")

    def no(reason):
        return Row("pool", what, "", False, reason, where, ns, path)

    if name == "reduce_window_min":
        return no("a min pool: not matched (only max pools are)")
    if name == "reduce_window":
        if not _max_body(eqn):
            return no("a reduce_window whose body is not max(a, b): not a max pool")
        init = eqn.invars[1]
        if graph.uniform(init) != -np.inf:
            return no("a max reduce_window whose initial value is not -inf (a known "
                      "constant): not a max pool")
    if not is_float(x):
        return no("integer input: not differentiated")
    if any(d != 1 for d in p["base_dilation"]) or any(d != 1 for d in p["window_dilation"]):
        return no("a dilated window or base: jaxmem.selective.max_pool has no dilation")
    positions = math.prod(window)
    if positions > 256:
        return no(f"{positions} window positions: the argmax codes hold at most 256")
    if is_literal(x) or graph.is_const(x):
        return no("a constant input: not differentiated")
    layout = _layout(tuple(x.aval.shape), window, strides, pads)
    if layout is None:
        return no("a window of one element, stride 1, no padding: nothing is pooled")
    bits = next(b for b in (1, 2, 4, 8) if positions <= 2**b)
    note = f"keeps {bits}-bit argmax codes per output instead of x"
    if name == "reduce_window":
        note += ("; a generic reduce_window (max body, init -inf), which JAX cannot "
                 "differentiate, gets reduce_window_max's gradient")
    if layout[0] is not None:
        note += f"; pooled after transposing to {layout[0]}"
    emit = _emit_fn(tuple(x.aval.shape), window, strides, pads, layout)
    row = Row("pool", what, _TARGET, True, note, where, ns, path)
    return Match(frozenset({i}), i, [x], [eqn.outvars[0]], emit, row)


def match_pools(graph: Graph, taken: set[int], path: str) -> list[Match | Row]:
    """Max pools of ``graph`` not among the equations ``taken`` (Matches), and rows saying
    why the other window reductions (min, other bodies, dilated, integer) stay."""
    out: list[Match | Row] = []
    for i in range(len(graph.jaxpr.eqns)):
        if i in taken:
            continue
        item = _one(graph, i, path)
        if item is not None:
            out.append(item)
    return out
