"""Attention subgraphs -> the exact memory-lean attention of :mod:`jaxmem.selective`.

Matched, however it was spelled (``jnp.einsum`` + ``jax.nn.softmax``, Flax's
``dot_product_attention``, a hand-written softmax)::

    s = dot_general(q, k)            one free axis each (T of q, S of k), any batch axes
    s = s * c  |  s / c              optional, c a uniform constant          (scale)
    s = s + b                        optional                                 (bias)
    s = select_n(m, fill, s)         optional, fill = finfo.min or -0.7 finfo.max (mask)
    s = convert(s)                   optional                                 (softmax dtype)
    (a cast right after q k^T, e.g. bf16 scores to f32, becomes ``logits_dtype``: the
    product is then accumulated in f32 directly, equal up to the bf16 rounding it skips)
    p = exp(s - max(s)) / sum(...)   softmax over S (the last axis), max optional
    p = convert(p)                   optional                                 (weights dtype)
    p = p * bernoulli(key)/keep      optional (Flax's attention dropout; the recipe is
                                     checked by re-tracing ``jax.random.bernoulli``, and
                                     the core regenerates the mask from ``key``)
    p = p * f                        optional, f constant along T and S (a head mask,
                                     also as ``einsum("...hqk,h->...hqk")`` + transpose);
                                     re-emitted as ``o * f`` since ``(P f) v = (P v) f``
    o = dot_general(p, v) | (v, p)   contracting S

with every interior value used inside the pattern only.  It is re-emitted as
:func:`jaxmem.selective.attention_core` on ``q, k, v`` transposed to ``(..., T, 1, D)``,
``(..., S, 1, D)``, ``(..., S, 1, Dv)`` (the batch axes of the scores, one head), the bias /
mask un-broadcast to their source (so nothing ``T x S`` is stored when they are smaller),
and the result transposed back: forward the same arithmetic, backward flash-style from
``q, k, v`` and two row statistics (no ``T x S`` residual).  Exact up to float rounding
(a division by ``c`` becomes a multiplication by ``1 / c``).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxmem.transform.graph import Graph, is_literal, location, name_stack
from jaxmem.transform.match import Match, aval_str
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


def _softmax(graph: Graph, p, used: set[int]):
    """Match ``p = softmax(s, axis=-1)``; returns ``s``."""
    hit = _prod(graph, p, "div")
    _need(hit is not None, "no softmax division")
    i, div = hit
    used.add(i)
    e, den = div.invars
    nd = len(e.aval.shape)
    # den = broadcast(reduce_sum(e, last axis))
    hit = _prod(graph, den, "broadcast_in_dim")
    if hit is not None:
        used.add(hit[0])
        den = hit[1].invars[0]
    hit = _prod(graph, den, "reduce_sum")
    _need(hit is not None and tuple(hit[1].params["axes"]) == (nd - 1,),
          "softmax denominator is not a sum over the last axis")
    used.add(hit[0])
    _need(hit[1].invars[0] is e, "softmax denominator sums another array")
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
    while True:
        nxt = None
        for name in ("broadcast_in_dim", "stop_gradient", "max", "reshape"):
            h = _prod(graph, m, name)
            if h is not None:
                nxt = h
                break
        if nxt is None:
            break
        j, eq = nxt
        chain.append(j)
        if eq.primitive.name == "max":
            lits = [v for v in eq.invars if graph.uniform(v) == -math.inf]
            _need(len(lits) == 1, "softmax max is not a max with -inf")
            m = next(v for v in eq.invars if v is not lits[0])
        else:
            m = eq.invars[0]
    h = _prod(graph, m, "reduce_max")
    _need(h is not None and tuple(h[1].params["axes"]) == (nd - 1,)
          and h[1].invars[0] is s, "softmax shift is not the row max of its input")
    chain.append(h[0])
    used.update(chain)
    return s


def _source(graph: Graph, v, rank: int):
    """``v`` (of a given rank) traced back through ``broadcast_in_dim`` to its source,
    returned as ``(var, shape)`` where ``shape`` is the source reshaped to ``rank`` axes
    with size-1 axes (broadcastable to ``v``)."""
    h = _prod(graph, v, "broadcast_in_dim")
    if h is not None:
        eq = h[1]
        src = eq.invars[0]
        dims = tuple(eq.params["broadcast_dimensions"])
        if not is_literal(src) and list(dims) == sorted(dims):
            shape = [1] * rank
            for d, n in zip(dims, src.aval.shape):
                shape[d] = n
            return src, tuple(shape)
    return v, tuple(v.aval.shape)


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
                src, shape = _source(graph, f, rank)
                if shape[-2:] == (1, 1) and _prod(
                        graph, p, ("div", "convert_element_type")) is not None:
                    part.add(hm[0])
                    return p, (src, shape)
    return x, None


def _signature(eqn) -> str:
    params = sorted((k, repr(v)) for k, v in eqn.params.items()
                    if k not in ("sharding", "out_sharding"))
    lits = [repr(np.asarray(v.val).tolist()) for v in eqn.invars if is_literal(v)]
    return f"{eqn.primitive.name}{params}{lits}"


def _recipe(graph: Graph, keep, part: set[int]):
    """The equations computing ``keep`` from one PRNG key (the input of its
    ``random_bits``): ``(indices, key)`` or ``None``."""
    found: set[int] = set()
    keys: list = []
    stack = [keep]
    seen: set = set()
    while stack:
        v = stack.pop()
        if is_literal(v) or v in seen:
            continue
        seen.add(v)
        i = graph.producer.get(v)
        if i is None:
            if v in graph.consts:
                continue
            return None                       # depends on an input other than the key
        eqn = graph.jaxpr.eqns[i]
        found.add(i)
        if eqn.primitive.name == "random_bits":
            keys.append(eqn.invars[0])
            continue
        stack.extend(eqn.invars)
    if len({id(k) for k in keys}) != 1:
        return None
    return found, keys[0]


def _peel_dropout(graph: Graph, x, part: set[int]):
    """``x = P * (bernoulli(key, keep, shape) / keep)`` (Flax's attention dropout, the mask
    broadcast over the batch axes or not), recognised by re-tracing
    ``jax.random.bernoulli`` and comparing equations: returns ``(P, (key, keep, broadcast))``
    or ``(x, None)``.  ``attention_core`` regenerates the very mask from ``key``."""
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
        rec = _recipe(graph, keep, part)
        if rec is None:
            continue
        eqns, key = rec
        shape = tuple(keep.aval.shape)
        if shape == tuple(p.aval.shape):
            broadcast = False
        elif shape[-2:] == tuple(p.aval.shape[-2:]) and all(n == 1 for n in shape[:-2]):
            broadcast = True
        else:
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
        if sorted(map(_signature, mine_eqns)) != sorted(map(_signature, rj.eqns)):
            continue
        part |= mine | eqns | {hc[0], hd[0]}
        return p, (key, kp, broadcast)
    return x, None


def _fill(graph: Graph, v, dtype) -> str | None:
    val = graph.uniform(v)
    if val is None:
        return None
    if val == float(jnp.finfo(dtype).min):
        return "min"
    big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
    if np.float32(val) == np.float32(-0.7 * big):
        return "large"
    return None


def _match_one(graph: Graph, d2_index: int):
    eqns = graph.jaxpr.eqns
    d2 = eqns[d2_index]
    used = {d2_index}
    (lc2, rc2), (lb2, rb2) = d2.params["dimension_numbers"]
    _need(bool(lc2), "")  # no contraction: a head factor or an outer product, not P v
    a, b = d2.invars
    # which operand holds the weights: the one that is a softmax (maybe cast)
    found = None
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
        try:
            s2 = _softmax(graph, p, part)
        except _NoMatch:
            continue
        found = (p, s2, other, pc, pb, vc, vb, pside, weights_dtype, part, factor, dropout)
        break
    _need(found is not None, "")  # not a softmax-weighted product: no row
    p, s2, v, pc, pb, vc, vb, pside, weights_dtype, part, factor, dropout = found
    used |= part
    rank = len(p.aval.shape)
    nb = rank - 2
    _need(tuple(pc) == (rank - 1,) and tuple(pb) == tuple(range(nb)),
          "the weights are not contracted over their last axis with batch axes first")
    _need(len(v.aval.shape) == nb + 2 and len(vc) == 1,
          "v must have one key axis and one feature axis besides the batch axes")
    softmax_dtype = None
    s = s2
    h = _prod(graph, s, "convert_element_type")
    if h is not None:
        used.add(h[0])
        s = h[1].invars[0]
        softmax_dtype = str(s2.aval.dtype)
    mask = fill = keep_negated = None
    h = _prod(graph, s, "select_n")
    if h is not None:
        i, sel = h
        pred, c0, c1 = sel.invars
        if _fill(graph, c0, s.aval.dtype) is not None and not graph.is_const(c1):
            fill, s, keep_negated = _fill(graph, c0, s.aval.dtype), c1, False
        elif _fill(graph, c1, s.aval.dtype) is not None and not graph.is_const(c0):
            fill, s, keep_negated = _fill(graph, c1, s.aval.dtype), c0, True
        else:
            raise _NoMatch("masked scores: fill value is neither finfo.min nor -0.7 finfo.max")
        used.add(i)
        mask = pred
    bias = None
    h = _prod(graph, s, "add")
    if h is not None:
        i, add = h
        x0, x1 = add.invars
        d0, d1 = _prod(graph, x0, "dot_general"), _prod(graph, x1, "dot_general")
        d0 = d0 or _prod(graph, x0, ("mul", "div"))
        d1 = d1 or _prod(graph, x1, ("mul", "div"))
        if d0 is not None and graph.uniform(x1) is None:
            s, bias = x0, x1
        elif d1 is not None and graph.uniform(x0) is None:
            s, bias = x1, x0
        else:
            raise _NoMatch("scores plus a bias that is not traced to q k^T")
        used.add(i)
    scale = None
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
            scale, s = 1.0 / c, x0
        used.add(i)
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
    q, k = d1.invars
    (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
    lfree = [d for d in range(len(q.aval.shape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(k.aval.shape)) if d not in rc and d not in rb]
    _need(len(lfree) == 1 and len(rfree) == 1 and len(lb) == nb,
          "q k^T must have one query and one key axis besides the batch axes")
    _need(q.aval.dtype == k.aval.dtype == v.aval.dtype, "q, k, v of different dtypes")
    # every interior value is used inside the pattern only
    for j in used - {d2_index}:
        for o in eqns[j].outvars:
            _need(graph.only_used_by(o, used),
                  "an attention interior value (scores / weights) is used elsewhere")
    spec = {"scale": scale, "fill": fill or "min", "softmax_dtype": softmax_dtype,
                "weights_dtype": weights_dtype, "qk_precision": d1.params.get("precision"),
                "pv_precision": d2.params.get("precision")}
    logits = logits_cast or str(s.aval.dtype)
    if logits != str(q.aval.dtype):
        spec["logits_dtype"] = logits
    vfree = [d for d in range(len(v.aval.shape)) if d not in vc and d not in vb]
    layout = {"q_perm": tuple(lb) + tuple(lfree) + tuple(lc),
                  "k_perm": tuple(rb) + tuple(rfree) + tuple(rc),
                  "v_perm": tuple(vb) + tuple(vc) + tuple(vfree),
                  "nq": len(lc), "pside": pside, "nb": nb, "keep_negated": keep_negated}
    layout["factor"] = factor
    layout["dropout_key"] = None
    if dropout is not None:
        key, kp, broadcast = dropout
        spec["dropout_rate"] = 1.0 - kp
        spec["broadcast_dropout"] = broadcast
        layout["dropout_key"] = key
    return used, q, k, v, bias, mask, spec, layout


def _emit_fn(spec_kw: dict, layout: dict, bias_shape, mask_shape):
    """``emit(q, k, v, [bias], [mask])`` for one matched layout."""
    from jaxmem.selective.attention import AttentionSpec, attention_core

    spec = AttentionSpec(**spec_kw)
    nb = layout["nb"]

    def heads(x, perm, nlast):
        x = jnp.transpose(x, perm)
        lead = x.shape[:nb + 1]
        x = x.reshape(*lead, math.prod(x.shape[nb + 1:]) if nlast else 1)
        return jnp.expand_dims(x, nb + 1)                          # (*B, T, 1, D)

    def scores_like(a, shape):
        return None if a is None else jnp.expand_dims(jnp.reshape(a, shape), nb)

    def emit(q, k, v, *extra):
        extra = list(extra)
        bias = extra.pop(0) if bias_shape is not None else None
        mask = extra.pop(0) if mask_shape is not None else None
        qh = heads(q, layout["q_perm"], True)
        kh = heads(k, layout["k_perm"], True)
        vh = heads(v, layout["v_perm"], True)
        if mask is not None and layout["keep_negated"]:
            mask = jnp.logical_not(mask)
        rng = extra.pop() if layout["dropout_key"] is not None else None
        o = attention_core(qh, kh, vh, bias=scores_like(bias, bias_shape),
                           mask=scores_like(mask, mask_shape), rng=rng, spec=spec)
        if layout["factor"] is not None:                           # (P f) v = (P v) f
            fac = jnp.reshape(extra.pop(0), layout["factor"][1])
            o = o * fac.reshape(fac.shape[:nb] + (1, 1, 1)).astype(o.dtype)
        o = o.reshape(*o.shape[:nb + 1], o.shape[-1])              # (*B, T, Dv)
        if layout["pside"] == "rhs":                               # dot(v, p): (*B, Dv, T)
            o = jnp.swapaxes(o, -1, -2)
        return [o]

    return emit


def match_attention(graph: Graph, path: str) -> list[Match | Row]:
    """Attention subgraphs of ``graph`` (matches, and rows for softmax-weighted products
    that did not match, with the reason)."""
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
        rank = layout["nb"] + 2
        inputs = [q, k, v]
        bias_shape = mask_shape = None
        if bias is not None:
            bias, bias_shape = _source(graph, bias, rank)
            inputs.append(bias)
        if mask is not None:
            mask, mask_shape = _source(graph, mask, rank)
            inputs.append(mask)
        if layout["factor"] is not None:
            inputs.append(layout["factor"][0])
        if layout["dropout_key"] is not None:
            inputs.append(layout["dropout_key"])
        emit = _emit_fn(spec, layout, bias_shape, mask_shape)
        parts = [k for k, x in (("scale", spec["scale"]), ("bias", bias), ("mask", mask),
                                ("head factor", layout["factor"]),
                                ("dropout", layout["dropout_key"])) if x is not None]
        what = (f"attention q {aval_str(q)} k {aval_str(k)} v {aval_str(v)}"
                + (f" [{', '.join(parts)}]" if parts else ""))
        row = Row("attention", what, "jaxmem.selective.attention_core (exact)", True,
                  "keeps q, k, v and row statistics, no T x S array", location(eqn),
                  name_stack(eqn), path)
        out.append(Match(frozenset(used), i, inputs, list(eqn.outvars), emit, row))
    return out


