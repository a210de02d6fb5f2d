"""Normalisation subgraphs -> :mod:`jaxmem.selective`'s normalisation primitive.

A normalisation computes statistics of its input ``x`` over some axes and rescales ``x``
with them::

    mu   = mean(x, A)                      (0 for an RMS norm)
    var  = mean(x^2, A) - mu^2   |  mean((x - mu)^2, A)
    y    = (x - mu) * rsqrt(var + eps) [* scale] [+ bias]   (or ``/ sqrt(var + eps)``)

however it is spelled: Flax's ``LayerNorm`` / ``BatchNorm`` (train) / ``GroupNorm`` /
``RMSNorm``, Hugging Face's ``FlaxT5LayerNorm`` (``w * (h / sqrt(mean(h**2) + eps))``),
Equinox's ``LayerNorm``, a hand-written one.  JAX's autodiff keeps two or three
input-sized arrays for it; :func:`jaxmem.selective.normalize` keeps ``x`` and two
statistics (and a following bilinear layer shares them instead of keeping ``y``).

The matcher does not rely on one spelling.  From each ``reduce_sum`` it walks back to
candidate inputs ``x``; from ``x`` it follows the *forward cone* of elementwise,
broadcasting, reshaping and summing equations; each ``x``-shaped value ``y`` of that cone
whose ancestors (within the cone) contain a reduction and whose interior values are used
nowhere else (statistics of reduced size may be, e.g. Flax's running averages) is a
candidate.  A candidate is accepted when it computes the same function as a normalisation
``N(x; A, eps, mean or not, scale, bias)``: the subgraph and ``N`` are both evaluated in
float64 on two random inputs (one of normal scale, one whose variance is comparable to
``eps``, so ``eps`` matters) with random ``scale`` / ``bias`` for its other inputs, and must
agree to ``1e-9``.  Reduction axes, ``eps`` and which input is the scale come from the
subgraph (its ``reduce_sum`` axes, the constants it adds, its inputs broadcast along
the normalised axes); what is checked is the function.  Since the subgraph contains no
``stop_gradient`` or custom rule, equal functions have equal derivatives: the re-emitted
op is exact (up to float rounding: the statistics are computed in its own order).
An accepted candidate is extended through following ``+ bias`` / ``* scale`` equations
while the function still matches.

Equal functions are not equal roundings: a one-ulp difference in a norm's output flips a
following ReLU's mask where its input is that close to 0, and the gradient with it.  So an
accepted candidate must also be spelled in an order of operations some ``inv_mode`` of
:func:`jaxmem.selective.normalize` reproduces bit for bit (:func:`_spelling`: Flax's
``(x - mu) * (rstd * scale) + bias``, Equinox's ``((x - mu) * rstd) * scale + bias``, the
dividing ``(x - mu) / sqrt(var + eps) * scale + bias`` and ``(x - mu) * scale /
sqrt(var + eps) + bias``; ``rstd`` as ``rsqrt`` or ``1/sqrt``), with no cast to a narrower
dtype before its output; other candidates are left, reported with why.

Statistics pooled over named axes (Flax's ``BatchNorm`` / ``LayerNorm`` / ``RMSNorm`` /
``GroupNorm(axis_name=..., axis_index_groups=...)`` under ``vmap(axis_name=...)``,
``shard_map`` or ``pmap``)::

    mu  = psum(mean(x, A)) / R          var = psum(mean(x^2, A)) / R - mu^2   (or of (x - mu)^2)

(``lax.pmean`` is ``psum`` and a division by the ``R`` replicas of the axis or of an
``axis_index_groups`` group; ``psum_invariant`` under ``shard_map``).  The cone also crosses
these sums and the ``stack`` / ``slice`` / ``pvary`` around them.  A sum over replicas cannot
be evaluated alone, so such a candidate is checked as a function of several replicas:
replicas interact only through the sums, and a sum over ``R`` replicas is ``R`` times the
mean of the summed values over them.  The check draws :data:`_SIMULATED` replicas, each with
its own ``x``, scale and bias, evaluates every sum as ``R`` times the mean over them (for
``R`` a multiple of the draws: the function of ``R`` replicas holding them in equal shares),
and compares each replica's outputs with ``N`` whose statistics are pooled over the draws
(``mu`` = mean over replicas and ``A``, ``var`` likewise).  A spelling that pools something
else, e.g. each replica's variance around its own mean, differs there.  An accepted one is
re-emitted as :func:`jaxmem.selective.normalize` with the same ``axis_name`` and
``axis_index_groups`` (the sums' derivatives are JAX's transposes of ``psum`` on both
sides), or :func:`jaxmem.selective.group_norm` likewise: batch, layer, RMS and group norms
(Flax's ``axis_name`` on ``BatchNorm``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm``).
"""
from __future__ import annotations

import heapq
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmem._prims.host import on_host
from jaxmem.transform.graph import (
    Graph,
    ancestors,
    first_location,
    is_literal,
    name_stack,
    structure,
    support,
)
from jaxmem.transform.match import Match, aval_str, is_float
from jaxmem.transform.match_elementwise import ELEMENTWISE, _generic
from jaxmem.transform.numpy_eval import Unsupported, as_float64, eval_eqn
from jaxmem.transform.report import Row

__all__ = ["match_norms"]

#: sums over named axes a normalisation's statistics may go through (``lax.pmean`` is a
#: ``psum`` and a division; ``psum_invariant`` under ``shard_map``)
_COLLECTIVES = {"psum", "psum_invariant"}
#: primitives that move values between positions (a region with them is compared everywhere)
_MOVES = {"slice", "stack", "concatenate"}
#: primitives a normalisation subgraph may consist of (no ``stop_gradient``: a statistic
#: held constant has another derivative than the normalisation)
_CONE = (ELEMENTWISE - {"rem", "floor", "ceil", "round", "sign", "nextafter"}) | {
    "reduce_sum", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary",
    "pcast"} | _MOVES | _COLLECTIVES
#: most equations followed forward from one candidate input
_CONE_LIMIT = 160
#: most candidate outputs checked per candidate input
_TRIES = 6
_TOL = 1e-9
#: replicas simulated when checking a normalisation with pooled statistics
_SIMULATED = 3


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))



def _size(v) -> int:
    return math.prod(_shape(v))


def _root_candidates(graph: Graph, u) -> list:
    """``u`` and what it is computed from elementwise (``x * x``, ``x ** 2``, ``x - mu``,
    casts) or by a reshape (a group norm's grouping): candidate inputs ``x``."""
    out = [u]
    v = u
    for _ in range(4):
        eqn = graph.eqn(v)
        if eqn is None:
            break
        name = eqn.primitive.name
        varying = [w for w in eqn.invars if not graph.is_const(w)]
        if name == "reshape" or (name in ELEMENTWISE and len(varying) == 1):
            v = varying[0] if varying else None
        elif len(varying) == 2 and (
                (name == "mul" and varying[0] is varying[1])              # x * x
                or (name == "sub" and _shape(varying[0]) == _shape(v))):  # x - mu
            v = varying[0]
        else:
            break
        if v is None or is_literal(v) or not is_float(v):
            break
        out.append(v)
    return out


def _cone(graph: Graph, r, taken: set[int]) -> list[int]:
    """Equations reachable from ``r`` through :data:`_CONE` primitives (in order)."""
    eqns = graph.jaxpr.eqns
    heap = list(graph.uses(r))
    heapq.heapify(heap)
    seen: set[int] = set()
    inside = {r}
    out: list[int] = []
    while heap and len(out) < _CONE_LIMIT:
        i = heapq.heappop(heap)
        if i in seen:
            continue
        seen.add(i)
        eqn = eqns[i]
        if i in taken or eqn.primitive.name not in _CONE:
            continue
        if not any(not is_literal(v) and v in inside for v in eqn.invars):
            continue
        out.append(i)
        for v in eqn.outvars:
            inside.add(v)
            for j in graph.uses(v):
                heapq.heappush(heap, j)
    return sorted(out)


_EFFECTS = {"random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
            "random_split", "iota"}


def _static(graph: Graph, v, memo: dict, depth: int = 0) -> bool:
    """``v`` is computed from literals and concrete constants only (``jnp.var``'s
    ``where(n - ddof > 0, var, nan)``)."""
    if is_literal(v) or graph.is_const(v):
        return True
    if v in memo:
        return memo[v]
    eqn = graph.eqn(v)
    ok = (eqn is not None and depth < 16 and eqn.primitive.name not in _EFFECTS
          and not any(True for _ in _subjaxprs(eqn))
          and all(_static(graph, u, memo, depth + 1) for u in eqn.invars))
    memo[v] = ok
    return ok


def _subjaxprs(eqn):
    from jaxmem._compat import core
    return core.jaxprs_in_params(eqn.params)


class _Region:
    """Equations ``anc`` from ``root`` (and side inputs) to ``out`` (+ ``extras``)."""

    def __init__(self, graph, root, out, anc, taken):
        self.graph, self.root, self.out, self.anc = graph, root, out, set(anc)
        eqns = graph.jaxpr.eqns
        self.ok = True
        self.extras: list = []
        self.sides: list = []
        statics: list = []
        memo: dict = {}
        for j in sorted(self.anc):
            for v in eqns[j].outvars:
                if v is out or graph.only_used_by(v, self.anc):
                    continue
                if _size(v) < _size(root) and is_float(v):
                    self.extras.append(v)     # a statistic used elsewhere (running stats)
                else:
                    self.ok = False
            for v in eqns[j].invars:
                if is_literal(v) or v is root or graph.producer.get(v) in self.anc:
                    continue
                if _static(graph, v, memo):
                    statics.append(v)
                    continue
                if v not in self.sides:
                    self.sides.append(v)
        self.const_eqns, self.consts = support(graph, statics)
        self.collectives = [eqns[j] for j in sorted(self.anc | self.const_eqns)
                            if eqns[j].primitive.name in _COLLECTIVES]
        self.moves = any(eqns[j].primitive.name in _MOVES for j in self.anc)

    def evaluate(self, x, sides: list, replicas: int = 0, numpy: bool = False) -> list:
        """The region's ``[out, *extras]`` for these values (any float dtype).

        ``replicas = R``: ``x``, the side inputs and the outputs have a leading axis of
        simulated replicas, evaluated side by side; a sum over the named axes (of ``R``
        replicas) is ``R`` times the mean over the simulated ones. ``numpy``: NumPy float64
        inputs evaluated by :func:`~jaxmem.transform.numpy_eval.eval_eqn` (no XLA compile;
        raises :class:`~jaxmem.transform.numpy_eval.Unsupported`), else JAX values bound
        primitive by primitive."""
        k = len(x) if replicas else 1
        xs = list(x) if replicas else [x]
        lift = as_float64 if numpy else (lambda a: a)
        consts = {v: lift(c) for v, c in self.consts.items()}
        envs = []
        for r in range(k):
            env: dict = {self.root: xs[r]}
            env.update(consts)
            env.update(zip(self.sides, [s[r] for s in sides] if replicas else sides))
            envs.append(env)
        root_shape = _shape(self.root)
        for j in sorted(self.anc | self.const_eqns):
            eqn = self.graph.jaxpr.eqns[j]
            ins = [[lift(v.val) if is_literal(v) else env[v] for v in eqn.invars]
                   for env in envs]
            if eqn.primitive.name in _COLLECTIVES:
                if not replicas:
                    raise NotImplementedError("a sum over named axes")
                tot = [(np if numpy else jnp).asarray(sum(a) * (replicas / k), a[0].dtype)
                       for a in zip(*ins)]
                outs = [tot] * k
            elif numpy:
                outs = [eval_eqn(eqn, i, root_shape, y.shape) for i, y in zip(ins, xs)]
            else:
                outs = [_generic(eqn, i, y, root_shape) for i, y in zip(ins, xs)]
            for env, o in zip(envs, outs):
                env.update(zip(eqn.outvars, o))
        res = [[env[self.out]] + [env[v] for v in self.extras] for env in envs]
        stack = np.stack if numpy else jnp.stack
        return [stack(col) for col in zip(*res)] if replicas else res[0]


def _side_source(graph: Graph, v, root):
    """``(var, bshape)``: the array to pass for side input ``v`` and its shape broadcastable
    to ``root`` (un-broadcast through one ``broadcast_in_dim`` when ``v`` is full-sized)."""
    rank = len(_shape(root))
    shape = _shape(v)
    if len(shape) == rank and _size(v) < _size(root):
        return v, shape
    eqn = graph.eqn(v)
    if eqn is not None and eqn.primitive.name == "broadcast_in_dim" and len(shape) == rank:
        src = eqn.invars[0]
        dims = tuple(eqn.params["broadcast_dimensions"])
        if not is_literal(src) and list(dims) == sorted(dims):
            b = [1] * rank
            for d, n in zip(dims, _shape(src)):
                b[d] = n
            return src, tuple(b)
    if len(shape) <= rank:
        return v, (1,) * (rank - len(shape)) + shape
    return None


def _model(x, axes, group, sub_mean, eps, scale, bias):
    """The normalisation in NumPy float64: ``(y, mu, var)`` (statistics keepdims)."""
    xs = x
    if group:
        xs = x.reshape(x.shape[:-1] + (group, x.shape[-1] // group))
    mu = xs.mean(axes, keepdims=True) if sub_mean else np.zeros(())
    var = np.maximum(0.0, (xs * xs).mean(axes, keepdims=True) - mu * mu)
    r = 1.0 / np.sqrt(var + eps)
    y = ((xs - mu) * r).reshape(x.shape)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y, mu, var


def _close(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size != b.size:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return False
    return bool(np.max(np.abs(a - b), initial=0.0) <= _TOL * max(1.0, np.max(np.abs(b),
                                                                              initial=0.0)))


def _spec(region: _Region):
    """The normalisation ``region`` computes, or ``(None, reason)``."""
    g, root = region.graph, region.root
    eqns = g.jaxpr.eqns
    shape = _shape(root)
    reds = [eqns[j] for j in region.anc if eqns[j].primitive.name == "reduce_sum"]
    axes_set = {tuple(e.params["axes"]) for e in reds}
    in_shapes = {_shape(e.invars[0]) for e in reds}
    if len(axes_set) != 1 or len(in_shapes) != 1:
        return None, "its reductions are over different axes"
    axes, in_shape = tuple(int(a) for a in axes_set.pop()), in_shapes.pop()
    group = 0
    if in_shape != shape:
        if (len(shape) >= 2 and len(in_shape) == len(shape) + 1
                and in_shape[:-2] == shape[:-1] and in_shape[-2] * in_shape[-1] == shape[-1]
                and axes == tuple(range(1, len(in_shape) - 2)) + (len(in_shape) - 1,)):
            group = in_shape[-2]
        else:
            return None, "its statistics are of a reshaped input other than a group norm's"
    if len(region.sides) > 2:
        return None, f"{len(region.sides)} non-constant inputs besides x (scale, bias at most)"
    sides = []
    for v in region.sides:
        s = _side_source(g, v, root)
        if s is None:
            return None, f"input {aval_str(v)} does not broadcast to x"
        sides.append(s)
    feat = set()
    for _, b in sides:
        f = {d for d, n in enumerate(b) if n != 1}
        if any(b[d] != shape[d] for d in f):
            return None, "a scale / bias that does not broadcast along x's axes"
        feat |= f
    if group and (feat - {len(shape) - 1}):
        return None, "a group norm's scale / bias is not per channel"
    pool = _pooling(region)
    if isinstance(pool, str):
        return None, pool
    eps_cands = sorted({g.uniform(v) for j in region.anc if eqns[j].primitive.name == "add"
                        for v in eqns[j].invars if g.uniform(v) is not None} - {0.0})
    eps_cands = [e for e in eps_cands if 0 < e < 1] or [0.0]
    roles = [(None, None)]
    if len(sides) == 1:
        roles = [(0, None), (None, 0)]
    elif len(sides) == 2:
        roles = [(0, 1), (1, 0)]
    key = _region_key(region)
    if key is not None:
        key += (shape, axes, group, tuple(b for _, b in sides), tuple(eps_cands), pool)
    verdict = _VERDICTS.get(key) if key is not None else None
    if verdict is None:
        verdict = _verify(region, shape, axes, group, sides, eps_cands, roles,
                          pool[2] if pool else 0)
        if key is not None:
            if len(_VERDICTS) >= 1024:
                _VERDICTS.clear()
            _VERDICTS[key] = verdict
    found, why = verdict
    if found is None:
        return None, why
    (sm, eps, sc, bi), stats = found
    # a normalisation: is it spelled as one the conversion reproduces bit for bit?
    inv, why = _spelling(region)
    if inv is None:
        return None, _Unfaithful(why)
    return {"axes": axes, "group": group, "sub_mean": sm, "eps": eps, "inv": inv,
            "scale": sc, "bias": bi, "sides": sides, "stats": stats, "pool": pool,
            "feat": tuple(sorted(feat)) or axes,
            "fast": not any(_reduces_reduced(g, e, region.anc) for e in reds)}, ""


#: what a ``sqrt`` / ``rstd`` reaches its use through (exact: moves or identical values)
_RESHAPES = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary", "pcast"}


def _producer(graph: Graph, v, anc, through=frozenset()):
    """The equation of ``anc`` computing ``v``, looking through ``through`` ones, or None."""
    eqns = graph.jaxpr.eqns
    while not is_literal(v):
        i = graph.producer.get(v)
        if i is None or i not in anc:
            return None
        if eqns[i].primitive.name not in through:
            return eqns[i]
        v = eqns[i].invars[0]
    return None


def _is_x(region: _Region, v) -> bool:
    """``v`` is ``x``, ``x`` cast up to the statistics' dtype (an exact cast), or either
    reshaped (a group norm's grouping)."""
    g = region.graph
    e = _producer(g, v, region.anc)
    if e is not None and e.primitive.name in _RESHAPES and e.primitive.name != \
            "broadcast_in_dim" and _size(v) == _size(region.root):
        v = e.invars[0]
    if v is region.root:
        return True
    e = _producer(g, v, region.anc)
    return (e is not None and e.primitive.name == "convert_element_type"
            and e.invars[0] is region.root
            and v.aval.dtype == jnp.promote_types(region.root.aval.dtype, jnp.float32))


def _is_centered(region: _Region, v) -> bool:
    """``v`` is ``x - mu`` (or ``x``: an RMS norm)."""
    if _is_x(region, v):
        return True
    e = _producer(region.graph, v, region.anc)
    return e is not None and e.primitive.name == "sub" and _is_x(region, e.invars[0])


def _outside(region: _Region, v) -> bool:
    """``v`` does not depend on ``x`` (a scale / bias)."""
    return not is_literal(v) and region.graph.producer.get(v) not in region.anc


def _narrowing(region: _Region):
    """A cast in ``region`` to a less precise float dtype whose result the region computes
    on (the output's own cast is fine: the conversion casts its output too), or None."""
    eqns = region.graph.jaxpr.eqns
    for j in sorted(region.anc):
        e = eqns[j]
        if e.primitive.name not in ("convert_element_type", "reduce_precision") or \
                e.outvars[0] is region.out:
            continue
        src, dst = e.invars[0].aval.dtype, e.outvars[0].aval.dtype
        if e.primitive.name == "reduce_precision":
            return e
        if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
            continue
        fs, fd = jnp.finfo(src), jnp.finfo(dst)
        if fd.nmant < fs.nmant or fd.nexp < fs.nexp:
            return e
    return None


def _inv_kind(region: _Region, v):
    """``'rsqrt'`` if ``v`` is ``rsqrt(.)``, ``'recip_sqrt'`` if ``1 / sqrt(.)`` (or
    ``sqrt(.) ** -1``), looking through broadcasts and reshapes; else None."""
    g, anc = region.graph, region.anc
    e = _producer(g, v, anc, _RESHAPES)
    if e is None:
        return None
    name = e.primitive.name
    if name == "rsqrt":
        return "rsqrt"
    if name == "div" and g.uniform(e.invars[0]) == 1.0:
        sd = _producer(g, e.invars[1], anc, _RESHAPES)
    elif name == "integer_pow" and e.params.get("y") == -1:
        sd = _producer(g, e.invars[0], anc, _RESHAPES)
    else:
        return None
    return "recip_sqrt" if sd is not None and sd.primitive.name == "sqrt" else None


def _steps(region: _Region, v, steps, what):
    """``None`` if the region computes ``v`` then only ``steps`` (in this order, each at
    most once: ``mul`` / ``add`` with an input not computed from ``x``, a final cast; exact
    reshapes anywhere) up to its output; else why not. ``(None, taken)``: also which."""
    g, anc = region.graph, region.anc
    eqns = g.jaxpr.eqns
    taken = []
    while v is not region.out:
        uses = [j for j in g.uses(v) if j in anc]
        e = eqns[uses[0]] if len(uses) == 1 else None
        name = None if e is None else e.primitive.name
        if name in _RESHAPES - {"broadcast_in_dim"} and _size(e.outvars[0]) == _size(v):
            v = e.outvars[0]
            continue
        if name not in steps or (name != "convert_element_type" and not any(
                _outside(region, w) for w in e.invars if w is not v)):
            return (f"after {what} it computes {name or 'more than one thing'}, not "
                    f"{' '.join(_STEP_NAMES[n] for n in steps) or 'nothing'}: not "
                    "bit-identical to a conversion"), taken
        steps = steps[steps.index(name) + 1:]
        taken.append(name)
        v = e.outvars[0]
    return None, taken


_STEP_NAMES = {"mul": "[* scale]", "add": "[+ bias]", "convert_element_type": "[cast]"}


class _Unfaithful(str):
    """Why a region that computes a normalisation is left: its rounding (reported in
    preference to the reasons of candidate regions that compute none)."""


def _prefer(reason, why):
    """The reason to report: the first, or the first :class:`_Unfaithful` one."""
    if reason is None or (isinstance(why, _Unfaithful) and not isinstance(reason, _Unfaithful)):
        return why or reason
    return reason


def _spelling(region: _Region):
    """``(inv_mode, "")`` of :func:`jaxmem.selective.normalize` that rounds as the region
    does, or ``(None, reason)``; the region's order of operations is checked, any other one
    rounds otherwise and is left:

    * ``'rsqrt'`` / ``'recip_sqrt'`` (Flax): ``(x - mu) * (rstd [* scale]) [+ bias]``;
    * ``'rsqrt_then_scale'`` / ``'recip_sqrt_then_scale'`` (Equinox):
      ``((x - mu) * rstd) * scale [+ bias]``;
    * ``'divide'``: ``(x - mu) / sd [* scale] [+ bias]``;
    * ``'scale_divide'``: ``(x - mu) * scale / sd [+ bias]``,
    * ``'scale_over_sd'``: ``(x - mu) * (scale / sd) [+ bias]``,

    ``rstd`` ``rsqrt(.)`` or ``1/sqrt(.)``, ``sd`` ``sqrt(.)``, then a cast at most, with
    no cast to a narrower dtype before it (the conversion computes in the statistics'
    dtype)."""
    g, anc = region.graph, region.anc
    eqns = g.jaxpr.eqns
    narrow = _narrowing(region)
    if narrow is not None:
        return None, (f"it casts {aval_str(narrow.invars[0])} to "
                      f"{aval_str(narrow.outvars[0])} before its output: converted, it "
                      "would compute at full precision (not bit-identical)")
    # x-sized divisions by something computed from x
    divs = [j for j in sorted(anc) if eqns[j].primitive.name == "div"
            and _size(eqns[j].outvars[0]) == _size(region.root)
            and not _outside(region, eqns[j].invars[1]) and not is_literal(eqns[j].invars[1])]
    if divs:
        sd = _producer(g, eqns[divs[0]].invars[1], anc, _RESHAPES)
        if len(divs) > 1 or sd is None or sd.primitive.name != "sqrt":
            return None, ("it divides by something other than sqrt(var + eps) (once): not "
                          "bit-identical to a conversion")
        num = eqns[divs[0]].invars[0]
        if not _is_centered(region, num) and _outside(region, num):
            # ``scale / sd`` (x-sized by broadcasting), then ``(x - mu)`` times it
            q = eqns[divs[0]].outvars[0]
            users = [eqns[j] for j in g.uses(q) if j in anc]
            if len(users) != 1 or users[0].primitive.name != "mul" or not any(
                    a is q and _is_centered(region, c)
                    for a, c in (users[0].invars, users[0].invars[::-1])):
                return None, ("it divides the scale by sqrt(var + eps) but does not multiply "
                              "x - mean by that: not bit-identical to a conversion")
            why, _ = _steps(region, users[0].outvars[0], ("add", "convert_element_type"),
                            "its product of x - mean and scale / sqrt(var + eps)")
            return (None, why) if why else ("scale_over_sd", "")
        if _is_centered(region, num):
            inv, steps = "divide", ("mul", "add", "convert_element_type")
        else:
            e = _producer(g, num, anc)
            if e is None or e.primitive.name != "mul" or not any(
                    _is_centered(region, a) and _outside(region, b)
                    for a, b in (e.invars, e.invars[::-1])):
                return None, ("it divides something other than x - mean (or its product "
                              "with the scale) by sqrt(var + eps): not bit-identical to a "
                              "conversion")
            inv, steps = "scale_divide", ("add", "convert_element_type")
        why, _ = _steps(region, eqns[divs[0]].outvars[0], steps,
                        "its division by sqrt(var + eps)")
        return (None, why) if why else (inv, "")
    # x - mu times rstd (then scale) or times rstd * scale
    found = []
    for j in sorted(anc):
        e = eqns[j]
        if e.primitive.name != "mul" or _size(e.outvars[0]) != _size(region.root):
            continue
        for a, b in (e.invars, e.invars[::-1]):
            if is_literal(a) or is_literal(b) or not _is_centered(region, a):
                continue
            kind = _inv_kind(region, b)
            if kind is not None:
                found.append((e, kind, False))
                break
            f = _producer(g, b, anc, _RESHAPES)
            if f is not None and f.primitive.name == "mul":
                kinds = [_inv_kind(region, p) for p, q in (f.invars, f.invars[::-1])
                         if _outside(region, q)]
                if any(kinds):
                    found.append((e, next(k for k in kinds if k), True))
                    break
    if len(found) != 1:
        return None, ("its order of operations is none of (x - mean) * (rstd [* scale]) "
                      "[+ bias], ((x - mean) * rstd) * scale [+ bias], (x - mean) / sd "
                      "[* scale] [+ bias], (x - mean) * scale / sd [+ bias], (x - mean) * "
                      "(scale / sd) [+ bias]: not bit-identical to a conversion")
    e, kind, scaled = found[0]
    steps = ("add", "convert_element_type") if scaled else (
        "mul", "add", "convert_element_type")
    why, taken = _steps(region, e.outvars[0], steps,
                        "multiplying x - mean by rstd" + (" * scale" if scaled else ""))
    if why:
        return None, why
    return (kind + "_then_scale" if "mul" in taken else kind), ""


def _pooling(region: _Region):
    """``(axis names, axis_index_groups, R)`` of the sums over named axes in ``region``
    (``R`` replicas take part in each sum), ``None`` without any, or why not supported."""
    kinds = set()
    for e in region.collectives:
        groups = e.params.get("axis_index_groups")
        kinds.add((tuple(e.params["axes"]),
                   None if groups is None else tuple(tuple(int(i) for i in g) for g in groups)))
    if not kinds:
        return None
    if len(kinds) > 1:
        return "its statistics are summed over different named axes"
    ((names, groups),) = kinds
    if any(isinstance(a, (int, np.integer)) for a in names):
        return "its statistics are summed over positional axes"
    if groups:
        return names, groups, len(groups[0])
    try:
        return names, None, math.prod(lax.axis_size(a) for a in names)
    except (NameError, ValueError, TypeError) as e:
        return f"the size of axis {names} is unknown here: {e}"


def _named(pool) -> str:
    names, groups, _ = pool
    out = "axis " + ", ".join(repr(a) for a in names)
    return out + (f" (axis_index_groups {list(map(list, groups))})" if groups else "")


#: verdicts of :func:`_verify` per region structure (a model's repeated layers are checked once)
_VERDICTS: dict = {}


def _region_key(region: _Region):
    """The region's computation named canonically (``x``, its side inputs, constants by
    content; output avals; which outputs leave it), or ``None`` when it cannot be."""
    eqns = [region.graph.jaxpr.eqns[j] for j in sorted(region.anc | region.const_eqns)]
    names = {region.root: "x", **{v: f"s{i}" for i, v in enumerate(region.sides)}}
    if any(np.asarray(c).dtype == object for c in region.consts.values()):
        return None
    try:
        parts, ids = structure(eqns, names, region.consts)
        leaving = (ids[region.out], tuple(ids[v] for v in region.extras))
    except KeyError:
        return None
    return parts + (tuple(aval_str(o) for e in eqns for o in e.outvars), leaving)


#: positions compared per axis a normalisation does not reduce (see :func:`_positions`)
_POSITIONS = 6


def _positions(region: _Region, shape, axes, group, rng):
    """Where :func:`_verify` compares the region with the model: a few random positions
    (and the last) along each axis the statistics are not reduced over, all of every
    reduced axis. A region of the cone's primitives whose constants are all uniform treats
    those positions alike (its side inputs are random along them), so equality there is
    equality everywhere; otherwise, and for group norms, ``None``: every position."""
    if group or region.moves or any(
            np.asarray(c).size > 1 and not np.all(np.asarray(c) == np.asarray(c).flat[0])
            for c in region.consts.values()):
        return None
    rank = len(shape)
    reduced = {a % rank for a in axes}
    return tuple(slice(None) if d in reduced or n <= _POSITIONS else
                 np.unique(np.append(rng.choice(n - 1, _POSITIONS - 1, replace=False), n - 1))
                 for d, n in enumerate(shape))


def _take(a, sel):
    """``a`` at the positions ``sel`` (one index array or slice per axis, outer product)."""
    for d, s in enumerate(sel):
        if not isinstance(s, slice):
            a = np.take(a, s, axis=d)
    return a


def _at(sel, x, outs, shape, axes):
    """``x`` and the region's outputs (``y`` and keepdims statistics) at ``sel`` (``None``:
    everywhere)."""
    rank = len(shape)
    sel = sel or (slice(None),) * rank
    stat_shape = tuple(1 if d in {a % rank for a in axes} else n for d, n in enumerate(shape))
    picked = [_take(outs[0].reshape(shape), sel)]
    for e in outs[1:]:
        picked.append(_take(e.reshape(stat_shape), sel) if e.size == math.prod(stat_shape)
                      else np.full((1,), np.nan))       # a statistic of another shape: no match
    return _take(x, sel), picked


def _close_stat(e, m) -> bool:
    """A statistic of the region equals the model's (``m`` broadcasts over replicas)."""
    try:
        return _close(e, np.broadcast_to(m, e.shape))
    except ValueError:
        return False


def _at_side(sel, s):
    """A scale / bias (broadcast shape) at ``sel`` along the axes it varies over."""
    if sel is None:
        return s
    return _take(s, tuple(slice(None) if n == 1 else q for q, n in zip(sel, s.shape)))


def _evaluate_float64(region: _Region, x, args, replicas) -> list[np.ndarray]:
    """The region's outputs at NumPy ``x`` and side inputs ``args``, in float64: in NumPy
    where every equation has a NumPy rule, else with JAX (eagerly, away from the caller's
    trace: one XLA compile per primitive and shape)."""
    try:
        return [np.asarray(o, np.float64) for o in region.evaluate(
            np.asarray(x, np.float64), [np.asarray(a, np.float64) for a in args], replicas,
            numpy=True)]
    except Unsupported:
        pass
    return on_host(lambda: [np.asarray(o, np.float64) for o in region.evaluate(
        jnp.asarray(x, jnp.float64), [jnp.asarray(a, jnp.float64) for a in args], replicas)])


def _verify(region: _Region, shape, axes, group, sides, eps_cands, roles,
            replicas: int = 0):
    """``((sub_mean, eps, scale, bias), stats)`` of the normalisation candidate the region
    computes in float64 on two random draws, or ``(None, reason)``.

    ``replicas = R`` (statistics summed over named axes of ``R`` replicas): the draws are
    :data:`_SIMULATED` different replicas (each with its own ``x``, scale and bias) and the
    model's statistics are pooled over them (see the module docstring)."""
    cands = [(sm, eps, sc, bi) for eps in eps_cands for sm in (True, False)
             for sc, bi in roles]
    rng = np.random.default_rng(0)
    sel = _positions(region, shape, axes, group, rng)
    lead = (_SIMULATED,) if replicas else ()
    # per replica: ``shape`` behind the replica axis; the model also reduces over replicas
    rshape, raxes = lead + shape, tuple(a + len(lead) for a in axes)
    maxes = (0,) + raxes if replicas else raxes
    rsel = None if sel is None else (slice(None),) * len(lead) + sel
    try:
        for draw in range(2):
            eps_scale = math.sqrt(max(eps_cands[0], 1e-300)) if draw else 1.0
            off = 0.7 if draw == 0 else 0.3 * eps_scale
            x = (rng.standard_normal(rshape) * eps_scale * (1.5 if draw else 1.0)
                 + off * rng.standard_normal(rshape[:-1] + (1,)))
            svals = [rng.standard_normal(lead + b) * 0.5 + 1.0 for _, b in sides]
            args = [s.reshape(lead + _shape(v)) if src is v else
                    np.broadcast_to(s.reshape(lead + b), lead + _shape(v))
                    for s, (src, b), v in zip(svals, sides, region.sides)]
            outs = _evaluate_float64(region, x, args, replicas)
            xs, outs = _at(rsel, x, outs, rshape, raxes)
            sv = [_at_side(rsel, s.reshape(lead + b)) for s, (_, b) in zip(svals, sides)]
            keep = []
            for c in cands:
                sm, eps, sc, bi = c
                y, mu, var = _model(xs, maxes, group, sm, eps,
                                    None if sc is None else sv[sc],
                                    None if bi is None else sv[bi])
                if not _close(outs[0], y):
                    continue
                stats = []
                for e in outs[1:]:
                    which = ("mu" if sm and not group and _close_stat(e, mu) else
                             "var" if not group and _close_stat(e, var) else None)
                    stats.append(which)
                if None in stats:
                    continue
                keep.append(c + (tuple(stats),))
            cands = [k[:4] for k in keep]
            if not cands:
                return None, ("computes no LayerNorm / RMSNorm / BatchNorm / GroupNorm "
                              "of x with these statistics")
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError, RuntimeError,
            NotImplementedError, NameError) as e:  # cannot be evaluated: left as it was
        return None, f"could not be evaluated: {e}"
    return (cands[0], keep[0][4]), ""


def _reduces_reduced(graph: Graph, eqn, anc) -> bool:
    """A ``reduce_sum`` whose input depends on another reduction (a two-pass variance)."""
    i = graph.producer.get(eqn.invars[0])
    if i is None or i not in anc:
        return False
    return any(graph.jaxpr.eqns[j].primitive.name == "reduce_sum"
               for j in ancestors(graph, i, set(anc)))


def _kind(spec) -> str:
    if spec["group"]:
        return f"group norm ({spec['group']} groups)"
    if not spec["sub_mean"]:
        return "RMS norm"
    return "layer norm" if set(spec["axes"]) == set(spec["feat"]) else "batch norm"


def _emitter(spec, root, out, extras):
    from jaxmem.selective import group_norm, normalize

    axes, group, eps = spec["axes"], spec["group"], spec["eps"]
    sides, sc, bi = spec["sides"], spec["scale"], spec["bias"]
    shape = _shape(root)
    feat = spec["feat"]
    pshape = tuple(shape[d] if d in feat else 1 for d in range(len(shape)))
    dtype = out.aval.dtype

    def param(vals, k):
        if k is None:
            return None
        return jnp.broadcast_to(vals[k].reshape(sides[k][1]), pshape)

    def emit(x, *vals):
        scale, bias = param(vals, sc), param(vals, bi)
        pooled = {}
        if spec["pool"] is not None:   # statistics pooled over named axes
            names, groups, _ = spec["pool"]
            pooled = {"axis_name": names[0] if len(names) == 1 else names,
                      "axis_index_groups": groups}
        if group:
            y = group_norm(x, None if scale is None else scale.reshape(-1),
                           None if bias is None else bias.reshape(-1), num_groups=group,
                           eps=eps, dtype=dtype, inv_mode=spec["inv"], **pooled)
            return [y]
        y, mu, var = normalize(x, scale, bias, axes=axes, feature_axes=feat, eps=eps,
                               subtract_mean=spec["sub_mean"], fast_variance=spec["fast"],
                               dtype=dtype, inv_mode=spec["inv"], **pooled)
        outs = [y]
        for e, which in zip(extras, spec["stats"]):
            s = mu if which == "mu" else var
            outs.append(s.reshape(_shape(e)).astype(e.aval.dtype))
        return outs

    return emit, [src for src, _ in sides]


def _extend(graph: Graph, region: _Region, taken: set[int], cone: set[int]):
    """``region`` grown through a single following ``+ bias`` / ``* scale`` / cast while the
    function is still a normalisation."""
    eqns = graph.jaxpr.eqns
    best = None
    cur = region
    while True:
        uses = graph.uses(cur.out)
        if cur.out in graph.outvars or len(uses) != 1 or uses[0] not in cone:
            return best
        j = uses[0]
        e = eqns[j]
        if e.primitive.name not in ("add", "mul", "sub", "convert_element_type") or \
                _shape(e.outvars[0]) != _shape(region.root):
            return best
        nxt = _Region(graph, region.root, e.outvars[0], cur.anc | {j}, taken)
        if not nxt.ok:
            return best
        spec, _ = _spec(nxt)
        if spec is None:
            return best
        best = (nxt, spec)
        cur = nxt


def _match_root(graph: Graph, r, taken: set[int], path: str):
    eqns = graph.jaxpr.eqns
    cone = _cone(graph, r, taken)
    cset = set(cone)
    tries = 0
    reason = None
    for i in cone:
        o = eqns[i].outvars[0]
        if len(eqns[i].outvars) != 1 or _shape(o) != _shape(r) or not is_float(o):
            continue
        anc = ancestors(graph, i, cset)
        if not any(eqns[j].primitive.name == "reduce_sum" for j in anc):
            continue
        region = _Region(graph, r, o, anc, taken)
        if not region.ok:
            continue
        tries += 1
        spec, why = _spec(region)
        if spec is None:
            reason = _prefer(reason, why)
            if tries >= _TRIES:
                break
            continue
        grown = _extend(graph, region, taken, cset)
        if grown is not None:
            region, spec = grown
        return _make_match(graph, region, spec, path)
    return reason


def _make_match(graph: Graph, region: _Region, spec, path: str) -> Match:
    eqns = graph.jaxpr.eqns
    anchor = max(region.anc)
    emit, side_vars = _emitter(spec, region.root, region.out, region.extras)
    last = eqns[anchor]
    kind = _kind(spec)
    parts = [f"axes {spec['axes']}", f"eps {spec['eps']:g}"]
    if spec["scale"] is not None:
        parts.append("scale")
    if spec["bias"] is not None:
        parts.append("bias")
    if spec["pool"] is not None:
        parts.append("statistics pooled over " + _named(spec["pool"]))
    if region.extras:
        parts.append("statistics used elsewhere: " + ", ".join(spec["stats"]))
    what = f"{kind} {aval_str(region.root)} [{', '.join(parts)}]"
    where = first_location([last] + [eqns[j] for j in sorted(region.anc, reverse=True)])
    op = "group_norm" if spec["group"] else "normalize"
    row = Row("norm", what, "jaxmem.selective." + op, True,
              "keeps x and its statistics (a following product shares them)",
              where, name_stack(last), path)
    return Match(frozenset(region.anc), anchor, [region.root, *side_vars],
                 [region.out, *region.extras], emit, row)


def match_norms(graph: Graph, taken: set[int], path: str) -> list[Match | Row]:
    """Normalisation subgraphs of ``graph`` not among the equations ``taken``."""
    eqns = graph.jaxpr.eqns
    out: list[Match | Row] = []
    mine: set[int] = set()
    tried: set = set()
    for i, eqn in enumerate(eqns):
        if (i in taken or i in mine or eqn.primitive.name != "reduce_sum"
                or not is_float(eqn.invars[0])):
            continue
        reason = None
        found = None
        for r in _root_candidates(graph, eqn.invars[0]):
            if r in tried or len(_shape(r)) == 0:
                continue
            tried.add(r)
            item = _match_root(graph, r, taken | mine, path)
            if isinstance(item, Match):
                found = item
                break
            reason = _prefer(reason, item)
        if found is not None:
            mine |= found.eqns
            out.append(found)
        elif reason:
            near = [eqns[j] for v in eqn.outvars for j in graph.uses(v)]
            out.append(Row("norm", f"reduce_sum{tuple(eqn.params['axes'])} of "
                           f"{aval_str(eqn.invars[0])}", "", False, reason,
                           first_location([eqn, *near]), name_stack(eqn), path))
    return out
