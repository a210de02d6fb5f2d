"""Boolean masks drawn with ``jax.random.bernoulli``: what a dropout's mask is computed from.

A dropout re-emitted by the transformation regenerates its mask from the key in the backward
pass, so the mask must be *exactly* ``jax.random.bernoulli(key, keep, shape)`` (one key, or
one mask per key of a batch of keys under ``jax.vmap``) with ``keep`` the value the kept
entries are divided by.  :func:`bernoulli_mask` checks that by re-tracing
``jax.random.bernoulli`` and comparing equations (primitive, parameters, literals), with the
threshold either a literal (Flax) or computed from constants in the program (Equinox's
``1 - stop_gradient(p)``; then its value must equal ``keep`` in float32, the dtype the
comparison with the uniform bits runs in).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxmem.transform.graph import Graph, inline_calls, is_literal

__all__ = ["BernoulliMask", "bernoulli_mask", "key_recipe", "signature"]


def signature(eqn) -> str:
    """An equation's primitive, parameters and literal operands (not its variables)."""
    params = sorted((k, repr(v)) for k, v in eqn.params.items()
                    if k not in ("sharding", "out_sharding"))
    lits = [repr(np.asarray(v.val).tolist()) for v in eqn.invars if is_literal(v)]
    return f"{eqn.primitive.name}{params}{lits}"


def key_recipe(graph: Graph, keep):
    """The equations computing ``keep`` from one PRNG key (the input of its
    ``random_bits``) and constants: ``(indices, key)`` or ``None``."""
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


def _threshold_eqns(graph: Graph, thr, found: set[int]) -> set[int]:
    """The equations among ``found`` computing the constant threshold ``thr``."""
    out: set[int] = set()
    stack = [thr]
    while stack:
        v = stack.pop()
        j = None if is_literal(v) else graph.producer.get(v)
        if j is None or j not in found or j in out or graph.uniform(v) is None:
            continue
        out.add(j)
        stack.extend(graph.jaxpr.eqns[j].invars)
    return out


@dataclasses.dataclass(frozen=True)
class BernoulliMask:
    """``keep == bernoulli(key, keep_prob, shape[nk:])`` per key of ``key`` (``nk`` its
    batch axes, the mask's leading axes); ``eqns``: the equations computing it."""
    eqns: frozenset
    key: object
    nk: int


def bernoulli_mask(graph: Graph, keep, keep_prob: float) -> BernoulliMask | str | None:
    """Whether the boolean ``keep`` is ``jax.random.bernoulli(key, keep_prob, shape)``.

    Returns a :class:`BernoulliMask`, ``None`` where ``keep`` is not computed from one key
    (a select on something else), or the reason it is random bits of another recipe."""
    rec = key_recipe(graph, keep)
    if rec is None:
        return None
    found, key = rec
    eqns = graph.jaxpr.eqns
    lt = next((eqns[j] for j in found if eqns[j].primitive.name == "lt"), None)
    thr = lt.invars[1] if lt is not None else None
    computed = thr is not None and not is_literal(thr) and graph.producer.get(thr) in found
    if computed:
        # the mask is regenerated with ``keep_prob`` (the divisor): a threshold of another
        # value (``where(bernoulli(k, 0.8), x / 0.9, 0)``) would give other bits
        t = graph.uniform(thr)
        if t is None or np.float32(t) != np.float32(keep_prob):
            return f"the mask's keep probability ({t}) is not the divisor ({keep_prob:g})"
        found = found - _threshold_eqns(graph, thr, found)
    shape = tuple(keep.aval.shape)
    nk = len(key.aval.shape)
    if shape[:nk] != tuple(key.aval.shape):
        return "a batch of keys that is not the mask's leading axes"

    def ref(k, *p):
        fn = lambda kk: jax.random.bernoulli(kk, p[0] if p else keep_prob, shape[nk:])
        for _ in range(nk):
            fn = jax.vmap(fn)
        return fn(k)

    try:
        kstruct = jax.ShapeDtypeStruct(key.aval.shape, key.aval.dtype)
        extra = [jax.ShapeDtypeStruct((), thr.aval.dtype)] if computed else []
        rj = inline_calls(jax.make_jaxpr(ref)(kstruct, *extra), [kstruct, *extra]).jaxpr
    except (TypeError, ValueError) as e:
        return f"the key cannot be re-traced: {e}"
    if sorted(signature(eqns[j]) for j in found) != sorted(map(signature, rj.eqns)):
        return "the mask is not jax.random.bernoulli(key, keep, shape)"
    return BernoulliMask(frozenset(found), key, nk)
