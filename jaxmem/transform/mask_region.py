"""The 1-bit mask of a two-slope activation as the comparison its derivative selects on.

A piecewise-linear subgraph ``f`` with slopes ``lo < hi`` keeps ``M(x) = [f'(x) is hi]``
(:func:`~jaxmem.transform.match_elementwise.mask_activation`).  Computed literally, from the
forward-mode derivative ``d = jvp(f, x, 1)``, that is ``|d - hi| <= |d - lo|``: for
``jax.nn.relu`` ``select(x > 0, 1, 0)``, then a subtraction, two absolute values and a
comparison, all on ``x``'s shape.  XLA:GPU does not fuse so many operations into the
bit-packing reduction that reads them (it would recompute them per packed byte): it writes
an unpacked ``u8`` copy of the mask, one byte per element, and keeps *that* until the
backward pass (NNX CNN: 256 KiB more than the mask ``x > 0`` of the hand-written op).

:func:`mask_predicate` reads the comparison off the derivative's own jaxpr instead: ``d`` is
built by ``select_n`` from constants (through casts, products and sums of constants), so
``M`` is a boolean combination of the very predicates ``f``'s derivative rule selects on
(``x > 0`` for ``relu``, ``x == max(x, 0)`` for a bare ``max``, ``0 < x < 6`` for
``relu6``), each constant leaf ``c`` resolved to ``|c - hi| <= |c - lo|`` exactly as the
literal rule would resolve it.  The mask is therefore the same, bit for bit; where ``d`` is
not such a selection (nothing is found), the literal rule is used.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.transform.graph import bind_eqns, inline_calls, is_literal

__all__ = ["mask_predicate"]

#: binary arithmetic folded on constant leaves
_ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum}
#: unary operations that keep a value (shape and elements)
_SAME = {"copy", "copy_p", "reshape", "squeeze", "expand_dims"}


class _Sel:
    """``select_n(pred, *cases)`` with each case a constant or a ``_Sel``."""

    def __init__(self, pred, cases):
        self.pred, self.cases = pred, tuple(cases)


def _const(x, dtype) -> np.ndarray | None:
    a = np.asarray(x)
    if a.size != 1:
        if a.size == 0 or not np.all(a == a.reshape(-1)[0]):
            return None
        a = a.reshape(-1)[0]
    return np.asarray(a.reshape(()), dtype=dtype)


def _map(v, fn):
    if isinstance(v, _Sel):
        cases = [_map(c, fn) for c in v.cases]
        return None if any(c is None for c in cases) else _Sel(v.pred, cases)
    return fn(v)


def _combine(a, b, fn):
    """``fn`` applied to two values (constants or selections) leaf by leaf."""
    if isinstance(a, _Sel):
        cases = [_combine(c, b, fn) for c in a.cases]
        return None if any(c is None for c in cases) else _Sel(a.pred, cases)
    if isinstance(b, _Sel):
        cases = [_combine(a, c, fn) for c in b.cases]
        return None if any(c is None for c in cases) else _Sel(b.pred, cases)
    return fn(a, b)


def _folded(fn, dt):
    """``fn`` on two constants, computed and rounded in ``dt``."""
    def fold(a, b):
        return np.asarray(fn(np.asarray(a, dt), np.asarray(b, dt)), dtype=dt)
    return fold


def _values(jaxpr, shape) -> dict:
    """Each variable of ``jaxpr`` that is a constant or a selection among them, by value."""
    val: dict = {}

    def get(v):
        if is_literal(v):
            return _const(v.val, v.aval.dtype)
        return val.get(v)

    for eqn in jaxpr.eqns:
        if len(eqn.outvars) != 1:
            continue
        o, name = eqn.outvars[0], eqn.primitive.name
        dt = getattr(o.aval, "dtype", None)
        ins = [get(v) for v in eqn.invars]
        out: Any = None
        if name == "broadcast_in_dim" and ins and isinstance(ins[0], np.ndarray):
            out = ins[0]
        elif name == "convert_element_type" and ins and ins[0] is not None:
            out = _map(ins[0], lambda c, dt=dt: np.asarray(c).astype(dt))
        elif name in _SAME and ins and ins[0] is not None and _shape(o) == _shape(eqn.invars[0]):
            out = ins[0]
        elif name == "neg" and ins and ins[0] is not None:
            out = _map(ins[0], lambda c, dt=dt: np.asarray(-c, dtype=dt))
        elif name in _ARITH and len(ins) == 2 and not any(i is None for i in ins):
            with np.errstate(all="ignore"):
                out = _combine(ins[0], ins[1], _folded(_ARITH[name], dt))
        elif name == "select_n" and len(ins) >= 2 and not any(i is None for i in ins[1:]):
            p = eqn.invars[0]
            if is_literal(p):
                out = ins[1 + int(np.asarray(p.val))]
            elif _shape(p) == shape and len(ins) == 3 and p.aval.dtype == np.bool_:
                out = _Sel(p, ins[1:])
        if out is not None:
            val[o] = out
    return val


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _region(v, lo: float, hi: float):
    """``[|d - hi| <= |d - lo|]`` of a value ``v``: a Python bool (constant), a predicate
    expression, or ``None``."""
    if isinstance(v, _Sel):
        r0, r1 = (_region(c, lo, hi) for c in v.cases)
        if r0 is None or r1 is None:
            return None
        if isinstance(r0, bool) and isinstance(r1, bool):
            if r0 == r1:
                return r0
            return ("var", v.pred) if r1 else ("not", ("var", v.pred))
        return ("where", v.pred, r1, r0)
    c = np.asarray(v)
    dt = c.dtype
    return bool(np.abs(c - np.asarray(hi, dt)) <= np.abs(c - np.asarray(lo, dt)))


def _preds(expr, acc: set) -> set:
    if isinstance(expr, tuple):
        if expr[0] in ("var", "where"):
            acc.add(expr[1])
        for e in expr[1:]:
            _preds(e, acc)
    return acc


def _eval(expr, env):
    if isinstance(expr, bool):
        return expr
    kind = expr[0]
    if kind == "var":
        return env[expr[1]]
    if kind == "not":
        return jnp.logical_not(_eval(expr[1], env))
    return jnp.where(env[expr[1]], _eval(expr[2], env), _eval(expr[3], env))


def mask_predicate(sub, lo: float, hi: float):
    """``M(x)`` for the subgraph ``sub`` (slopes ``lo < hi``) built from the predicates its
    derivative selects on, or ``None`` when its derivative is not such a selection."""
    spec = jax.ShapeDtypeStruct(sub.shape, sub.dtype)
    closed = jax.make_jaxpr(lambda x: jax.jvp(sub, (x,), (jnp.ones_like(x),))[1])(spec)
    closed = inline_calls(closed, [spec])
    jaxpr = closed.jaxpr
    out = jaxpr.outvars[0]
    if is_literal(out):
        return None
    d = _values(jaxpr, tuple(sub.shape)).get(out)
    expr = None if d is None else _region(d, lo, hi)
    if expr is None or isinstance(expr, bool):
        return None
    # the equations the predicates need, in order
    needed = _preds(expr, set())
    keep = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            keep.append(eqn)
            needed |= {v for v in eqn.invars if not is_literal(v)}
    keep.reverse()
    consts = dict(zip(jaxpr.constvars, closed.consts))
    x_var = jaxpr.invars[0]

    def predicate(x):
        return _eval(expr, bind_eqns(keep, {**consts, x_var: x}))

    return predicate
