"""Attention subgraphs -> the exact memory-lean attention of :mod:`jaxmem.selective`.

Matched, however it was spelled (``jnp.einsum`` + ``jax.nn.softmax`` in any float dtype,
Flax's ``dot_product_attention``, ``jax.nn.dot_product_attention(implementation="xla")``
(also ``None`` where it picks XLA), a hand-written softmax)::

    s = dot_general(q, k)            one free axis of k (S), one or more of q (the query
                                     axes: T, and the group axis of grouped-query
                                     attention), any batch axes
    s = convert(s)                   optional: a cast right after q k^T, e.g. bf16 scores to
                                     f32, becomes ``logits_dtype`` (the product is then
                                     accumulated in f32 directly, equal up to the bf16
                                     rounding it skips)
    s = s * c  |  s / c              optional, c a uniform constant   (scale / divisor)
    s = s + b  |  s - b              optional                          (bias; ``s - b``, e.g.
                                     DistilBERT's ``s - 1e30 (1 - mask)``, as ``s + (-b)``:
                                     the same float result)
    s = select_n(m, fill, s)         optional, fill a finite constant (mask;
                                     ``m`` traced to its source through broadcasts,
                                     transposes and ``and`` with an all-true array)
    s = convert(s)                   optional                          (softmax dtype)
    p = exp(s - max(s)) / sum(...)   softmax over S (the last axis), max optional; the row
                                     sum may be taken through casts (a bf16 softmax sums
                                     in f32), the max of the array before a transpose
    p = convert(p)                   optional                          (weights dtype)
    p = p * bernoulli(key)/keep      optional (Flax's attention dropout; the recipe is
                                     checked by re-tracing ``jax.random.bernoulli``, and
                                     the core regenerates the mask from ``key``)
      | where(bernoulli(key), p / keep, 0)   (Equinox's, hand-written JAX's; also one
                                     mask per key of a batch of keys under ``vmap``)
    p = p * f                        optional, f constant along T and S (a head mask,
                                     also as ``einsum("...hqk,h->...hqk")`` + transpose);
                                     re-emitted as ``o * f`` since ``(P f) v = (P v) f``
    o = dot_general(p, v) | (v, p)   contracting S, the batch axes of q k^T in any order

with transposes allowed anywhere between ``q k^T`` and the softmax (``vmap`` puts them
there: ``jax.nn.dot_product_attention`` is a ``vmap`` over the query group axis), and every
interior value used inside the pattern only.  It is re-emitted as
:func:`jaxmem.selective.attention_core` on ``q, k, v`` transposed to ``(..., T', 1, D)``,
``(..., S, 1, D)``, ``(..., S, 1, Dv)`` (the batch axes of the scores, one head, the query
axes merged into ``T'``), the bias / mask un-broadcast to their source (so nothing
``T x S`` is stored when they are smaller), and the result transposed back: forward the
same arithmetic, backward flash-style from ``q, k, v`` and two row statistics (no
``T x S`` residual).  Exact up to float rounding.

A product with softmax-like weights (a division of an ``exp``) that does not match gets a
report row with the reason (a softmax over another axis, a fill value the core does not
use, weights used elsewhere, ...).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from jaxmem.transform.graph import Graph, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str
from jaxmem.transform.match_random import BernoulliMask, bernoulli_mask, key_recipe, signature
from jaxmem.transform.report import Row

__all__ = ["match_attention"]


class _NoMatch(Exception):
    pass


def _need(cond: bool, why: str):
    if not cond:
        raise _NoMatch(why)


def _prod(graph: Graph, v, name: str | tuple):
    """``(index, eqn)`` producing ``v`` if its primitive is ``name``, else ``None``."""
    names = (name,) if isinstance(name, str) else name
    if is_literal(v):
        return None
    i = graph.producer.get(v)
    if i is None or graph.jaxpr.eqns[i].primitive.name not in names:
        return None
    return i, graph.jaxpr.eqns[i]


def _keeps_rows(eqn) -> bool:
    """A ``broadcast_in_dim`` / ``reshape`` that only appends or drops size-1 axes (the
    leading axes of a row statistic stay where they are); any other equation passes."""
    src, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if eqn.primitive.name == "broadcast_in_dim":
        return tuple(eqn.params["broadcast_dimensions"]) == tuple(range(len(src)))
    if eqn.primitive.name == "reshape":
        return [n for n in src if n != 1] == [n for n in out if n != 1]
    return True


def _through(graph: Graph, v, names, used: set[int]):
    """``v`` traced back through equations named ``names`` (each added to ``used``)."""
    while True:
        h = _prod(graph, v, names)
        if h is None or not _keeps_rows(h[1]):
            return v
        used.add(h[0])
        v = h[1].invars[0]


def _softmax_like(graph: Graph, p) -> bool:
    """``p`` is a division of an ``exp`` (maybe cast) by something, maybe masked by a
    ``select`` against a constant: softmax-like weights."""
    h = _prod(graph, p, "select_n")
    if h is not None and len(h[1].invars) == 3 and graph.is_const(h[1].invars[1]):
        p = h[1].invars[2]
    elif h is not None and len(h[1].invars) == 3 and graph.is_const(h[1].invars[2]):
        p = h[1].invars[1]
    h = _prod(graph, p, "div")
    if h is None or is_literal(h[1].invars[0]):
        return False
    num = _through(graph, h[1].invars[0], "convert_element_type", set())
    return _prod(graph, num, "exp") is not None


def _softmax(graph: Graph, p, used: set[int]):
    """Match ``p = softmax(s, axis=-1)``; returns ``s``.  Casts around the row sum (a bf16
    softmax sums in f32: ``convert -> reduce_sum -> broadcast -> convert``) are part of
    the softmax (``jax.nn.softmax`` computes the same)."""
    hit = _prod(graph, p, "div")
    _need(hit is not None, "no softmax division")
    i, div = hit
    used.add(i)
    e, den = div.invars
    nd = len(e.aval.shape)
    _need(nd >= 2, "softmax of a vector: no query axis")
    # den = [convert] broadcast(reduce_sum([convert] e, last axis))
    den = _through(graph, den, ("convert_element_type", "broadcast_in_dim", "reshape"), used)
    hit = _prod(graph, den, "reduce_sum")
    _need(hit is not None and tuple(hit[1].params["axes"]) == (nd - 1,),
          "softmax denominator is not a sum over the last axis")
    used.add(hit[0])
    summed = _through(graph, hit[1].invars[0], "convert_element_type", used)
    _need(summed is e, "softmax denominator sums another array")
    hit = _prod(graph, e, "exp")
    _need(hit is not None, "softmax numerator is not exp")
    used.add(hit[0])
    arg = hit[1].invars[0]
    hit = _prod(graph, arg, "sub")
    if hit is None:
        return arg
    i, sub = hit
    s, m = sub.invars
    chain = [i]
    # the shift: the row max of ``s`` (or of the array ``s`` is a transpose of, e.g. under
    # ``vmap``), through -inf maxima, stop_gradient, broadcasts and transposes;
    # ``dims[j]``: the axis of the shift that axis ``j`` of ``m`` runs along
    dims: list = list(range(nd))
    while True:
        h = _prod(graph, m, ("broadcast_in_dim", "stop_gradient", "max", "reshape",
                             "transpose"))
        if h is None:
            break
        j, eq = h
        name = eq.primitive.name
        if name == "max":
            lits = [v for v in eq.invars if graph.uniform(v) == -math.inf]
            _need(len(lits) == 1, "softmax max is not a max with -inf")
            m = next(v for v in eq.invars if v is not lits[0])
        elif name == "broadcast_in_dim":
            if is_literal(eq.invars[0]):
                break
            dims = [dims[d] for d in eq.params["broadcast_dimensions"]]
            m = eq.invars[0]
        elif name == "transpose":
            new = [None] * len(dims)
            for a, pa in enumerate(eq.params["permutation"]):
                new[pa] = dims[a]
            dims, m = new, eq.invars[0]
        elif name == "reshape":
            src_shape, out_shape = eq.invars[0].aval.shape, eq.outvars[0].aval.shape
            ka = [a for a, n in enumerate(src_shape) if n != 1]
            kb = [b for b, n in enumerate(out_shape) if n != 1]
            if [src_shape[a] for a in ka] != [out_shape[b] for b in kb]:
                break
            new = [None] * len(src_shape)
            for a, b in zip(ka, kb):
                new[a] = dims[b]
            dims, m = new, eq.invars[0]
        else:
            m = eq.invars[0]
        chain.append(j)
    h = _prod(graph, m, "reduce_max")
    _need(h is not None and len(h[1].params["axes"]) == 1,
          "softmax shift is not the row max of its input")
    x, ax = h[1].invars[0], int(h[1].params["axes"][0])
    perm = list(range(nd))              # axis i of s is axis perm[i] of x
    t = s
    while t is not x:
        ht = _prod(graph, t, "transpose")
        _need(ht is not None, "softmax shift is not the row max of its input")
        tp = ht[1].params["permutation"]
        perm = [tp[a] for a in perm]
        t = ht[1].invars[0]
    rest = [d for d in range(nd) if d != ax]             # x's axes the max keeps
    _need(len(dims) == nd - 1 and perm[nd - 1] == ax
          and all(d is not None and perm[d] == rest[j] for j, d in enumerate(dims)),
          "softmax shift is not the row max of its input over the last axis")
    chain.append(h[0])
    used.update(chain)
    return s


def _source(graph: Graph, v):
    """``v`` traced back through ``broadcast_in_dim``, ``transpose``, ``reshape`` adding
    or dropping size-1 axes, and ``and`` with an all-true constant (a combined mask) to
    its source: ``(src, dims)`` with ``dims[i]`` the axis of ``v`` that axis ``i`` of
    ``src`` runs along (``None``: a size-1 axis of ``src`` with no counterpart).  ``src``
    broadcasts to ``v`` once its axes are put there."""
    dims = list(range(len(v.aval.shape)))
    for _ in range(64):
        if is_literal(v):
            break
        eq = graph.eqn(v)
        if eq is None:
            break
        name = eq.primitive.name
        if name == "broadcast_in_dim" and not is_literal(eq.invars[0]):
            bd = tuple(eq.params["broadcast_dimensions"])
            dims = [dims[d] for d in bd]
        elif name == "transpose":
            perm = tuple(eq.params["permutation"])
            new = [None] * len(perm)
            for j, pj in enumerate(perm):
                new[pj] = dims[j]
            dims = new
        elif name == "reshape" and eq.params.get("dimensions") is None:
            a, b = eq.invars[0].aval.shape, eq.outvars[0].aval.shape
            ka, kb = [i for i, n in enumerate(a) if n != 1], [i for i, n in enumerate(b)
                                                             if n != 1]
            if [a[i] for i in ka] != [b[i] for i in kb]:
                break
            new = [None] * len(a)
            for i, j in zip(ka, kb):
                new[i] = dims[j]
            dims = new
        elif name == "and" and v.aval.dtype == np.bool_:
            x0, x1 = eq.invars
            rank = len(v.aval.shape)          # operands of one rank, size-1 axes broadcast
            if graph.uniform(x0) == 1.0 and len(x1.aval.shape) == rank:
                v = x1
                continue
            if graph.uniform(x1) == 1.0 and len(x0.aval.shape) == rank:
                v = x0
                continue
            break
        else:
            break
        v = eq.invars[0]
    return v, tuple(dims)


def _and_leaves(graph: Graph, v, depth: int = 0) -> list:
    """A boolean mask as the sources of the ``and`` tree computing it (``is_causal`` with
    sequence lengths): ``[(src, dims)]`` as :func:`_source` gives for each, so that the
    combined mask is built from them at the size they broadcast to, not kept at the
    scores' size."""
    src, dims = _source(graph, v)
    eq = None if is_literal(src) else graph.eqn(src)
    if (depth > 3 or eq is None or eq.primitive.name != "and" or src.aval.dtype != np.bool_
            or any(len(x.aval.shape) != len(src.aval.shape) for x in eq.invars)):
        return [(src, dims)]
    out = []
    for x in eq.invars:
        for s2, d2 in _and_leaves(graph, x, depth + 1):
            out.append((s2, tuple(None if d is None else dims[d] for d in d2)))
    return out


def _as_shape(src, dims, rank: int):
    """``(src, shape)``: ``src`` reshaped to ``rank`` axes broadcastable to the array
    ``dims`` refers to, when its axes are in order (else ``(src, None)``)."""
    if any(d is None for d in dims) or list(dims) != sorted(dims):
        return src, None
    shape = [1] * rank
    for d, n in zip(dims, src.aval.shape):
        shape[d] = n
    return src, tuple(shape)


def _peel_factor(graph: Graph, x, part: set[int]):
    """``x = P * f`` with ``f`` constant along the last two (query, key) axes -- a head mask
    (``einsum("...hqk,h->...hqk", P, head_mask)`` then a transpose back, or ``P * f``
    broadcast): returns ``(P, (f, shape))``, ``shape`` being ``f`` as broadcastable to
    ``x``.  Since ``(P f) v = (P v) f`` for such ``f``, the factor moves to the output.
    Otherwise ``(x, None)``."""
    rank = len(x.aval.shape)
    y, perm, t_index = x, None, None
    h = _prod(graph, x, "transpose")
    if h is not None:
        t_index, perm, y = h[0], tuple(h[1].params["permutation"]), h[1].invars[0]
    hd = _prod(graph, y, "dot_general")
    if hd is not None:
        (lc, rc), (lb, rb) = hd[1].params["dimension_numbers"]
        f, p = hd[1].invars
        if (not lc and not rc and len(f.aval.shape) == 1 and tuple(lb) == (0,)
                and len(rb) == 1 and rb[0] < rank - 2 and len(p.aval.shape) == rank):
            j = rb[0]
            order = [j] + [d for d in range(rank) if d != j]
            final = order if perm is None else [order[perm[i]] for i in range(rank)]
            if final == list(range(rank)):
                part.add(hd[0])
                if t_index is not None:
                    part.add(t_index)
                shape = [1] * rank
                shape[j] = f.aval.shape[0]
                return p, (f, tuple(shape))
    if perm is None:
        hm = _prod(graph, x, "mul")
        if hm is not None:
            a, b = hm[1].invars
            for p, f in ((a, b), (b, a)):
                if is_literal(f) or graph.uniform(f) is not None:
                    continue
                src, shape = _as_shape(*_source(graph, f), rank)
                if shape is None:
                    src, shape = f, tuple(f.aval.shape)
                if shape[-2:] == (1, 1) and _prod(
                        graph, p, ("div", "convert_element_type")) is not None:
                    part.add(hm[0])
                    return p, (src, shape)
    return x, None


def _peel_dropout(graph: Graph, x, part: set[int]):
    """Attention dropout on the weights ``P``, returning ``(P, (key, keep, broadcast,
    select))`` or ``(x, None)``; ``attention_core`` regenerates the very mask from ``key``:

    * ``x = P * (bernoulli(key, keep, shape) / keep)`` (Flax's, the mask broadcast over the
      batch axes or not; ``select`` False);
    * ``x = where(bernoulli(key, keep, shape), P / keep, 0)`` (Equinox's, hand-written
      JAX's: one mask per key of a batch of keys under ``jax.vmap``; ``select`` True).

    The mask is checked by re-tracing ``jax.random.bernoulli`` and comparing equations."""
    found = _peel_select_dropout(graph, x, part)
    if found is not None:
        return found
    import jax

    from jaxmem.transform.graph import inline_calls

    h = _prod(graph, x, "mul")
    if h is None:
        return x, None
    rank = len(x.aval.shape)
    for p, m in (tuple(h[1].invars), tuple(reversed(h[1].invars))):
        mine = {h[0]}
        src = m
        hb = _prod(graph, src, "broadcast_in_dim")
        if hb is not None:
            mine.add(hb[0])
            src = hb[1].invars[0]
        hd = _prod(graph, src, "div")
        if hd is None or is_literal(hd[1].invars[0]):
            continue
        kp = graph.uniform(hd[1].invars[1])
        hc = _prod(graph, hd[1].invars[0], "convert_element_type")
        if kp is None or not 0 < kp < 1 or hc is None:
            continue
        keep = hc[1].invars[0]
        if keep.aval.dtype != np.bool_ or len(keep.aval.shape) != rank:
            continue
        rec = key_recipe(graph, keep)
        if rec is None:
            continue
        eqns, key = rec
        shape = tuple(keep.aval.shape)
        broadcast = _dropout_broadcast(shape, tuple(p.aval.shape))
        if broadcast is None:
            continue
        dt = src.aval.dtype

        def ref(k, kp=kp, shape=shape, dt=dt):
            return (jax.random.bernoulli(k, kp, shape).astype(dt)
                    / jnp.asarray(kp, dtype=dt))

        try:
            kstruct = jax.ShapeDtypeStruct(key.aval.shape, key.aval.dtype)
            rj = inline_calls(jax.make_jaxpr(ref)(kstruct), [kstruct]).jaxpr
        except (TypeError, ValueError):
            continue
        mine_eqns = [graph.jaxpr.eqns[i] for i in eqns | {hc[0], hd[0]}]
        if sorted(map(signature, mine_eqns)) != sorted(map(signature, rj.eqns)):
            continue
        part |= mine | eqns | {hc[0], hd[0]}
        return p, (key, kp, broadcast, False)
    return x, None


def _dropout_broadcast(shape, pshape) -> bool | None:
    """A mask of ``shape`` on weights of ``pshape``: ``False`` one bit per weight, ``True``
    shared over the batch axes (``(1, ..., 1, T, S)``), ``None`` another sharing."""
    if shape == pshape:
        return False
    if shape[-2:] == pshape[-2:] and len(shape) == len(pshape) and all(n == 1 for n in shape[:-2]):
        return True
    return None


def _peel_select_dropout(graph: Graph, x, part: set[int]):
    """``x = where(bernoulli(key, keep, shape), P / keep, 0)`` -> ``(P, (key, keep,
    broadcast, True))``, or ``None`` (not this form, or a mask the core cannot regenerate:
    then the weights stay unmatched and the report says why)."""
    h = _prod(graph, x, "select_n")
    if h is None or len(h[1].invars) != 3:
        return None
    pred, zero, scaled = h[1].invars
    if pred.aval.dtype != np.bool_ or graph.uniform(zero) != 0.0:
        return None
    hd = _prod(graph, scaled, "div")
    if hd is None or is_literal(hd[1].invars[0]):
        return None
    p = hd[1].invars[0]
    kp = graph.uniform(hd[1].invars[1])
    if kp is None or not 0 < kp < 1 or 1.0 - (1.0 - kp) != kp:
        return None
    mine = {h[0], hd[0]}
    keep = pred
    hb = _prod(graph, pred, "broadcast_in_dim")
    if hb is not None:
        mine.add(hb[0])
        keep = hb[1].invars[0]
    shape, pshape = tuple(keep.aval.shape), tuple(p.aval.shape)
    broadcast = _dropout_broadcast(shape, pshape)
    found = bernoulli_mask(graph, keep, kp)
    if broadcast is None or not isinstance(found, BernoulliMask):
        return None
    if found.nk and (broadcast or pshape[:found.nk] != shape[:found.nk]):
        return None
    part |= mine | found.eqns
    return p, (found.key, kp, broadcast, True)


def _fill(graph: Graph, v, dtype) -> str | float | None:
    val = graph.uniform(v)
    if val is None:
        return None
    if val == float(jnp.finfo(dtype).min):
        return "min"
    big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
    if np.float32(val) == np.float32(-0.7 * big):
        return "large"
    return val if math.isfinite(val) else None      # any other constant (-1e9, -1e4, 0)


def _reaches_dot(graph: Graph, x, depth: int = 0) -> bool:
    """``x`` is computed from a ``dot_general`` through transposes, casts and constant
    scalings (the scores side of ``scores + bias``)."""
    if depth > 8:
        return False
    h = _prod(graph, x, ("dot_general", "transpose", "convert_element_type", "mul", "div"))
    if h is None:
        return False
    eq = h[1]
    if eq.primitive.name == "dot_general":
        return True
    if eq.primitive.name in ("mul", "div"):
        xs = [u for u in eq.invars if graph.uniform(u) is None]
        return len(xs) == 1 and _reaches_dot(graph, xs[0], depth + 1)
    return _reaches_dot(graph, eq.invars[0], depth + 1)


def _match_one(graph: Graph, d2_index: int):
    eqns = graph.jaxpr.eqns
    d2 = eqns[d2_index]
    used = {d2_index}
    (lc2, rc2), (lb2, rb2) = d2.params["dimension_numbers"]
    _need(bool(lc2), "")  # no contraction: a head factor or an outer product, not P v
    a, b = d2.invars
    # which operand holds the weights: the one that is a softmax (maybe cast)
    found = why = None
    for cand, other, pc, pb, vc, vb, pside in ((a, b, lc2, lb2, rc2, rb2, "lhs"),
                                               (b, a, rc2, rb2, lc2, lb2, "rhs")):
        part: set[int] = set()
        p, factor = _peel_factor(graph, cand, part)
        p, dropout = _peel_dropout(graph, p, part)
        weights_dtype = None
        h = _prod(graph, p, "convert_element_type")
        if h is not None:
            part.add(h[0])
            p = h[1].invars[0]
            weights_dtype = str(h[1].outvars[0].aval.dtype)
        if not _softmax_like(graph, p):
            continue
        if _prod(graph, p, "select_n") is not None:
            why = why or ("softmax-like weights masked after the softmax "
                          "(jax.nn.softmax(where=...)): not matched yet")
            continue
        try:
            s2 = _softmax(graph, p, part)
        except _NoMatch as e:
            why = why or f"softmax-like weights ({e})"
            continue
        found = (p, s2, other, pc, pb, vc, vb, pside, weights_dtype, part, factor, dropout)
        break
    _need(found is not None, why or "")  # not a softmax-weighted product: no row
    p, s2, v, pc, pb, vc, vb, pside, weights_dtype, part, factor, dropout = found
    used |= part
    r = len(p.aval.shape)
    _need(tuple(pc) == (r - 1,),
          "the weights are not contracted over their softmax (last) axis")
    # walk back from the softmax input to q k^T; c2f: axis of ``s`` -> axis of ``s2``
    s, c2f = s2, list(range(r))

    def transposes():
        nonlocal s, c2f
        while (h := _prod(graph, s, "transpose")) is not None:
            new = [None] * r
            for j, pj in enumerate(h[1].params["permutation"]):
                new[pj] = c2f[j]
            c2f, s = new, h[1].invars[0]
            used.add(h[0])

    transposes()
    softmax_dtype = None
    h = _prod(graph, s, "convert_element_type")
    if h is not None:
        used.add(h[0])
        s = h[1].invars[0]
        softmax_dtype = str(s2.aval.dtype)
        transposes()
    mask = fill = keep_negated = None
    h = _prod(graph, s, "select_n")
    if h is not None:
        i, sel = h
        pred, c0, c1 = sel.invars
        _need(pred.aval.dtype == np.bool_, "masked scores: the mask is not boolean")
        if _fill(graph, c0, s.aval.dtype) is not None and not graph.is_const(c1):
            fill, x, keep_negated = _fill(graph, c0, s.aval.dtype), c1, False
        elif _fill(graph, c1, s.aval.dtype) is not None and not graph.is_const(c0):
            fill, x, keep_negated = _fill(graph, c1, s.aval.dtype), c0, True
        else:
            raise _NoMatch("masked scores: the fill value is not a finite constant")
        used.add(i)
        mask, s = (pred, list(c2f)), x
        transposes()
    bias = None
    bias_negated = False
    h = _prod(graph, s, ("add", "sub"))
    if h is not None:
        i, add = h
        x0, x1 = add.invars
        if _reaches_dot(graph, x0) and graph.uniform(x1) is None:
            s, bias = x0, (x1, list(c2f))
            bias_negated = add.primitive.name == "sub"
        elif add.primitive.name == "add" and _reaches_dot(graph, x1) and graph.uniform(x0) is None:
            s, bias = x1, (x0, list(c2f))
        else:
            raise _NoMatch(f"scores {'plus' if add.primitive.name == 'add' else 'minus'} a bias "
                           "that is not traced to q k^T")
        used.add(i)
        transposes()
    scale = divisor = None
    h = _prod(graph, s, ("mul", "div"))
    if h is not None:
        i, eq = h
        x0, x1 = eq.invars
        if eq.primitive.name == "mul":
            c = graph.uniform(x1) if graph.uniform(x1) is not None else graph.uniform(x0)
            s = x0 if graph.uniform(x1) is not None else x1
            _need(c is not None, "scores multiplied by a non-constant")
            scale = c
        else:
            c = graph.uniform(x1)
            _need(c is not None and c != 0, "scores divided by a non-constant")
            divisor, s = c, x0
        used.add(i)
        transposes()
    logits_cast = None
    h = _prod(graph, s, "convert_element_type")
    if h is not None and _prod(graph, h[1].invars[0], "dot_general") is not None:
        used.add(h[0])
        logits_cast = str(s.aval.dtype)   # scores cast right after q k^T (bf16 -> f32)
        s = h[1].invars[0]
    h = _prod(graph, s, "dot_general")
    _need(h is not None, "softmax input is not traced to a q k^T product")
    d1_index, d1 = h
    used.add(d1_index)
    x, y = d1.invars
    (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
    nb = len(lb)
    xfree = [d for d in range(len(x.aval.shape)) if d not in lc and d not in lb]
    yfree = [d for d in range(len(y.aval.shape)) if d not in rc and d not in rb]
    key_d1 = c2f.index(r - 1)            # the axis of q k^T the softmax runs over
    if key_d1 >= nb + len(xfree):
        _need(len(yfree) == 1, "the key operand of q k^T has more than one free axis")
        q, k, qb, kb, qc, kc, qfree, kfree = x, y, lb, rb, lc, rc, xfree, yfree
        qpos = list(range(nb, nb + len(xfree)))
    else:
        _need(key_d1 >= nb, "the softmax runs over a batch axis of q k^T")
        _need(len(xfree) == 1, "the key operand of q k^T has more than one free axis")
        q, k, qb, kb, qc, kc, qfree, kfree = y, x, rb, lb, rc, lc, yfree, xfree
        qpos = list(range(nb + 1, r))
    _need(len(qfree) >= 1, "q k^T has no query axis")
    _need(q.aval.dtype == k.aval.dtype == v.aval.dtype, "q, k, v of different dtypes")
    # canonical layout of the scores: batch axes (q k^T's order), query axes (q's), key
    canon = {i: i for i in range(nb)}
    canon.update({d: nb + j for j, d in enumerate(qpos)})
    canon[key_d1] = r - 1
    f2c = [canon[c2f.index(f)] for f in range(r)]      # softmax-input axis -> canonical
    _need(len(pb) == nb and sorted(f2c[d] for d in pb) == list(range(nb)),
          "the weights' batch axes in the last product are not those of q k^T")
    simple = f2c == list(range(r)) and list(pb) == list(range(nb)) and len(qfree) == 1
    _need(simple or (factor is None and dropout is None),
          "a head factor / attention dropout on transposed or grouped weights")
    # every interior value is used inside the pattern only
    for j in used - {d2_index}:
        for o in eqns[j].outvars:
            _need(graph.only_used_by(o, used),
                  "an attention interior value (scores / weights) is used elsewhere")
    spec = {"scale": scale, "divisor": divisor, "fill": "min" if fill is None else fill,
            "softmax_dtype": softmax_dtype,
            "weights_dtype": weights_dtype, "qk_precision": d1.params.get("precision"),
            "pv_precision": d2.params.get("precision")}
    logits = logits_cast or str(s.aval.dtype)
    if logits != str(q.aval.dtype):
        spec["logits_dtype"] = logits
    v_batch = [None] * nb
    for d, dv in zip(pb, vb):
        v_batch[f2c[d]] = dv
    vfree = [d for d in range(len(v.aval.shape)) if d not in vc and d not in vb]
    wfree = [d for d in range(r) if d not in pb and d not in pc]
    wl = [f2c[d] for d in wfree]
    vl = [r - 1 + j for j in range(len(vfree))]
    out_perm = [f2c[d] for d in pb] + (wl + vl if pside == "lhs" else vl + wl)
    qsizes = tuple(q.aval.shape[d] for d in qfree)
    layout = {"q_perm": tuple(qb) + tuple(qfree) + tuple(qc),
              "k_perm": tuple(kb) + tuple(kfree) + tuple(kc),
              "v_perm": tuple(v_batch) + tuple(vc) + tuple(vfree),
              "nq": len(qfree), "nvf": len(vfree), "nb": nb, "r": r,
              "qsizes": qsizes, "vsizes": tuple(v.aval.shape[d] for d in vfree),
              "out_perm": tuple(out_perm), "keep_negated": keep_negated,
              "bias_negated": bias_negated,
              "factor": factor, "dropout_key": None}
    if dropout is not None:
        key, kp, broadcast, select = dropout
        spec["dropout_rate"] = 1.0 - kp
        spec["broadcast_dropout"] = broadcast
        spec["dropout_select"] = select
        layout["dropout_key"] = key

    def scores_source(var, v2f):
        src, dims = _source(graph, var)
        cd = tuple(None if d is None else f2c[v2f[d]] for d in dims)
        return src, cd

    def mask_sources(var, v2f):
        return [(src, tuple(None if d is None else f2c[v2f[d]] for d in dims))
                for src, dims in _and_leaves(graph, var)]

    bias = None if bias is None else scores_source(*bias)
    mask = None if mask is None else mask_sources(*mask)
    return used, q, k, v, bias, mask, spec, layout


def _relaid(heads, x, perm, nfree):
    """``heads(x, perm, nfree)``, recorded as that relayout of ``x``'s recomputation when
    ``x`` is a projection recorded for the core (``transform(..., projections=True)``)."""
    from jaxmem._prims.recipes import PROJECTED, depth, then
    out = heads(x, perm, nfree)
    if depth(x) == PROJECTED:
        then(out, functools.partial(heads, perm=perm, nfree=nfree), x)
    return out


def _emit_fn(spec_kw: dict, layout: dict, bias_dims, mask_dims):
    """``emit(q, k, v, [bias], [mask], [factor], [key])`` for one matched layout."""
    from jaxmem.selective.attention import AttentionSpec, attention_core

    spec = AttentionSpec(**spec_kw)
    nb, r, nq, qsizes = layout["nb"], layout["r"], layout["nq"], layout["qsizes"]

    def heads(x, perm, nfree):
        x = jnp.transpose(x, perm)
        lead, free = x.shape[:nb], x.shape[nb:nb + nfree]
        x = x.reshape(*lead, math.prod(free), math.prod(x.shape[nb + nfree:]))
        return jnp.expand_dims(x, nb + 1)                          # (*B, T, 1, D)

    def scores_like(a, cd):
        """A bias / mask source with canonical axes ``cd`` -> ``(*B, 1, T', S)``."""
        if a is None:
            return None
        keep = [i for i, d in enumerate(cd) if d is not None]
        a = jnp.reshape(a, [a.shape[i] for i in keep])
        ds = [cd[i] for i in keep]
        order = sorted(range(len(ds)), key=lambda i: ds[i])
        shape = [1] * r
        for i in order:
            shape[ds[i]] = a.shape[i]
        a = jnp.reshape(jnp.transpose(a, order), shape)
        qs = shape[nb:nb + nq]
        if all(n == 1 for n in qs):
            a = jnp.reshape(a, shape[:nb] + [1, shape[-1]])
        else:                                   # query axes merged: broadcast them first
            full = shape[:nb] + list(qsizes) + [shape[-1]]
            a = jnp.reshape(jnp.broadcast_to(a, full),
                            shape[:nb] + [math.prod(qsizes), shape[-1]])
        return jnp.expand_dims(a, nb)

    def emit(q, k, v, *extra):
        extra = list(extra)
        bias = extra.pop(0) if bias_dims is not None else None
        masks = [extra.pop(0) for _ in mask_dims or ()]
        mask = None
        for a, cd in zip(masks, mask_dims or ()):      # the sources of an ``and`` tree
            a = scores_like(a, cd)
            mask = a if mask is None else jnp.logical_and(mask, a)
        qh = _relaid(heads, q, layout["q_perm"], nq)
        kh = _relaid(heads, k, layout["k_perm"], 1)
        vh = _relaid(heads, v, layout["v_perm"], 1)
        if mask is not None and layout["keep_negated"]:
            mask = jnp.logical_not(mask)
        rng = extra.pop() if layout["dropout_key"] is not None else None
        if bias is not None and layout["bias_negated"]:              # s - b = s + (-b)
            bias = -bias
        o = attention_core(qh, kh, vh, bias=scores_like(bias, bias_dims),
                           mask=mask, rng=rng, spec=spec)
        if layout["factor"] is not None:                           # (P f) v = (P v) f
            fac = jnp.reshape(extra.pop(0), layout["factor"][1])
            o = o * fac.reshape(fac.shape[:nb] + (1, 1, 1)).astype(o.dtype)
        o = o.reshape(*o.shape[:nb], *qsizes, *layout["vsizes"])   # (*B, *Q, *Dv)
        return [jnp.transpose(o, layout["out_perm"])]

    return emit


#: What an attention core keeps for its backward (the row's reason).
KEEPS = "keeps q, k, v and row statistics, no T x S array"


def projected_row(row: Row, seen: list) -> Row:
    """``row`` once its attention core was emitted: ``seen`` (from
    :func:`jaxmem.selective.attention.projections_seen`) names, per core call, the inputs
    recorded as a projection of a normalisation's output, which the core does not store when
    that norm keeps its residuals (``transform(..., projections=True)``)."""
    names = sorted({n for call in seen for n in call}, key="qkv".index)
    which = ", ".join(names)
    rest = [n for n in "qkv" if n not in names]
    kept = f"keeps {', '.join(rest)} and row statistics" if rest else "keeps row statistics"
    return dataclasses.replace(row, reason=(
        f"{kept}; {which}: recomputed in the backward from their projection's inputs and "
        f"weights where the normalisation before it keeps them (else stored); no T x S array"))


def match_attention(graph: Graph, path: str,
                    query_chunk: int | None = None) -> list[Match | Row]:
    """Attention subgraphs of ``graph`` (matches, and rows for softmax-weighted products
    that did not match, with the reason); cores of more than ``query_chunk`` query rows run
    that many at a time (:mod:`jaxmem.selective.attention_chunks`)."""
    out: list[Match | Row] = []
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if eqn.primitive.name != "dot_general":
            continue
        try:
            used, q, k, v, bias, mask, spec, layout = _match_one(graph, i)
        except _NoMatch as e:
            if str(e):
                out.append(Row("attention", f"softmax-weighted dot_general -> "
                               f"{aval_str(eqn.outvars[0])}", "", False, str(e),
                               location(eqn), name_stack(eqn), path))
            continue
        inputs = [q, k, v]
        bias_dims = mask_dims = None
        if bias is not None:
            inputs.append(bias[0])
            bias_dims = bias[1]
        if mask is not None:
            inputs += [src for src, _ in mask]
            mask_dims = [cd for _, cd in mask]
        if layout["factor"] is not None:
            inputs.append(layout["factor"][0])
        if layout["dropout_key"] is not None:
            inputs.append(layout["dropout_key"])
        emit = _emit_fn(dict(spec, query_chunk=query_chunk), layout, bias_dims, mask_dims)
        scaled = spec["scale"] if spec["divisor"] is None else spec["divisor"]
        parts = [k for k, x in (("scale", scaled), ("bias", bias), ("mask", mask),
                                ("head factor", layout["factor"]),
                                ("dropout", layout["dropout_key"])) if x is not None]
        if layout["nq"] > 1:
            parts.append(f"{layout['nq']} query axes")
        what = (f"attention q {aval_str(q)} k {aval_str(k)} v {aval_str(v)}"
                + (f" [{', '.join(parts)}]" if parts else ""))
        rows = math.prod(layout["qsizes"])
        became = ("jaxmem.selective.attention_core (exact)" if query_chunk is None
                  or rows <= query_chunk else "jaxmem.selective.attention_core (exact, "
                  f"{query_chunk} of {rows} query rows at a time)")
        row = Row("attention", what, became, True, KEEPS, location(eqn), name_stack(eqn), path)
        out.append(Match(frozenset(used), i, inputs, list(eqn.outvars), emit, row))
    return out
