"""Jaxpr helpers shared by the matchers and the interpreter.

* :func:`inline_calls` re-traces a closed jaxpr with every plain ``jit`` / ``closed_call``
  body inlined (those calls are transparent: the same arithmetic, no sharding of their own),
  so that a pattern spelled across function boundaries (``jnp.einsum`` and ``jnp.where`` are
  ``jit`` calls) is one flat graph.  Every re-emitted equation keeps the user's source
  location and gets the inlined call's name pushed on its name stack.
* :class:`Graph`: producers, consumers and known constants of one flat jaxpr.
* :func:`location`: ``file:line (function)`` of an equation's user frame.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._compat import core
from jaxmem._compat import source_info_util as siu

__all__ = ["CALL_PRIMS", "Graph", "ancestors", "bind_eqn", "first_location", "inline_calls",
           "is_literal", "location", "name_stack", "structure", "support"]

#: call primitives whose body is inlined before matching
CALL_PRIMS = ("jit", "pjit", "closed_call", "core_call")


def is_literal(v) -> bool:
    return isinstance(v, core.Literal)


def _given(sharding) -> bool:
    """Whether a ``jit`` sharding entry names a sharding (not unspecified / ``AUTO``)."""
    return sharding is not None and type(sharding).__name__ not in ("UnspecifiedValue", "AUTO")


def _inlinable_jit(params: dict) -> bool:
    """A ``jit`` call that inlining keeps the meaning of: no layouts or compiler options of its
    own. Its shardings become sharding constraints on the inlined body's inputs and outputs
    (what a nested ``jit``'s shardings are to XLA's partitioner) and its donation is dropped
    (a nested ``jit`` donates nothing: only the outermost call's buffers can be donated)."""
    layouts = tuple(params.get("in_layouts", ())) + tuple(params.get("out_layouts", ()))
    return all(x is None for x in layouts) and not params.get("compiler_options_kvs")


def _constrained(values: Sequence[Any], shardings: Sequence[Any]) -> list:
    """``values`` under ``lax.with_sharding_constraint`` where ``shardings`` names one."""
    return [jax.lax.with_sharding_constraint(x, s) if _given(s) else x
            for x, s in zip(values, shardings)]


def _inlinable(eqn) -> bool:
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return _inlinable_jit(eqn.params)
    return name in ("closed_call", "core_call")


def _body(eqn) -> core.ClosedJaxpr:
    j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(j, core.Jaxpr):
        j = core.ClosedJaxpr(j, ())
    return j


def bind_eqn(eqn, invals: Sequence[Any], prefix: siu.NameStack | None = None,
             traceback=None) -> list:
    """``eqn`` applied to ``invals`` unchanged, under the equation's own source location
    (``traceback``, the calling equation's, where ``eqn``'s own has no user frame)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with _context(eqn, prefix, traceback), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_eqns(eqns, env: dict) -> dict:
    """``eqns`` bound in order on the values in ``env`` (variable -> value, updated with
    each equation's outputs and returned); literals read as their values."""
    for eqn in eqns:
        outs = bind_eqn(eqn, [v.val if is_literal(v) else env[v] for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return env


def _has_user_frame(tb) -> bool:
    try:
        return tb is not None and siu.user_frame(tb) is not None
    except (AttributeError, TypeError, ValueError):  # a traceback JAX cannot read
        return False


def _context(eqn, prefix: siu.NameStack | None, traceback=None):
    ns = siu.current_name_stack() + eqn.source_info.name_stack
    if prefix is not None:
        ns = siu.NameStack(prefix.stack + ns.stack)
    tb = eqn.source_info.traceback
    if traceback is not None and not _has_user_frame(tb):
        tb = traceback
    return siu.user_context(tb, name_stack=ns)


def context(eqn, prefix: siu.NameStack | None = None):
    """Context manager: trace under ``eqn``'s source location and name stack."""
    return _context(eqn, prefix)


def _eval_inlined(jaxpr: core.Jaxpr, consts, args, prefix: siu.NameStack,
                  traceback=None) -> list:
    """Bind ``jaxpr``'s equations with plain calls inlined; an inlined body's equations
    without a user frame of their own (a library's cached ``jit``) take the call's."""
    env: dict = {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if _inlinable(eqn):
            body = _body(eqn)
            inner = siu.NameStack(prefix.stack + eqn.source_info.name_stack.stack)
            if eqn.primitive.name in ("jit", "pjit"):
                inner = inner.extend(eqn.params.get("name", "jit"))
            tb = eqn.source_info.traceback
            with _context(eqn, prefix, traceback):
                invals = _constrained(invals, eqn.params.get("in_shardings", ()))
            outs = _eval_inlined(body.jaxpr, body.consts, invals, inner,
                                 tb if _has_user_frame(tb) else traceback)
            with _context(eqn, prefix, traceback):
                outs = _constrained(outs, eqn.params.get("out_shardings", ()))
        else:
            outs = bind_eqn(eqn, invals, prefix, traceback)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def has_calls(jaxpr: core.Jaxpr) -> bool:
    return any(_inlinable(e) for e in jaxpr.eqns)


def inline_calls(closed: core.ClosedJaxpr, args: Sequence[Any]) -> core.ClosedJaxpr:
    """``closed`` re-traced on ``args`` (values or tracers) with plain calls inlined."""
    if not has_calls(closed.jaxpr):
        return closed

    def run(*a):
        return _eval_inlined(closed.jaxpr, closed.consts, a, siu.NameStack())

    return jax.make_jaxpr(run)(*args)


def _library_dirs() -> tuple:
    """Folders of the libraries between the user's code and JAX (Flax, optax, jaxmem) that
    are imported: a frame inside them is where a layer is implemented, not where the user
    calls it."""
    import os
    import sys

    mods = (sys.modules.get(name) for name in ("flax", "optax", "jaxmem"))
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in mods
                 if m is not None and getattr(m, "__file__", None))


def location(eqn) -> str:
    """``file:line (function)`` of the user's frame that produced ``eqn`` ('' if unknown): the
    innermost frame outside JAX and outside the libraries of :func:`_library_dirs` (a
    ``Dense`` layer's product is reported where the model calls the layer), else JAX's own
    user frame."""
    try:
        tb = eqn.source_info.traceback
        frames = list(siu.user_frames(tb)) if tb is not None else []
    except (AttributeError, TypeError, ValueError):  # a traceback JAX cannot read
        frames = []
    if not frames:
        return ""
    libs = _library_dirs()
    frame = next((f for f in frames if not f.file_name.startswith(libs)), frames[0])
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def call_location(eqn) -> str:
    """:func:`location` of a higher-order equation; where its own traceback reaches no user
    frame (JAX keeps a few frames only, and a deep call leaves just the libraries'), the
    first user location inside its bodies."""
    where = location(eqn)
    libs = _library_dirs()
    if where and not where.startswith(libs):
        return where
    for body in core.jaxprs_in_params(eqn.params):
        inner = first_location(body.eqns)
        if inner and not inner.startswith(libs):
            return inner
    return where


def first_location(eqns) -> str:
    """The first known :func:`location` among ``eqns`` (an equation inlined from a library's
    ``jit``, e.g. ``jnp.where``'s select, may have none of its own)."""
    for e in eqns:
        where = location(e)
        if where:
            return where
    return ""


def name_stack(eqn) -> str:
    return str(eqn.source_info.name_stack)


def _concrete(x) -> bool:
    return not isinstance(x, core.Tracer)


@dataclasses.dataclass
class Graph:
    """Producers, consumers and concrete constants of one (flat) jaxpr.

    ``consts``: constvar -> concrete value (constvars bound to tracers are not constants).
    A *uniform constant* is a value known at trace time whose elements are all equal (a
    literal, a concrete size-1 constvar, or a broadcast / elementwise function of those);
    :meth:`uniform` returns it as a Python float (``None`` otherwise)."""

    jaxpr: core.Jaxpr
    consts: dict
    producer: dict = dataclasses.field(default_factory=dict)
    consumers: dict = dataclasses.field(default_factory=dict)
    outvars: set = dataclasses.field(default_factory=set)

    @classmethod
    def build(cls, jaxpr: core.Jaxpr, constvals: Sequence[Any]) -> Graph:
        consts = {v: x for v, x in zip(jaxpr.constvars, constvals) if _concrete(x)}
        g = cls(jaxpr, consts)
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                g.producer[v] = i
            for v in eqn.invars:
                if not is_literal(v):
                    g.consumers.setdefault(v, []).append(i)
        g.outvars = {v for v in jaxpr.outvars if not is_literal(v)}
        g._uniform: dict = {}
        return g

    def eqn(self, v):
        i = self.producer.get(v) if not is_literal(v) else None
        return None if i is None else self.jaxpr.eqns[i]

    def uses(self, v) -> list[int]:
        return self.consumers.get(v, [])

    def only_used_by(self, v, allowed: set[int]) -> bool:
        return v not in self.outvars and all(i in allowed for i in self.uses(v))

    def is_const(self, v) -> bool:
        """Known at trace time (a literal, a concrete constvar, or computed from those)."""
        return self.uniform(v) is not None or (not is_literal(v) and v in self.consts)

    def uniform(self, v) -> float | None:
        """The single value of a uniform constant ``v`` (else ``None``)."""
        if is_literal(v):
            val = np.asarray(v.val)
            return float(val.reshape(-1)[0]) if val.size == 1 else None
        if v in self._uniform:
            return self._uniform[v]
        out = None
        if v in self.consts and not _is_key(self.consts[v]):   # numpy refuses typed keys
            val = np.asarray(self.consts[v])
            if val.size >= 1 and jnp.issubdtype(val.dtype, jnp.number):
                flat = val.reshape(-1)
                if np.all(flat == flat[0]):
                    out = float(flat[0])
        else:
            eqn = self.eqn(v)
            if eqn is not None and eqn.primitive.name in _UNIFORM_PRIMS and eqn.invars:
                vals = [self.uniform(u) for u in eqn.invars]
                if all(x is not None for x in vals):
                    out = _fold(eqn, vals)
        self._uniform[v] = out
        return out


def _is_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``: an extended dtype)."""
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.extended)


_UNIFORM_PRIMS = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient",
                  "convert_element_type", "neg", "sqrt", "rsqrt", "mul", "div", "add", "sub",
                  "exp", "log", "copy", "max", "min", "integer_pow",
                  "pvary", "pcast"}  # shard_map's varying-axes casts: the same value


def _fold(eqn, vals) -> float | None:
    """Evaluate a scalar version of a uniform-constant equation in float64."""
    name = eqn.primitive.name
    with np.errstate(all="ignore"):
        if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
                    "stop_gradient", "pvary", "pcast"):
            return vals[0]
        if name == "convert_element_type":
            dt = np.dtype(eqn.params["new_dtype"])
            return float(np.asarray(vals[0]).astype(dt)) if dt.kind in "fiub" else None
        a = np.float64(vals[0])
        table: dict[str, Callable] = {
            "neg": lambda: -a, "sqrt": lambda: np.sqrt(a), "rsqrt": lambda: 1 / np.sqrt(a),
            "exp": lambda: np.exp(a), "log": lambda: np.log(a),
            "integer_pow": lambda: a ** eqn.params["y"],
        }
        if name in table:
            r = table[name]()
        else:
            b = np.float64(vals[1])
            r = {"mul": a * b, "div": a / b, "add": a + b, "sub": a - b,
                 "max": max(a, b), "min": min(a, b)}[name]
        dt = eqn.outvars[0].aval.dtype
        return float(np.asarray(r).astype(dt)) if np.dtype(dt).kind == "f" else float(r)


def ancestors(graph: Graph, i: int, group: set[int]) -> set[int]:
    """Equation ``i`` and the equations of ``group`` it depends on (transitively)."""
    seen = {i}
    stack = [i]
    while stack:
        for v in graph.jaxpr.eqns[stack.pop()].invars:
            j = graph.producer.get(v) if not is_literal(v) else None
            if j is not None and j in group and j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


def support(graph: Graph, vs) -> tuple[set[int], dict]:
    """The equations (indices) and concrete constvars (with values) that compute ``vs``."""
    eqns: set[int] = set()
    consts: dict = {}
    stack = list(vs)
    while stack:
        v = stack.pop()
        if is_literal(v):
            continue
        if v in graph.consts:
            consts[v] = graph.consts[v]
            continue
        i = graph.producer.get(v)
        if i is None or i in eqns:
            continue
        eqns.add(i)
        stack.extend(graph.jaxpr.eqns[i].invars)
    return eqns, consts


def _param_key(v):
    if isinstance(v, (core.ClosedJaxpr, core.Jaxpr)):
        return str(v)
    if callable(v):
        return getattr(v, "__qualname__", type(v).__name__)
    return repr(v)


def structure(eqns, names: dict, consts: dict) -> tuple[tuple, dict]:
    """The computation of ``eqns`` (in order) with its variables named canonically: inputs
    by ``names``, concrete constvars by content, each equation's outputs by ``(k, j)``.
    Returns the parts and the names (outputs included); equal parts compute the same
    function. A variable from elsewhere raises ``KeyError``."""
    ids = dict(names)
    parts = []
    for k, eqn in enumerate(eqns):
        refs = []
        for v in eqn.invars:
            if is_literal(v):
                refs.append(("lit", repr(np.asarray(v.val).tolist()), str(v.aval.dtype)))
            elif v in consts:
                c = consts[v]
                a = np.asarray(jax.random.key_data(c) if _is_key(c) else c)
                refs.append(("const", str(c.dtype), a.shape,
                             hashlib.sha1(a.tobytes()).hexdigest()))
            else:
                refs.append(ids[v])
        for j, v in enumerate(eqn.outvars):
            ids[v] = (k, j)
        params = tuple(sorted((p, _param_key(val)) for p, val in eqn.params.items()))
        parts.append((eqn.primitive.name, params, tuple(refs)))
    return tuple(parts), ids
