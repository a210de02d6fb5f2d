"""Standalone dropout -> :func:`jaxmem.selective.dropout` (the mask regenerated from the key).

Matched (Flax's ``nn.Dropout``, Hugging Face's hidden dropout, Equinox's ``Dropout``,
``jnp.where(jax.random.bernoulli(key, keep, shape), x / keep, 0)``)::

    m = bernoulli(key, keep, bshape)     checked by re-tracing ``jax.random.bernoulli``
    m = broadcast(m)                      optional (dropout shared along some axes)
    y = select_n(m, 0, x / keep)          (``where(m, x / keep, 0)``)

with every interior value (the random bits, the mask, ``x / keep``) used inside the pattern
only.  JAX's autodiff keeps the boolean mask (1 byte per element); the re-emitted
:func:`jaxmem.selective.dropout` keeps the key and regenerates the very same mask from it in
the backward pass.  Exact: the forward is the same arithmetic on the same random bits.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxmem.transform.graph import Graph, first_location, is_literal, name_stack
from jaxmem.transform.match import Match, aval_str
from jaxmem.transform.match_random import bernoulli_mask
from jaxmem.transform.report import Row

__all__ = ["match_dropout"]


def _prod(graph: Graph, v, name: str):
    if is_literal(v):
        return None
    i = graph.producer.get(v)
    if i is None or graph.jaxpr.eqns[i].primitive.name != name:
        return None
    return i, graph.jaxpr.eqns[i]


def _one(graph: Graph, i: int, taken: set[int], path: str) -> Match | Row | None:
    eqns = graph.jaxpr.eqns
    sel = eqns[i]
    if len(sel.invars) != 3:
        return None
    pred, zero, scaled = sel.invars
    if pred.aval.dtype != np.bool_ or graph.uniform(zero) != 0.0:
        return None
    hd = _prod(graph, scaled, "div")
    if hd is None:
        return None
    x, c = hd[1].invars
    kp = graph.uniform(c)
    if kp is None or not 0 < kp < 1 or is_literal(x) or graph.is_const(x):
        return None
    part = {i, hd[0]}
    keep = pred
    hb = _prod(graph, pred, "broadcast_in_dim")
    if hb is not None:
        part.add(hb[0])
        keep = hb[1].invars[0]
    where = first_location([sel, hd[1]] + ([hb[1]] if hb is not None else []))
    ns = name_stack(sel)
    what = f"dropout {aval_str(x)} keep {kp:g}"
    shape = tuple(keep.aval.shape)
    xshape = tuple(x.aval.shape)
    mask = bernoulli_mask(graph, keep, kp)
    if mask is None:
        return None                         # a select on something else than random bits
    if len(shape) != len(xshape) or any(a not in (1, b) for a, b in zip(shape, xshape)):
        return Row("dropout", what, "", False, "the mask does not broadcast along x's axes",
                   where, ns, path)
    if isinstance(mask, str):
        return Row("dropout", what, "", False, mask, where, ns, path)
    # a batch of keys (``jax.vmap`` over per-example keys, Equinox): one mask per key,
    # over the leading axes
    key, nk = mask.key, mask.nk
    if xshape[:nk] != shape[:nk]:
        return Row("dropout", what, "", False, "a batch of keys that is not x's leading axes",
                   where, ns, path)

    def per_key(fn):
        for _ in range(nk):
            fn = jax.vmap(fn)
        return fn

    part |= mask.eqns
    if part & taken:
        return None
    for j in part:
        for v in eqns[j].outvars:
            if j != i and not graph.only_used_by(v, part):
                return Row("dropout", what, "", False,
                           "the mask or the scaled input is used elsewhere", where, ns, path)
    rate = 1.0 - kp
    if 1.0 - rate != kp:
        return Row("dropout", what, "", False, f"keep {kp!r} is not 1 - (1 - keep) in float64",
                   where, ns, path)
    bdims = tuple(d for d, (a, b) in enumerate(zip(shape, xshape)) if a == 1 and b != 1)
    if any(d < nk for d in bdims):
        return Row("dropout", what, "", False, "a mask shared along the axes of its keys",
                   where, ns, path)

    def emit(k, xv):
        from jaxmem.selective import dropout
        dims = tuple(d - nk for d in bdims)
        return [per_key(lambda kk, xx: dropout(kk, xx, rate, broadcast_dims=dims))(k, xv)]

    row = Row("dropout", what + (f" shared along {bdims}" if bdims else ""),
              "jaxmem.selective.dropout", True, "keeps the key; the mask is regenerated",
              where, ns, path)
    return Match(frozenset(part), i, [key, x], [sel.outvars[0]], emit, row)


def match_dropout(graph: Graph, taken: set[int], path: str) -> list[Match | Row]:
    """Dropout patterns of ``graph`` not among the equations ``taken``."""
    out: list[Match | Row] = []
    mine: set[int] = set()
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if i in taken or i in mine or eqn.primitive.name != "select_n":
            continue
        item = _one(graph, i, taken | mine, path)
        if item is None:
            continue
        if isinstance(item, Match):
            mine |= item.eqns
        out.append(item)
    return out
