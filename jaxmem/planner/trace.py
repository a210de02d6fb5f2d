"""Tag layer boundaries, trace a loss into a jaxpr, cut it into units, run it with a choice.

A *unit* is a contiguous run of the loss jaxpr's equations that ends at the output of one
Flax Linen method call (tagged ``checkpoint_name(y, "jaxmem/<path>")`` while tracing). Running
the jaxpr chunk by chunk and wrapping a chunk in ``jax.checkpoint`` keeps only the chunk's
inputs (or, with ``policy=dots_saveable``, also its matmul outputs) for the backward pass and
recomputes the rest just before the chunk's own backward. The equations and their order are
unchanged, so values and gradients are exactly the untouched loss's.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxmem._compat import core

__all__ = ["PREFIX", "Conversion", "RowSplit", "Traced", "Unit", "child_units", "nested_fn",
           "recomputed_flops", "row_split", "row_twin", "run_chunks", "tag", "trace",
           "units_at"]

PREFIX = "jaxmem/"


def tag(x: Any, name: str) -> Any:
    """Mark every array leaf of ``x`` as a unit boundary named ``name`` (identity on values)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tag: name must be a non-empty str, got {name!r}")
    return jax.tree_util.tree_map(
        lambda a: checkpoint_name(a, PREFIX + name) if isinstance(a, jax.Array)
        or hasattr(a, "aval") else a, x)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """How one tagged layer call is traced: ``kind`` ``"fewbit"`` (its smooth activations keep
    ``value``-bit codes; approximate gradients), ``"rows"`` (a conv trunk row-tiled into
    ``value`` tiles by :mod:`jaxmem.rowconv`; exact) or ``"exact"`` (jaxmem's exact options).
    ``stages`` (``rows`` only): tile the trunk's first ``stages`` pooling stages and run the
    rest as the trunk's own layers (:func:`row_split`); ``None`` tiles all of it."""

    kind: str
    value: int | None = None
    stages: int | None = None

    def __post_init__(self):
        if self.kind not in ("exact", "fewbit", "rows"):
            raise ValueError(f"Conversion: kind must be 'exact', 'fewbit' or 'rows', got "
                             f"{self.kind!r}")
        if self.stages is not None and not (
                self.kind == "rows" and type(self.stages) is int and self.stages >= 1):
            raise ValueError(f"Conversion: stages must be None or an int >= 1 of a 'rows' "
                             f"conversion, got stages={self.stages!r} for {self.kind!r}")


def row_twin(module: Any, rows: int):
    """The row-tiled twin of a Linen conv trunk (same parameters), or ``None`` when
    ``module`` is not one :mod:`jaxmem.rowconv` tiles exactly (a VGG trunk without batch norm,
    float32)."""
    from jaxmem.rowconv.flax import RowVGGFeatures

    if _row_tileable(module):
        return RowVGGFeatures(cfg=tuple(module.cfg), width=module.width, rows=rows)
    return None


def _row_tileable(module: Any) -> bool:
    from jaxmem.models.vgg import VGGFeatures

    return isinstance(module, VGGFeatures) and not module.batch_norm and module.dtype in (
        None, jnp.float32)


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """A conv trunk cut after a pooling stage: ``head`` (row-tiled, its convs ``conv_0`` ..
    ``conv_{n_head - 1}``) then ``tail`` (the trunk's own layers, convs numbered from 0:
    the trunk's ``conv_{n_head + i}`` is the tail's ``conv_i``; ``n_tail`` convs)."""

    head: Any
    tail: Any
    n_head: int
    n_tail: int


def row_split(module: Any, rows: int, stages: int) -> RowSplit | None:
    """The trunk ``module`` with its first ``stages`` pooling stages row-tiled into ``rows``
    tiles (:class:`jaxmem.rowconv.flax.RowVGGFeatures`) and the rest untouched, or ``None``
    when it is not a trunk :func:`row_twin` tiles or has no layer after that stage. Only the
    high-resolution stages are recomputed in the backward pass, not the whole trunk."""
    from jaxmem.models.vgg import VGGFeatures
    from jaxmem.rowconv.flax import RowVGGFeatures

    if not _row_tileable(module):
        return None
    cfg = tuple(module.cfg)
    pools = [i for i, item in enumerate(cfg) if item == "M"]
    if stages > len(pools) or pools[stages - 1] + 1 >= len(cfg):
        return None
    cut = pools[stages - 1] + 1
    n_head = sum(1 for item in cfg[:cut] if item != "M")
    return RowSplit(RowVGGFeatures(cfg=cfg[:cut], width=module.width, rows=rows),
                    VGGFeatures(cfg=cfg[cut:], width=module.width, dtype=module.dtype),
                    n_head, len(cfg) - len(pools) - n_head)


#: ``(trunk path, n_head)`` while the tail of a :class:`RowSplit` runs: its layers are
#: labelled as the trunk's own (``conv_i`` -> ``<trunk path>/conv_{n_head + i}``)
_SPLIT_TAIL: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "jaxmem_plan_split_tail", default=None)


def _tail_path(path: str) -> str:
    """``path`` of a layer inside a running split tail, as the trunk's own layer's path."""
    outer = _SPLIT_TAIL.get()
    if outer is None or not path:
        return path
    trunk, n_head = outer
    first, _, rest = path.partition("/")
    if first.startswith("conv_") and first[5:].isdigit():
        first = f"conv_{int(first[5:]) + n_head}"
    return "/".join(p for p in (trunk, first, rest) if p)


def _run_split(split: RowSplit, module: Any, path: str, x: Any, *rest: Any) -> Any:
    """The trunk's output through ``split`` (same parameters), the head's output tagged as
    the trunk's last head conv and the tail's layers labelled as the trunk's own."""
    params = module.variables["params"]
    head = {f"conv_{i}": params[f"conv_{i}"] for i in range(split.n_head)}
    y = tag(split.head.apply({"params": head}, x, *rest), f"{path}/conv_{split.n_head - 1}")
    tail = {f"conv_{i}": params[f"conv_{split.n_head + i}"] for i in range(split.n_tail)}
    token = _SPLIT_TAIL.set((path, split.n_head))
    try:
        return split.tail.apply({"params": tail}, y, *rest)
    finally:
        _SPLIT_TAIL.reset(token)


#: ``(module path, method)`` of the Linen call a conversion is running (its re-entry)
_CONVERTING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxmem_plan_converting", default=None)


@contextlib.contextmanager
def _linen_tags(conversions: dict[str, Conversion] | None = None, applied: set | None = None):
    """Tag the outputs of every Linen method call (``__call__`` and public methods); a call
    whose label is in ``conversions`` is traced with that conversion (its label goes into
    ``applied`` when the conversion took effect)."""
    import flax.linen as nn

    from jaxmem._glue import options as _options
    from jaxmem.linen import call_converted

    counts: dict[str, int] = {}
    conversions = conversions or {}

    def convert(label, m, meth, path, next_fun, args, kwargs):
        conv = conversions.get(label)
        if conv is None:
            return next_fun(*args, **kwargs)
        if conv.kind == "rows" and conv.stages is not None:
            split = row_split(m, conv.value, conv.stages) if not kwargs else None
            if split is None:
                return next_fun(*args, **kwargs)
            if applied is not None:
                applied.add(label)
            return _run_split(split, m, path, *args)
        if conv.kind == "rows":
            twin = row_twin(m, conv.value) if not kwargs else None
            if twin is None:
                return next_fun(*args, **kwargs)
            if applied is not None:
                applied.add(label)
            return twin.apply({"params": m.variables["params"]}, *args)
        bits = conv.value if conv.kind == "fewbit" else None
        # the call runs as jaxmem.linen.convert would run it (the lifted jaxmem.transform);
        # the converted call re-enters this interceptor for the same module: not a new unit
        token = _CONVERTING.set((path, meth))
        try:
            # the active scope's other options (``residual_adds``, ``conv_recompute``) hold
            base = _options.active() or _options.Options()
            out = call_converted(m, meth, args, kwargs, dataclasses.replace(
                base, selective=True, fewbit=bits, attention=True))
        finally:
            _CONVERTING.reset(token)
        if applied is not None and bits is not None:
            applied.add(label)
        return out

    def interceptor(next_fun, args, kwargs, context):
        meth = context.method_name
        if meth == "setup" or (meth.startswith("_") and meth != "__call__"):
            return next_fun(*args, **kwargs)
        m = context.module
        try:
            if m.scope is None or m.is_initializing():
                return next_fun(*args, **kwargs)
            path = _tail_path("/".join(str(p) for p in m.scope.path))
        except Exception:  # noqa: BLE001  # pragma: no cover - unbound modules
            return next_fun(*args, **kwargs)
        if not path or _CONVERTING.get() == (path, meth):
            return next_fun(*args, **kwargs)
        label = path if meth == "__call__" else f"{path}.{meth}"
        k = counts.get(label, 0)
        counts[label] = k + 1
        if k:
            label = f"{label}#{k}"
        return tag(convert(label, m, meth, path, next_fun, args, kwargs), label)

    with nn.intercept_methods(interceptor):
        yield


@dataclasses.dataclass(frozen=True)
class Unit:
    """Equations ``[start, stop)`` of the loss jaxpr; ``label`` names the layer that ends it."""

    label: str
    start: int
    stop: int
    depth: int


def unjit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a ``jax.jit`` wraps (repeatedly), else ``fn``: a jitted loss traced before
    (e.g. by the untouched step's compile) would replay its cached, untagged jaxpr."""
    while hasattr(fn, "lower") and callable(getattr(fn, "__wrapped__", None)):
        fn = fn.__wrapped__
    return fn


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``: numpy dtypes and JAX's extended dtypes (a typed PRNG
    key ``key<fry>`` holds two uint32 words: 8 bytes)."""
    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else int(np.dtype(dtype).itemsize)


#: call primitives the planner sees through when they hold a layer boundary: ``jax.jit``
#: (``pjit``) and ``jax.checkpoint`` / ``nn.remat`` (whose own recomputation the plan replaces)
_INLINED = frozenset({"pjit", "jit", "checkpoint", "remat", "remat2"})


def _sub_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    """``(jaxpr, consts)`` of an inlinable call equation, else ``None``."""
    if eqn.primitive.name not in _INLINED:
        return None
    sub = eqn.params.get("jaxpr")
    if isinstance(sub, core.ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    if isinstance(sub, core.Jaxpr):
        return sub, []
    return None


def _has_tag(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and str(eqn.params.get("name", "")).startswith(PREFIX):
            return True
        sub = _sub_jaxpr(eqn)
        if sub is not None and _has_tag(sub[0]):
            return True
    return False


def _eval_inlined(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate ``jaxpr`` binding every equation again, except call equations (``jit``,
    ``checkpoint``) that hold a layer boundary: their bodies are evaluated in place."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None and _has_tag(sub[0]):
            outs = _eval_inlined(sub[0], sub[1], *invals)
        else:
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = ans if eqn.primitive.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _inline_tagged_calls(closed: Any) -> Any:
    """``closed`` with the ``jit`` / ``checkpoint`` calls that hide layer boundaries inlined
    (the same values; a user's own ``jax.checkpoint`` around tagged layers is dropped, the
    plan decides what is recomputed)."""
    if not any((sub := _sub_jaxpr(e)) is not None and _has_tag(sub[0])
               for e in closed.jaxpr.eqns):
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                  weak_type=bool(getattr(v.aval, "weak_type", False)))
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: _eval_inlined(closed.jaxpr, closed.consts, *xs))(*avals)


@dataclasses.dataclass
class Traced:
    """The loss jaxpr with its unit boundaries."""

    closed: Any            # ClosedJaxpr of loss(*flat_args)
    in_tree: Any
    out_tree: Any
    ends: dict[str, int]   # tag label -> index of its last tagging equation
    converted: frozenset = frozenset()   # labels whose conversion took effect


def trace(fn: Callable[..., Any], args: Sequence[Any], scope_ctx=None,
          conversions: dict[str, Conversion] | None = None) -> Traced:
    """Trace ``fn(*args)`` with Linen boundary tags (and ``scope_ctx`` active, if given);
    ``conversions`` maps layer labels to the :class:`Conversion` they are traced with."""
    flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
    out_tree_box: list[Any] = []
    fn = unjit(fn)

    def flat_fn(*xs):
        a = jax.tree_util.tree_unflatten(in_tree, xs)
        out = fn(*a)
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves

    ctx = scope_ctx if scope_ctx is not None else contextlib.nullcontext()
    applied: set = set()
    with ctx, _linen_tags(conversions, applied):
        closed = jax.make_jaxpr(flat_fn)(*flat)
    closed = _inline_tagged_calls(closed)
    ends: dict[str, int] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        if eqn.primitive.name == "name":
            nm = eqn.params.get("name", "")
            if isinstance(nm, str) and nm.startswith(PREFIX):
                ends[nm[len(PREFIX):]] = i
    return Traced(closed, in_tree, out_tree_box[-1], ends, frozenset(applied))


def _parent_label(lbl: str) -> str | None:
    """The label of the layer one level above ``lbl``'s, or ``None`` at the top."""
    base = lbl.split("#")[0].split(".")[0]
    return base.rsplit("/", 1)[0] if "/" in base else None


def choose_units(tr: Traced, max_units: int = 64, finer: int = 0) -> list[Unit]:
    """Cut the jaxpr at the outputs of the shallowest tagged layers, then split any unit that
    holds more than half of all equations at its children's outputs (while <= ``max_units``);
    ``finer`` times more, split every unit at its children's outputs (while <= ``max_units``).
    The equations after the last cut form a final untagged unit ``"(rest)"``."""
    n = len(tr.closed.jaxpr.eqns)
    labels = sorted(tr.ends, key=lambda k: tr.ends[k])
    if not labels:
        return []

    def depth(lbl):
        return lbl.split("#")[0].split(".")[0].count("/") + 1

    top = min(depth(lbl) for lbl in labels)
    cuts = [lbl for lbl in labels if depth(lbl) == top]
    while True:
        units = _units_from(tr, cuts, n)
        big = max(units, key=lambda u: u.stop - u.start)
        base = big.label.split("#")[0].split(".")[0]
        kids = [lbl for lbl in labels if _parent_label(lbl) == base
                and units_index(units, tr.ends[lbl]) is big and lbl not in cuts]
        if (big.stop - big.start) * 2 <= n or not kids or len(cuts) + len(kids) > max_units:
            break
        cuts = sorted(set(cuts) | set(kids), key=lambda k: tr.ends[k])
    for _ in range(finer):
        units = _units_from(tr, cuts, n)
        kids = [lbl for lbl in labels if lbl not in cuts and _parent_label(lbl) is not None
                and any(u.label.split("#")[0].split(".")[0] == _parent_label(lbl)
                        and units_index(units, tr.ends[lbl]) is u for u in units)]
        if not kids or len(cuts) + len(kids) > max_units:
            break
        cuts = sorted(set(cuts) | set(kids), key=lambda k: tr.ends[k])
    return _units_from(tr, cuts, n)


def child_units(tr: Traced, u: Unit) -> list[Unit]:
    """Unit ``u`` cut at the outputs of its direct children (the tagged layers one level
    below it that end inside it): consecutive sub-units covering ``u``, the last one (after
    its last child, up to ``u``'s own boundary) labelled ``u.label``; ``[u]`` when it has no
    children. The sub-units a nested segment of one unit checkpoints again."""
    base = u.label.split("#")[0].split(".")[0]
    kids = sorted((e, lbl) for lbl, e in tr.ends.items()
                  if u.start <= e < u.stop - 1 and _parent_label(lbl) == base)
    out, start = [], u.start
    for e, lbl in kids:
        if e + 1 > start:
            out.append(Unit(lbl, start, e + 1, u.depth + 1))
            start = e + 1
    if start < u.stop:
        out.append(Unit(u.label, start, u.stop, u.depth))
    return out


def units_at(tr: Traced, labels: Sequence[str]) -> list[Unit]:
    """Units of ``tr`` cut after the given labels (those the trace does not have are merged
    into the unit that follows them, e.g. the layers inside a row-tiled trunk)."""
    return _units_from(tr, [lbl for lbl in labels if lbl in tr.ends],
                       len(tr.closed.jaxpr.eqns))


def units_index(units, eqn_index):
    for u in units:
        if u.start <= eqn_index < u.stop:
            return u
    return None


def _units_from(tr: Traced, cuts: Sequence[str], n: int) -> list[Unit]:
    out, start = [], 0
    for lbl in sorted(cuts, key=lambda k: tr.ends[k]):
        stop = tr.ends[lbl] + 1
        if stop > start:
            d = lbl.split("#")[0].split(".")[0].count("/") + 1
            out.append(Unit(lbl, start, stop, d))
            start = stop
    if start < n:
        out.append(Unit("(rest)", start, n, 0))
    return out


def chunk_io(jaxpr: Any, start: int, stop: int) -> tuple[list[Any], list[Any]]:
    """Variables a chunk reads from before it, and those it defines that are read after it."""
    defined: set = set()
    ins: list = []
    seen: set = set()
    for eqn in jaxpr.eqns[start:stop]:
        for v in eqn.invars:
            if isinstance(v, core.Literal) or v in defined or v in seen:
                continue
            seen.add(v)
            ins.append(v)
        for v in eqn.outvars:
            if not isinstance(v, core.DropVar):
                defined.add(v)
    later: set = set()
    for eqn in jaxpr.eqns[stop:]:
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                later.add(v)
    for v in jaxpr.outvars:
        if not isinstance(v, core.Literal):
            later.add(v)
    outs, oseen = [], set()
    for eqn in jaxpr.eqns[start:stop]:
        for v in eqn.outvars:
            if v in later and v not in oseen:
                oseen.add(v)
                outs.append(v)
    return ins, outs


def chunk_fn(jaxpr: Any, start: int, stop: int, ins: Sequence[Any], outs: Sequence[Any]):
    """``f(*ins) -> outs`` evaluating equations ``[start, stop)``."""
    eff = core.join_effects(*(e.effects for e in jaxpr.eqns[start:stop])) \
        if stop > start else core.no_effects
    sub = core.Jaxpr(constvars=[], invars=list(ins), outvars=list(outs),
                     eqns=list(jaxpr.eqns[start:stop]), effects=eff)

    def f(*vals):
        return core.eval_jaxpr(sub, [], *vals)

    return f


POLICIES = {
    "store": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "recompute": jax.checkpoint_policies.nothing_saveable,
}


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def fenced_checkpoint(f: Callable[..., Any], policy: Any) -> Callable[..., Any]:
    """``jax.checkpoint(f, policy=policy)`` whose recomputation XLA cannot merge back into
    the forward pass.

    On CPU, XLA drops ``optimization_barrier`` and CSEs a checkpoint's recomputation with the
    forward's values, so ``jax.checkpoint`` alone leaves compiled bytes unchanged (or higher).
    Here the backward (recompute + VJP) runs inside ``lax.cond(p == p, bwd, bwd)`` on a
    cotangent element ``p``: both branches are the same function, so the result is the VJP
    for every ``p`` (NaN included), but XLA cannot fold the predicate, so the recomputation
    stays inside the branch, after the cotangent exists. Non-float inputs get ``float0``
    cotangents.
    """
    ck = jax.checkpoint(f, policy=policy, prevent_cse=True)

    @jax.custom_vjp
    def g(*a):
        return f(*a)

    def fwd(*a):
        fl = tuple(i for i, x in enumerate(a) if _is_float(x))
        rest = tuple(x for i, x in enumerate(a) if i not in fl)

        def on_float(*xf):
            full = list(a)
            for i, x in zip(fl, xf):
                full[i] = x
            return ck(*full)

        out, vjp = jax.vjp(on_float, *[a[i] for i in fl])
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        shapes = tuple((np.shape(x), i) for i, x in enumerate(a))
        return out, (leaves, _Static((tree, fl, shapes)), rest)

    def bwd(res, ct):
        leaves, st, _ = res
        tree, fl, shapes = st.value
        probe = jnp.ravel(jax.tree_util.tree_leaves(ct)[0])[0]

        def branch(leaves, ct):
            return jax.tree_util.tree_unflatten(tree, leaves)(ct)

        cts = lax.cond(probe == probe, branch, branch, leaves, ct)  # noqa: PLR0124 (NaN-aware)
        out, it = [], iter(cts)
        for shape, i in shapes:
            out.append(next(it) if i in fl else np.zeros(shape, jax.dtypes.float0))
        return tuple(out)

    g.defvjp(fwd, bwd)
    return g


class _Static:
    """A hashable-by-identity box for static data carried in custom_vjp residuals."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value),
                                   lambda v, _: _Static(v))


def _checkpointed(f: Callable[..., Any], policy: Any, fence: bool) -> Callable[..., Any]:
    return fenced_checkpoint(f, policy) if fence else \
        jax.checkpoint(f, policy=policy, prevent_cse=True)


def nested_fn(jaxpr: Any, u: Unit, inner: Sequence[Unit], fence: bool = True):
    """``(f, ins, outs)``: equations ``[u.start, u.stop)`` run as the sub-chunks ``inner``
    (consecutive, covering ``u``), each under ``jax.checkpoint(nothing_saveable)`` (fenced
    unless ``fence=False``). Checkpointing ``f`` as a whole gives nested (two-level)
    recomputation: outside its backward only ``u``'s inputs are kept; inside it, the
    recomputation keeps only the sub-chunks' inputs, and each sub-chunk is recomputed once
    more just before its own backward. Same equations, so the same values and gradients."""
    ins, outs = chunk_io(jaxpr, u.start, u.stop)
    edges = [u.start] + [s.stop for s in inner]
    if not inner or [s.start for s in inner] != edges[:-1] or edges[-1] != u.stop:
        raise ValueError(f"nested_fn: sub-chunks must cover unit {u.label!r} consecutively")
    subs = []
    for s in inner:
        si, so = chunk_io(jaxpr, s.start, s.stop)
        subs.append((_checkpointed(chunk_fn(jaxpr, s.start, s.stop, si, so),
                                   POLICIES["recompute"], fence), si, so))
    return _in_turn(subs, ins, outs), ins, outs


def _in_turn(parts, ins, outs):
    """A function of ``ins`` returning ``outs`` that runs ``parts`` (``(g, g's inputs, g's
    outputs)``) in turn."""
    def f(*vals):
        env = dict(zip(ins, vals))
        for g, si, so in parts:
            env.update(zip(so, g(*[env[v] for v in si])))
        return [env[v] for v in outs]

    return f


def partial_fn(jaxpr: Any, u: Unit, inner: Sequence[Unit], stored: Sequence[bool],
               fence: bool = True):
    """``(f, ins, outs)``: equations ``[u.start, u.stop)`` run as the sub-chunks ``inner``
    (its children, :func:`child_units`), those marked ``stored`` as they are (their
    residuals kept) and each run of consecutive others as one chunk under
    ``jax.checkpoint(nothing_saveable)`` (fenced unless ``fence=False``): only that run's
    inputs are kept for it. The same equations, so the same values and gradients."""
    from jaxmem.planner.options import recomputed_runs

    ins, outs = chunk_io(jaxpr, u.start, u.stop)
    edges = [u.start] + [s.stop for s in inner]
    if not inner or len(inner) != len(stored) or [s.start for s in inner] != edges[:-1] \
            or edges[-1] != u.stop:
        raise ValueError(f"partial_fn: {len(stored)} flags for the {len(inner)} sub-chunks "
                         f"that must cover unit {u.label!r} consecutively")
    runs = dict(recomputed_runs(tuple(stored)))
    parts, i = [], 0
    while i < len(inner):
        j = runs.get(i, i + 1)
        start, stop = inner[i].start, inner[j - 1].stop
        si, so = chunk_io(jaxpr, start, stop)
        g = chunk_fn(jaxpr, start, stop, si, so)
        parts.append((_checkpointed(g, POLICIES["recompute"], fence) if i in runs else g,
                      si, so))
        i = j
    return _in_turn(parts, ins, outs), ins, outs


def run_chunks(closed: Any, units: Sequence[Unit], options: dict[str, str],
               flat_args: Sequence[Any], fence: bool = True,
               inner: dict[str, Sequence[Unit]] | None = None) -> list[Any]:
    """Evaluate ``closed`` on ``flat_args`` unit by unit; a unit whose option is ``"dots"`` or
    ``"recompute"`` runs under ``jax.checkpoint`` with that policy (fenced, see
    :func:`fenced_checkpoint`, unless ``fence=False``); ``"segment2"`` runs its sub-units
    ``inner[label]`` each checkpointed inside one checkpointed chunk (nested recomputation,
    :func:`nested_fn`); ``"partialK"`` runs its sub-units ``inner[label]`` stored or
    recomputed as ``Option("partial", K)`` marks them (:func:`partial_fn`); ``"offload"``
    keeps its matmul outputs in host memory (:func:`jaxmem.planner.offload.offload_chunk`)."""
    jaxpr = closed.jaxpr
    env: dict = {}
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, flat_args):
        env[v] = a
    for u in units:
        opt = options.get(u.label, "store")
        if opt == "segment2":
            f, ins, outs = nested_fn(jaxpr, u, (inner or {}).get(u.label) or [u], fence)
            f = _checkpointed(f, POLICIES["recompute"], fence)
        elif opt.startswith("partial"):
            from jaxmem.planner.options import Option, partial_children
            stored = partial_children(Option.parse(opt).param)
            f, ins, outs = partial_fn(jaxpr, u, (inner or {}).get(u.label) or [u], stored,
                                      fence)
        else:
            ins, outs = chunk_io(jaxpr, u.start, u.stop)
            f = chunk_fn(jaxpr, u.start, u.stop, ins, outs)
            if opt == "offload":
                from jaxmem.planner.offload import offload_chunk
                f = offload_chunk(f)   # dot outputs to host memory; not fenced (ties instead)
            elif opt != "store":
                f = _checkpointed(f, POLICIES[opt], fence)
        vals = f(*[env[v] for v in ins])
        for v, x in zip(outs, vals):
            env[v] = x
    return [v.val if isinstance(v, core.Literal) else env[v] for v in jaxpr.outvars]


def flops_of(jaxpr: Any, merge_identical: bool = False) -> tuple[float, float]:
    """(all, dot/conv) FLOPs of a jaxpr: ``2 * out_size * contraction`` for ``dot_general`` and
    convolutions (over an input dilated by ``d``: ``/ prod(d)``, the taps that meet a nonzero),
    one per output element for other equations; a ``scan`` body counted
    ``length`` times, other sub-jaxprs once. ``merge_identical``: an equation that repeats an
    earlier one of the same jaxpr (same primitive, parameters and inputs, no effects) is
    counted once, as XLA's common-subexpression elimination runs it once."""
    total = dots = 0.0
    seen: dict[Any, list[Any]] = {}
    alias: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if merge_identical and not eqn.effects:
            key = _eqn_key(eqn, alias)
            if key is not None:
                if key in seen:
                    alias.update(zip(eqn.outvars, seen[key]))
                    continue
                seen[key] = list(eqn.outvars)
        subs = list(core.jaxprs_in_params(eqn.params))
        if subs:
            times = _runs(eqn)
            for s in subs:
                t, d = flops_of(s, merge_identical)
                total += times * t
                dots += times * d
            continue
        out = sum(float(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            k = float(np.prod([eqn.invars[0].aval.shape[i] for i in lc])) if lc else 1.0
            f = 2.0 * out * k
            total += f
            dots += f
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            dn = eqn.params["dimension_numbers"]
            o_dim = dn.rhs_spec[0]
            # an input dilated by d (a strided convolution's input gradient) is zero at all
            # but 1 / prod(d) of its positions: cuDNN's and XLA's kernels skip those taps
            k = float(np.prod(rhs)) / rhs[o_dim] / float(
                np.prod(eqn.params.get("lhs_dilation") or (1,)))
            f = 2.0 * out * k
            total += f
            dots += f
        else:
            total += out
    return total, dots


def _eqn_key(eqn: Any, alias: dict[Any, Any]) -> tuple | None:
    """What makes ``eqn`` the same computation as another: primitive, parameters (a
    sub-jaxpr by identity) and inputs (through ``alias``: outputs of merged equations), or
    ``None`` where a parameter has no stable text."""
    ins = []
    for v in eqn.invars:
        if isinstance(v, core.Literal):
            ins.append(("lit", repr(v.val)))
        else:
            ins.append(id(alias.get(v, v)))
    params = []
    for k, p in sorted(eqn.params.items()):
        if isinstance(p, (core.Jaxpr, core.ClosedJaxpr, np.ndarray)) or callable(p):
            params.append((k, id(p)))
        else:
            text = repr(p)
            if " at 0x" in text:   # an object without a value repr
                return None
            params.append((k, text))
    return eqn.primitive.name, tuple(ins), tuple(params)


def recomputed_flops(jaxpr: Any) -> float:
    """FLOPs a jaxpr's own ``jax.checkpoint`` calls run again in its backward pass: the
    :func:`flops_of` of every checkpointed body (inside a ``scan``: ``length`` times)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("remat2", "checkpoint", "remat"):
            body = eqn.params["jaxpr"]
            total += flops_of(getattr(body, "jaxpr", body))[0]
            continue
        for s in core.jaxprs_in_params(eqn.params):
            total += _runs(eqn) * recomputed_flops(s)
    return total


def _runs(eqn: Any) -> float:
    """How many times ``eqn``'s sub-jaxprs run: a ``scan``'s ``length``, else once."""
    return float(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1.0
