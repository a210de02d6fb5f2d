"""Elementwise activation subgraphs -> 1-bit masks (piecewise-linear) or few-bit codes.

An *activation subgraph* is a maximal connected set of elementwise equations (``tanh``,
``erf``, ``logistic``, ``max``, ``select_n``, comparisons, arithmetic with uniform
constants, ``custom_jvp`` calls whose body is elementwise, ...) that all depend on one
array ``x`` only, whose output ``y = f(x)`` has ``x``'s shape, and whose interior values are
used by nothing else.  However it was spelled (``x * 0.5 * (1 + erf(x / sqrt 2))``,
``jax.nn.gelu``, ``max(x, 0)``, ``x * sigmoid(x)``), it computes an elementwise ``f``, and
autodiff keeps one or more ``x``-sized float arrays for ``f'``.  It is re-emitted as:

* **1-bit mask** when ``f`` is piecewise linear with two slopes ``{lo, hi}`` (the ReLU
  family: relu, leaky relu, relu6, hard tanh, ...): forward ``f(x)`` (the same
  equations), backward ``dx = where(M, hi, lo) * dy`` with ``M = [f'(x) == hi]`` computed by
  forward-mode differentiation of the very subgraph (so its own derivative convention at
  the kinks, e.g. ``jax.nn.relu``'s ``f'(0) = 0``, is kept; a bare ``max(x, 0)``, whose
  derivative at ``x == 0`` is ``1/2``, gets ``lo`` there) and stored packed, 8 per byte;
  ``M`` is evaluated as the comparison ``f'`` selects on (``x > 0`` for relu,
  :mod:`~jaxmem.transform.mask_region`).  Exact.  The two slopes are found by evaluating
  ``f'`` in float64 on a probe that covers ``[-10^4, 10^4]`` densely and both sides of
  every constant of the subgraph.
* **few-bit code** of ``x`` when ``fewbit=b`` is given and ``f`` is smooth:
  :func:`jaxmem.fewbit.fit_function` fits the ``2**b``-level piecewise-constant ``q`` that
  minimises ``E (f'(x) - q(x))^2`` on ``[-10, 10]`` (Gaussian weight) for *this* ``f``
  (cached per subgraph structure), and :func:`jaxmem.fewbit.ops.fewbit_op` keeps only the
  ``b``-bit bin of ``x``: ``dx = dy * q(x)``.  Forward exact, gradient approximate.
  Where ``f(x)`` is the input of a product re-emitted as a selective bilinear op (and
  nothing else reading it keeps it), that product keeps ``f(x)`` in full beside the code;
  the exact op below keeps ``x`` alone (``f(x)`` recomputed by the product: fewer stored
  bytes per site, exact gradient) but holds the recomputed ``f(x)`` in its backward. The
  whole program decides (:mod:`~jaxmem.transform.fewbit_sites`): few such sites outside
  ``scan`` bodies keep their codes, many get the exact op -- except in the body of a
  checkpoint without a policy, which the backward pass recomputes whole
  (:mod:`~jaxmem.transform.match_fused`): codes there.
* **exact, input kept** when ``f`` is smooth and ``fewbit`` is ``None``:
  :func:`jaxmem.selective.smooth_activation` keeps ``x`` only and recomputes JAX's own
  ``vjp`` of the subgraph at ``x`` in the backward (exact), and a selective product fed
  ``f(x)`` keeps that same ``x`` and recomputes ``f(x)`` (the mechanism that shares a
  normalisation's residuals with the following product).  Applied where JAX's autodiff of
  the subgraph keeps two or more ``x``-sized arrays (counting ``f(x)`` when a product reads
  it): exact GELU keeps three, SiLU two; ``tanh`` alone keeps ``f(x)`` only and stays.
* left exact otherwise (linear subgraphs keep nothing anyway; a smooth function of reduced
  statistics or one whose output is reduced).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._compat import core
from jaxmem._prims.host import on_host
from jaxmem._prims.ties import vary_like
from jaxmem.transform.fewbit_sites import code_after_products, note_site
from jaxmem.transform.graph import (
    Graph,
    ancestors,
    bind_eqn,
    is_literal,
    location,
    name_stack,
    structure,
    support,
)
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.match_fused import _PRODUCTS, in_recomputed_body
from jaxmem.transform.report import Row

__all__ = ["ELEMENTWISE", "Subgraph", "match_activations"]

_UNARY = {"neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc",
          "erf_inv", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
          "acosh", "atanh", "abs", "sign", "sqrt", "rsqrt", "cbrt", "integer_pow", "square",
          "floor", "ceil", "round", "is_finite", "not", "copy", "copy_p",
          "convert_element_type", "reduce_precision", "lgamma", "digamma"}
_NARY = {"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or", "xor",
         "gt", "ge", "lt", "le", "eq", "ne", "nextafter", "select_n", "clamp"}
#: primitives that are elementwise
ELEMENTWISE = _UNARY | _NARY
#: elementwise primitives that keep a function piecewise linear (mul/div: by a constant)
_PIECEWISE_LINEAR = {"neg", "abs", "sign", "add", "sub", "mul", "div", "max", "min",
                     "select_n", "clamp", "gt", "ge", "lt", "le", "eq", "ne", "and", "or",
                     "not", "copy", "copy_p", "convert_element_type"}
#: primitives that are linear in their one varying operand (nothing to store)
_LINEAR = {"neg", "add", "sub", "mul", "div", "copy", "copy_p", "convert_element_type"}
#: errors of a probe / fit that leave the subgraph as it was (reported)
_FAILURES = (ValueError, TypeError, ArithmeticError, RuntimeError, NotImplementedError)
_WRAPPERS = {"custom_jvp_call", "jit", "pjit", "closed_call"}


def _body(eqn):
    j = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    return j.jaxpr if isinstance(j, core.ClosedJaxpr) else j


def _body_elementwise(jaxpr, pl: bool = False) -> bool:
    """Every equation of a call body is elementwise (piecewise-linear when ``pl``)."""
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in _WRAPPERS:
            if not _body_elementwise(_body(e), pl):
                return False
        elif (name not in (_PIECEWISE_LINEAR if pl else ELEMENTWISE)
              or (pl and name == "mul" and not any(is_literal(v) for v in e.invars))
              or (pl and name == "div" and not is_literal(e.invars[1]))):
            return False
    return True


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _elementwise_eqn(graph: Graph, eqn) -> bool:
    name = eqn.primitive.name
    if name in _WRAPPERS:
        if len(eqn.outvars) != 1 or name == "custom_jvp_call" and eqn.params.get(
                "num_consts", 0):
            return False
        if not _body_elementwise(_body(eqn)):
            return False
    elif name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return False
    shape = _shape(eqn.outvars[0])
    for v in eqn.invars:
        if graph.is_const(v):
            if graph.uniform(v) is None:
                return False
        elif _shape(v) != shape:
            return False
    return True



# ------------------------------------------------------------------------- subgraph
@dataclasses.dataclass(frozen=True, eq=False)
class Subgraph:
    """``y = f(x)``: the equations ``eqns`` (in order; constant-producing ones included)
    from the input variable ``root`` to the output variable ``out``; ``consts`` holds the
    concrete constvars they read."""

    root: Any
    out: Any
    eqns: tuple
    consts: dict
    shape: tuple
    dtype: Any

    def prims(self) -> list[str]:
        return [e.primitive.name for e in self.eqns]

    def __call__(self, x):
        """``f(x)``: the very equations for ``x`` of the traced shape and dtype; for any
        other shape / dtype the same arithmetic with every float computed in ``x``'s dtype
        (used to fit tables in float64)."""
        x = jnp.asarray(x)
        generic = x.shape != self.shape or x.dtype != self.dtype
        env = {self.root: x}
        env.update(self.consts)
        varying = {self.root}          # values computed from x

        def read(v):
            return v.val if is_literal(v) else env[v]

        for eqn in self.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name in _VARYING_CASTS:     # a constant made to vary like x
                outs = [vary_like(v, x) for v in invals]
            elif generic and not any(not is_literal(v) and v in varying for v in eqn.invars):
                # a constant: as traced (a uniform one of x's traced shape is read below
                # as that value in x's shape, whatever shape x has)
                with jax.ensure_compile_time_eval():
                    outs = bind_eqn(eqn, invals)
            elif generic:
                invals = [v if not is_literal(u) and u in varying else
                          _uniform_as(v, self.shape, x) for u, v in zip(eqn.invars, invals)]
                outs = _generic(eqn, invals, x, self.shape)
            else:
                outs = bind_eqn(eqn, invals)
            if any(not is_literal(v) and v in varying for v in eqn.invars):
                varying.update(eqn.outvars)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return env[self.out]


def _uniform_as(val, shape, x):
    """A constant ``val`` of the traced ``shape`` whose elements are all equal (``x +
    skip`` with ``skip`` a closed-over ``jnp.zeros(shape)``: the subgraph is elementwise
    because it is uniform) as that value in ``x``'s shape; anything else unchanged."""
    if tuple(getattr(val, "shape", ())) != tuple(shape) or x.shape == tuple(shape) or \
            isinstance(val, core.Tracer):
        return val
    a = np.asarray(val)
    flat = a.reshape(-1)
    return np.full(x.shape, flat[0], a.dtype) if flat.size and np.all(flat == flat[0]) \
        else val


def _cast(val, x):
    a = jnp.asarray(val)
    return a.astype(x.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else a


#: casts of the varying mesh axes (``shard_map``'s type system): the identity on values; a
#: region re-emitted or evaluated for another ``x`` casts its constants to vary like ``x``
_VARYING_CASTS = {"pvary", "pcast"}


def _generic(eqn, invals, x, shape) -> list:
    name = eqn.primitive.name
    invals = [_cast(v, x) for v in invals]
    if name in _VARYING_CASTS:
        return [vary_like(v, x) for v in invals]
    if name in _WRAPPERS:
        body = _body(eqn)
        env = dict(zip(body.invars, invals))
        consts = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
        if isinstance(consts, core.ClosedJaxpr):
            env.update(zip(body.constvars, consts.consts))
        for e in body.eqns:
            ins = [v.val if is_literal(v) else env[v] for v in e.invars]
            for v, o in zip(e.outvars, _generic(e, ins, x, shape)):
                env[v] = o
        return [_cast(v.val, x) if is_literal(v) else env[v] for v in body.outvars]
    params = dict(eqn.params)
    if name == "convert_element_type" and jnp.issubdtype(params["new_dtype"], jnp.inexact):
        params["new_dtype"] = x.dtype
        params["sharding"] = None
    if name == "broadcast_in_dim" and tuple(params["shape"]) == tuple(shape):
        params["shape"] = x.shape
        params["sharding"] = None
    params = eqn.primitive.get_bind_params(params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def structure_key(sub: Subgraph) -> tuple:
    """Hashable structure of ``sub``: equal keys compute the same function."""
    parts, ids = structure(sub.eqns, {sub.root: "x"}, sub.consts)
    return ((str(sub.dtype), sub.shape),) + parts + (ids[sub.out],)


#: one Subgraph object per structure, so fitted tables and jit caches are shared
_CANON: dict[tuple, Subgraph] = {}


def canonical(sub: Subgraph) -> Subgraph:
    return _CANON.setdefault(structure_key(sub), sub)


# ---------------------------------------------------------------------- classification
def _uses_only(graph: Graph, eqns, allowed, *, wrappers: bool) -> bool:
    """Every equation is in ``allowed`` (``mul`` / ``div`` only by a constant); with
    ``wrappers``, call wrappers whose bodies are piecewise-linear elementwise count too."""
    for e in eqns:
        name = e.primitive.name
        if wrappers and name in _WRAPPERS:
            if not _body_elementwise(_body(e), pl=True):
                return False
            continue
        if name not in allowed:
            return False
        if name == "mul" and not any(graph.is_const(v) for v in e.invars):
            return False
        if name == "div" and not graph.is_const(e.invars[1]):
            return False
    return True


def _is_piecewise_linear(graph: Graph, eqns) -> bool:
    return _uses_only(graph, eqns, _PIECEWISE_LINEAR, wrappers=True)


def _is_linear(graph: Graph, eqns) -> bool:
    return _uses_only(graph, eqns, _LINEAR, wrappers=False)


def _probe(consts: list[float]) -> np.ndarray:
    """Points covering [-1e4, 1e4] densely and both sides of every constant (never a
    constant itself, so no kink is probed exactly)."""
    base = np.linspace(-50.0, 50.0, 20001) + np.pi * 1e-4
    logs = np.logspace(-5, 4, 400)
    pts = [base, logs, -logs]
    for c in consts:
        if np.isfinite(c):
            for s in (1.0, -1.0):
                for eps in (1e-6, 1e-3, 1e-1):
                    d = eps * max(1.0, abs(c))
                    pts.append(np.array([s * c - d, s * c + d]))
    return np.concatenate(pts)


@functools.lru_cache(maxsize=512)
def two_slopes(sub: Subgraph) -> tuple[float, float] | None:
    """``(lo, hi)`` if ``f'`` takes exactly two values on the probe, else ``None``."""
    consts = []
    for e in sub.eqns:
        for v in e.invars:
            if is_literal(v):
                consts.append(float(np.asarray(v.val).reshape(-1)[0]))
    consts += [float(np.asarray(c).reshape(-1)[0]) for c in sub.consts.values()]
    pts = _probe(consts)

    def derivative():
        t = jnp.asarray(pts, jnp.float64)
        return np.asarray(jax.jvp(sub, (t,), (jnp.ones_like(t),))[1], np.float64)

    d = on_host(derivative)
    d = d[np.isfinite(d)]
    vals = np.unique(d)
    if vals.size != 2:
        return None
    lo, hi = float(vals[0]), float(vals[1])
    if not np.isfinite(np.float32(lo)) or not np.isfinite(np.float32(hi)):
        return None
    return lo, hi


@functools.lru_cache(maxsize=512)
def mask_activation(sub: Subgraph):
    """The exact 1-bit op of a two-slope piecewise-linear subgraph."""
    from jaxmem._prims.mask import mask_op
    from jaxmem.transform.mask_region import mask_predicate

    lo, hi = two_slopes(sub)
    # the comparison f's derivative selects on (``x > 0`` for relu), else the literal rule
    predicate = mask_predicate(sub, lo, hi)

    def region(x):
        if predicate is not None and x.shape == sub.shape and x.dtype == sub.dtype:
            return predicate(x)
        d = jax.jvp(sub, (x,), (jnp.ones_like(x),))[1]
        return jnp.abs(d - hi) <= jnp.abs(d - lo)

    return mask_op(sub, region, lo, hi, name=_label(sub))


@functools.lru_cache(maxsize=512)
def fewbit_activation(sub: Subgraph, bits: int):
    """The few-bit op of a smooth subgraph, with a table fitted for it."""
    from jaxmem.fewbit.activations import numpy_derivative
    from jaxmem.fewbit.factory import fit_function
    from jaxmem.fewbit.fit import check_finite_derivative
    from jaxmem.fewbit.ops import fewbit_op

    interval = (-10.0, 10.0)
    check_finite_derivative(numpy_derivative(sub), interval, points=2 * 2048 + 1,
                            what=f"the derivative of {_label(sub)}")
    f = fit_function(sub, bits, interval, None, 2048, None)
    op = fewbit_op(sub, f.borders, f.levels, bits, symmetric=f.symmetric, name=_label(sub))
    return op


@functools.lru_cache(maxsize=512)
def autodiff_keeps(sub: Subgraph) -> tuple[int, bool]:
    """``(n, y_kept)``: how many distinct ``x``-shaped arrays JAX's reverse mode keeps for
    ``f`` (its ``vjp`` residuals, traced abstractly), and whether ``f(x)`` is one of them."""
    def fn(x):
        y, vjp = jax.vjp(sub, x)
        return y, jax.tree_util.tree_leaves(vjp)

    jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(sub.shape, sub.dtype)).jaxpr
    y, res = jaxpr.outvars[0], jaxpr.outvars[1:]
    kept = {v for v in res if not is_literal(v) and _shape(v) == sub.shape}
    return len(kept), y in kept


@functools.lru_cache(maxsize=512)
def exact_activation(sub: Subgraph, tie_whole: bool = False):
    """The exact smooth op of a subgraph: keeps ``x``, recomputes ``vjp(f, x)``;
    ``tie_whole``: its backward reads ``x`` tied whole (:func:`_split_k_output`)."""
    from jaxmem.selective.smooth import smooth_activation

    name = _label(sub)

    def op(x):
        return smooth_activation(sub, x, name=name, tie_whole=tie_whole)

    return op


#: what may stand between a product and an activation's input: a bias add, casts, relayouts
_TO_PRODUCT = frozenset({"add", "convert_element_type", "reshape", "squeeze", "expand_dims",
                         "copy", "broadcast_in_dim"})


def _split_k_output(graph: Graph, r, depth: int = 0) -> bool:
    """Whether ``r`` is a ``dot_general``'s output (through a bias add, casts, relayouts)
    that XLA:GPU may compute as split-K partial sums -- a contraction at least as long as
    the output row (``K >= N``: the MLP of ``benchmarks/transform/bench_blocks.py``, 512 ->
    512, or a down projection, 4d -> d; not an up projection, d -> 4d) -- and whose operands
    no other product reads. XLA:GPU fuses the partial sums' reduction into every reader of
    the output, so an exact op that keeps it and reads it through a scalar tie kept the
    partial sums until the backward pass (the MLP: three 4-way partial sums at the H100
    plan's peak, 6.05 MiB of temp against 3.05); tied whole, it is stored as one array.
    Products sharing an operand are merged by XLA:GPU into one GEMM (a gated unit's gate
    and up projections, ``[x W | x V]``): their slices are read through the scalar tie
    (tied whole, a slice is copied out of the merged output)."""
    e = graph.eqn(r)
    if e is None or depth > 4:
        return False
    name = e.primitive.name
    if name == "dot_general":
        (lc, rc), (_, rb) = e.params["dimension_numbers"]
        lhs, rhs = e.invars
        k = int(np.prod([lhs.aval.shape[d] for d in lc]))
        n = int(np.prod([d for i, d in enumerate(rhs.aval.shape) if i not in rc and i not in rb]))
        return k >= n and all(
            is_literal(v) or sum(graph.jaxpr.eqns[j].primitive.name == "dot_general"
                                 for j in graph.uses(v)) == 1 for v in e.invars)
    if name not in _TO_PRODUCT:
        return False
    return any(not is_literal(v) and _split_k_output(graph, v, depth + 1) for v in e.invars)


def _feeds_product(graph: Graph, o) -> bool:
    return any(graph.jaxpr.eqns[j].primitive.name in _PRODUCTS for j in graph.uses(o))


#: readers of ``f(x)`` whose backward keeps nothing of it (``mul`` / ``div``: by a constant)
_KEEP_NOTHING = {"add", "sub", "neg", "reduce_sum", "mul", "div"}


def _keeps_nothing(graph: Graph, eqn, o) -> bool:
    """``eqn``, reading ``f(x) = o``, keeps nothing of it for its backward: an add, a sum, a
    negation, a product with or a division by a constant."""
    name = eqn.primitive.name
    if name == "mul":
        return any(graph.is_const(v) for v in eqn.invars)
    if name == "div":
        return eqn.invars[0] is o and graph.is_const(eqn.invars[1])
    return name in _KEEP_NOTHING


def _kept_only_by(graph: Graph, o, keeper) -> bool:
    """Some reader of ``o`` is a ``keeper(index, eqn)`` and every other one keeps nothing of
    it (:func:`_keeps_nothing`); ``o`` is not an output."""
    if o in graph.outvars:
        return False
    found = False
    for j in graph.uses(o):
        eqn = graph.jaxpr.eqns[j]
        if keeper(j, eqn):
            found = True
        elif not _keeps_nothing(graph, eqn, o):
            return False
    return found


def _product_keeps_output(graph: Graph, o, products) -> bool:
    """``f(x)`` is the input (``lhs``) of a product converted to a selective bilinear op
    (equation indices ``products``), which would keep ``f(x)`` itself, and nothing else
    reading it keeps it (a residual add, a constant scale): then the exact op, which keeps
    ``x`` and lets that product recompute ``f(x)``, keeps no more than a few-bit code
    (which cannot reproduce ``f(x)``, so the product keeps it in full beside the code)."""
    return bool(products) and _kept_only_by(graph, o, lambda j, eqn: (
        eqn.primitive.name in _PRODUCTS and j in products and eqn.invars[0] is o
        and eqn.invars[1] is not o))


def gate_shaped(shape) -> bool:
    """Whether a product of this shape can be a gated unit's: more than one row (a
    per-channel vector, e.g. a frozen batch norm's ``rsqrt(var) * scale`` of shape
    ``(1, 1, 1, C)``, is left as written)."""
    return int(np.prod(shape[:-1], dtype=np.int64)) > 1


def _gates_product(graph: Graph, o) -> bool:
    """``f(x)`` is a factor of an elementwise product with another traced value of its
    shape (a gated linear unit's ``f(x W) * (x V)``), and nothing else reading it keeps it
    (a square does): re-emitted as :func:`jaxmem.selective.gated_product`, that product
    keeps ``x`` (the exact op's residual) instead of ``f(x)``, which a few-bit code would not
    spare."""
    def gate(j, eqn):
        if eqn.primitive.name != "mul" or len(eqn.invars) != 2:
            return False
        other = eqn.invars[1] if eqn.invars[0] is o else eqn.invars[0]
        return (other is not o and not graph.is_const(other) and _shape(other) == _shape(o)
                and _shape(eqn.outvars[0]) == _shape(o))

    return gate_shaped(_shape(o)) and _kept_only_by(graph, o, gate)


def _label(sub: Subgraph) -> str:
    for e in sub.eqns:
        if e.primitive.name in _WRAPPERS and e.params.get("name"):
            return str(e.params["name"])
    stack = str(sub.eqns[-1].source_info.name_stack).split("/")
    return stack[-1] if stack and stack[-1] else "activation"


def _describe(sub: Subgraph) -> str:
    prims = [e.primitive.name + (f"[{e.params['name']}]" if e.primitive.name in _WRAPPERS
                                 and e.params.get("name") else "")
             for e in sub.eqns]
    text = ",".join(dict.fromkeys(prims))
    if len(text) > 48:
        text = text[:45] + "..."
    return f"elementwise {aval_str(sub.root)}: {text}"


# ---------------------------------------------------------------------------- matching
def _const_support(graph: Graph, eqns: list[int], taken: set[int]):
    """Constant-producing equations (and concrete constvars) that ``eqns`` read."""
    return support(graph, [v for i in eqns for v in graph.jaxpr.eqns[i].invars
                           if graph.is_const(v)])


def match_activations(graph: Graph, taken: set[int], path: str, fewbit: int | None,
                      products: set[int] | None = None,
                      gated: bool = False) -> list[Match | Row]:
    """Activation subgraphs of ``graph`` not among the equations ``taken``; ``products``:
    the equations converted to selective bilinear ops (a smooth activation feeding one
    stays exact under ``fewbit``, see :func:`_product_keeps_output`); ``gated``: gated
    products are re-emitted (a smooth activation gating one stays exact under ``fewbit``,
    see :func:`_gates_product`)."""
    eqns = graph.jaxpr.eqns
    root: dict = {}
    members: dict = {}  # root var -> [eqn indices]
    for i, eqn in enumerate(eqns):
        if i in taken or not _elementwise_eqn(graph, eqn):
            continue
        varying = [v for v in eqn.invars if not graph.is_const(v)]
        if not varying:
            continue
        roots = {root.get(v, v) for v in varying}
        if len(roots) != 1:
            continue
        r = roots.pop()
        root[eqn.outvars[0]] = r
        members.setdefault(r, []).append(i)

    out: list[Match | Row] = []
    for r, group in members.items():
        if not is_float(r):
            continue
        gset = set(group)
        # candidate outputs: float values of x's shape; largest subgraph first
        cands = []
        for i in group:
            o = eqns[i].outvars[0]
            if is_float(o) and _shape(o) == _shape(r):
                anc = ancestors(graph, i, gset)
                cands.append((len(anc), i, o, anc))
        cands.sort(key=lambda c: (-c[0], c[1]))
        # largest closed subgraph first; one left exact does not hide a smaller one inside
        # it that converts (``relu(x) ** 2``: the relu becomes a mask, the square stays)
        used: set[int] = set()
        kept: list[tuple[set[int], Row]] = []
        for _, i, o, anc in cands:
            if anc & used or not _closed(graph, anc, o):
                continue
            if _is_linear(graph, [eqns[j] for j in anc]):
                continue
            item = _convert(graph, r, o, sorted(anc), i, taken, path, fewbit, products,
                            gated)
            if isinstance(item, Match):
                used |= anc
                out.append(item)
            else:
                kept.append((anc, item))
        reported: set[int] = set()
        for anc, row in kept:
            if not anc & (used | reported):
                reported |= anc
                out.append(row)
    return out


_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cumlogsumexp"}
#: ops through which a value stays a function of reduced statistics only
_STAT_PRESERVING = ELEMENTWISE | {"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                                  "transpose", "stop_gradient"}


def _reduced(graph: Graph, v, depth: int = 0) -> bool:
    """``v`` is computed (elementwise / by broadcasting, with constants) from reductions
    only: a per-row statistic (a mean, a variance, a row max), not an activation."""
    if depth > 32 or is_literal(v) or graph.is_const(v):
        return False
    eqn = graph.eqn(v)
    if eqn is None:
        return False
    name = eqn.primitive.name
    if name in _REDUCTIONS:
        return True
    if name not in _STAT_PRESERVING:
        return False
    varying = [u for u in eqn.invars if not graph.is_const(u)]
    return bool(varying) and all(_reduced(graph, u, depth + 1) for u in varying)


def _uses_past_casts(graph: Graph, o) -> list[int]:
    """The equations reading ``o``, looking past casts (a bf16 softmax's ``exp`` is summed
    in f32: ``convert -> reduce_sum``) and masking selects against a constant (a softmax
    with ``where=``: ``select_n(mask, 0, exp) -> reduce_sum``)."""
    out, stack = [], [o]
    while stack:
        v = stack.pop()
        for j in graph.uses(v):
            eqn = graph.jaxpr.eqns[j]
            if eqn.primitive.name == "convert_element_type" or (
                    eqn.primitive.name == "select_n" and eqn.invars[0] is not v
                    and all(u is v or graph.is_const(u) for u in eqn.invars[1:])):
                stack.extend(eqn.outvars)
            else:
                out.append(j)
    return out


def _statistic_or_reduced(graph: Graph, r, o, taken: set[int] = frozenset()) -> str:
    """Why a smooth subgraph is no activation to approximate ('' when it is one): a
    function of normalisation statistics (``rsqrt(var + eps)``), or one whose output is
    summed away (``x ** 2`` inside a variance, a loss) -- its gradient must stay exact.
    Reductions inside an op another matcher re-emits (``taken``: a normalisation whose
    input this is) do not count."""
    if _reduced(graph, r):
        return "a function of reduced statistics (a normalisation's), not an activation"
    if any(graph.jaxpr.eqns[j].primitive.name in _REDUCTIONS for j in _uses_past_casts(graph, o)
           if j not in taken):
        return "its output is reduced (a variance's square, a loss), not an activation"
    return ""


def _closed(graph: Graph, anc: set[int], o) -> bool:
    """No value computed inside ``anc`` other than ``o`` is used outside it."""
    for j in anc:
        for v in graph.jaxpr.eqns[j].outvars:
            if v is not o and not graph.only_used_by(v, anc):
                return False
    return True


def _convert(graph, r, o, anc, anchor, taken, path, fewbit, products=None,
             gated=False) -> Match | Row:
    eqns = graph.jaxpr.eqns
    extra, consts = _const_support(graph, anc, taken)
    order = sorted(set(anc) | extra)
    sub = canonical(Subgraph(r, o, tuple(eqns[j] for j in order), consts, _shape(r),
                             np.dtype(r.aval.dtype)))
    last = eqns[anchor]
    where, ns = location(last), name_stack(last)
    what = _describe(sub)
    if _is_piecewise_linear(graph, [eqns[j] for j in anc]):
        try:
            slopes = two_slopes(sub)
        except _FAILURES as e:  # a subgraph that cannot be probed: leave it as it was
            return Row("activation", what, "", False, f"probe failed: {e}", where, ns, path)
        if slopes is not None:
            op = mask_activation(sub)
            row = Row("activation", what, "1-bit mask (exact)", True,
                      f"slopes {slopes[0]:g} / {slopes[1]:g}", where, ns, path)
            return Match(frozenset(anc), anchor, [r], [o],
                         lambda x, _op=op: [_op(x)], row)

    def exact(reason):
        """The exact op (keeps ``x``, ``f'`` recomputed), its row noting ``reason``."""
        op = exact_activation(sub, _split_k_output(graph, r))
        row = Row("activation", what, "exact (input kept, f' recomputed)", True, reason,
                  where, ns, path)
        return Match(frozenset(anc), anchor, [r], [o], lambda x, _op=op: [_op(x)], row,
                     fn=sub)

    statistic = _statistic_or_reduced(graph, r, o, taken)
    if statistic:
        return Row("activation", what, "", False, statistic, where, ns,
                   path)
    if fewbit is None:
        try:
            n, y_kept = autodiff_keeps(sub)
        except _FAILURES as e:
            return Row("activation", what, "", False, f"autodiff probe failed: {e}", where,
                       ns, path)
        product = _feeds_product(graph, o)
        if product and not y_kept:
            n += 1
        if n < 2:
            return Row("activation", what, "", False,
                       f"smooth: JAX's autodiff keeps {n} {_shape(r)} array (keeping the "
                       "input saves nothing; fewbit=1..4 stores a few-bit code of it)",
                       where, ns, path)
        return exact(f"keeps x instead of {n} arrays"
                     + (" (f(x) recomputed by the product)" if product else ""))
    if (_product_keeps_output(graph, o, products) and not in_recomputed_body()
            and not code_after_products()):
        # the product keeps f(x) beside a few-bit code; the exact op keeps x alone and the
        # product recomputes f(x) from it: fewer stored bytes, and the gradient is exact --
        # unless the whole program has so few such sites that the exact op's backward
        # working set (one recomputed f(x)) outweighs their codes (fewbit_sites)
        note_site(r)
        return exact(f"fewbit={fewbit} not applied: the following product would keep f(x) "
                     "anyway; keeps x only (f(x) recomputed by the product)")
    if gated and _gates_product(graph, o):
        # a gated product keeps f(x) (for the other factor's gradient) beside a few-bit
        # code; the exact op keeps x, which the gated product keeps instead of f(x)
        return exact(f"fewbit={fewbit} not applied: the gated product after it would keep "
                     "f(x) anyway; keeps x only (f(x) recomputed by the gated product)")
    try:
        op = fewbit_activation(sub, int(fewbit))
    except _FAILURES as e:
        return Row("activation", what, "", False, f"few-bit fit failed: {e}", where, ns, path)
    row = Row("activation", what, f"{fewbit}-bit code (fitted table)", True,
              "forward exact, gradient from a fitted piecewise-constant f'", where, ns, path)
    return Match(frozenset(anc), anchor, [r], [o], lambda x, _op=op: [_op(x)], row)
