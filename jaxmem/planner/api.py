"""``plan``: fit the gradient step of a loss into a memory budget (see docs/plan.md)."""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._compat import core
from jaxmem.planner import solve as _solve
from jaxmem.planner import trace as _trace

__all__ = ["BudgetError", "MemoryPlan", "UnitChoice", "budget_spec", "parse_budget", "plan"]

_DEBUG = bool(__import__("os").environ.get("JAXMEM_PLAN_DEBUG"))
OPTIONS = ("store", "dots", "recompute")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


class BudgetError(ValueError):
    """The budget cannot be met; ``smallest_bytes`` is the least compiled total reached."""

    def __init__(self, msg: str, smallest_bytes: int, dominant: dict[str, int],
                 finer_units: bool = False):
        super().__init__(msg)
        self.smallest_bytes = smallest_bytes
        self.dominant = dominant
        self.finer_units = finer_units   # a finer cut into units exists (plan tries it)


_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
_BUDGET_HELP = ("int bytes (4096), a size string ('512MiB', '1.5GB', '4096') or a fraction in "
                "(0, 1] of the untouched step's compiled bytes (0.5 or '0.5')")


def budget_spec(budget: Any, who: str = "plan") -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)`` of a budget, checked without compiling anything.

    Accepted: an int (bytes, numpy integers too); a float in (0, 1] (numpy floats too: a
    fraction of the untouched step's compiled bytes); a string: digits (bytes, ``"4096"``), a
    decimal number (a fraction, ``"0.5"``) or a number with a unit (``"512MiB"``, ``"1.5GB"``;
    units B, KB, MB, GB, KiB, MiB, GiB). Raises a one-line ``TypeError`` (another type) or
    ``ValueError`` (a value out of range, NaN, infinity, an unknown unit)."""
    if isinstance(budget, (bool, np.bool_)):
        raise TypeError(f"{who}: budget must be {_BUDGET_HELP}; got {budget!r}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"{who}: budget must be > 0 bytes, got {budget}")
        return "bytes", int(budget)
    if isinstance(budget, (float, np.floating)):
        f = float(budget)
        if not (math.isfinite(f) and 0.0 < f <= 1.0):
            raise ValueError(f"{who}: a float budget is a fraction in (0, 1] of the untouched "
                             f"step's compiled bytes, got {budget!r} (give bytes as an int or "
                             f"a size string such as '512MiB')")
        return "fraction", f
    if isinstance(budget, str):
        mt = re.fullmatch(rf"\s*({_NUMBER})\s*([A-Za-z]*)\s*", budget)
        unit = mt.group(2).lower() if mt else ""
        if not mt or (unit and unit not in _UNITS):
            raise ValueError(f"{who}: budget string {budget!r} is not a size like '512MiB', "
                             f"'1.5GB', '4096' or a fraction like '0.5' (units: B, KB, MB, GB, "
                             f"KiB, MiB, GiB)")
        num = mt.group(1)
        if not unit and re.fullmatch(r"[0-9]+", num):
            return budget_spec(int(num), who)
        if not unit:
            if not 0.0 < float(num) <= 1.0:
                raise ValueError(f"{who}: budget string {budget!r} without a unit is a "
                                 f"fraction in (0, 1] of the untouched step's compiled bytes; "
                                 f"give bytes as digits ('4096') or with a unit ('1.5MiB')")
            return "fraction", float(num)
        val = float(num) * _UNITS[unit]
        if not math.isfinite(val) or int(val) <= 0:
            raise ValueError(f"{who}: budget {budget!r} must be a finite size of >= 1 byte")
        return "bytes", int(val)
    raise TypeError(f"{who}: budget must be {_BUDGET_HELP}; got {type(budget).__name__} "
                    f"{budget!r}")


def parse_budget(budget: Any, default_bytes: int | None = None) -> int:
    """Bytes of ``budget`` (see :func:`budget_spec` for what is accepted); a fraction is of
    ``default_bytes``, the untouched step's compiled bytes."""
    kind, value = budget_spec(budget)
    if kind == "bytes":
        return int(value)
    if default_bytes is None:
        raise ValueError(f"plan: the fraction budget {budget!r} needs the untouched step's "
                         f"compiled bytes")
    return max(1, int(value * default_bytes))


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """One unit's option: ``store`` (keep its residuals), ``dots`` (keep matmul/conv outputs,
    recompute the rest), ``recompute`` (keep its inputs only), ``segment`` (several units
    recomputed as one chunk), ``fewbit`` (stored with ``bits``-bit activation codes:
    approximate) or ``rows`` (a conv trunk row-tiled into ``rows`` tiles: exact)."""

    label: str
    option: str
    keep_bytes: int
    work_bytes: int
    recompute_flops: float
    why: str
    bits: int | None = None
    rows: int | None = None


def _nbytes(aval) -> int:
    """Bytes of an abstract value (extended dtypes such as typed PRNG keys included)."""
    return int(np.prod(aval.shape)) * _trace.itemsize(aval.dtype) if hasattr(aval, "shape") \
        else 0


def _residual_split(f, ins_avals, policy):
    """(internal residual bytes, set of input positions kept) of ``vjp(f)``."""
    g = f if policy is None else jax.checkpoint(f, policy=policy, prevent_cse=True)

    def res(*a):
        _, vjp = jax.vjp(g, *a)
        return jax.tree_util.tree_leaves(vjp)

    jx = jax.make_jaxpr(res)(*ins_avals).jaxpr
    pos = {v: i for i, v in enumerate(jx.invars)}
    internal, kept, seen = 0, set(), set()
    for v in jx.outvars:
        if isinstance(v, core.Literal) or v in seen:
            continue
        seen.add(v)
        if v in pos:
            kept.add(pos[v])
        elif v not in jx.constvars:
            internal += _nbytes(v.aval)
    return internal, kept


def _compiled_total(fn, args, target="cpu") -> int:
    """Compiled bytes of ``value_and_grad(fn)`` on ``args`` for ``target``."""
    from jaxmem.measure import compiled_memory
    return compiled_memory(jax.value_and_grad(fn), *args, target=target).total_bytes


def _option_text(c: UnitChoice) -> str:
    """``fewbit 2b`` / ``rows 8`` / the option name."""
    if c.bits is not None:
        return f"{c.option} {c.bits}b"
    if c.rows is not None:
        return f"{c.option} {c.rows}"
    return c.option


@dataclasses.dataclass
class MemoryPlan:
    """What :func:`plan` chose. ``step`` takes the loss's arguments (positional and keyword)
    and returns its values; its gradients are the untouched loss's (exact options only), and
    ``jax.value_and_grad(step)``, ``jax.grad(step)`` and :meth:`value_and_grad` compile to
    at most ``budget_bytes`` on ``target``'s plan for arguments of the example's shapes
    (``compiled_bytes`` is ``value_and_grad(step)``'s compiled total; for an OLLA-order plan
    the largest of the three; ``jax.grad(step)`` is compiled and checked too)."""

    step: Callable[..., Any]
    choices: tuple[UnitChoice, ...]
    budget_bytes: int
    default_bytes: int
    predicted_bytes: int
    compiled_bytes: int
    predicted_time: float
    selective: bool
    solver_status: str
    solver_gap: float
    iterations: int
    approximate: bool = False
    notes: tuple[str, ...] = ()
    order: Any = None
    target: str = "cpu"

    def value_and_grad(self) -> Callable[..., Any]:
        """``jax.value_and_grad(self.step)``, or, when an OLLA order was applied
        (``self.order.applied``), the ordered value-and-grad step itself (same values, for
        arguments of the example's shapes; ``jax.value_and_grad(self.step)`` runs it too)."""
        if self.order is not None and self.order.applied:
            return self.order.fn
        return jax.value_and_grad(self.step)

    @property
    def prediction_error(self) -> float:
        """``predicted / compiled - 1``."""
        return self.predicted_bytes / max(self.compiled_bytes, 1) - 1.0

    @property
    def why(self) -> dict[str, str]:
        return {c.label: c.why for c in self.choices}

    def to_dict(self) -> dict[str, Any]:
        keys = ("budget_bytes", "default_bytes", "predicted_bytes", "compiled_bytes",
                "predicted_time", "selective", "solver_status", "solver_gap", "iterations",
                "approximate", "target")
        d = {k: getattr(self, k) for k in keys}
        d["order"] = None if self.order is None else {
            "applied": self.order.applied, "why": self.order.why,
            "compiled_bytes": self.order.compiled_bytes, "chunks": self.order.chunks}
        d["prediction_error"] = self.prediction_error
        d["notes"] = list(self.notes)
        d["choices"] = [dataclasses.asdict(c) for c in self.choices]
        return d

    def __rich__(self):
        from rich.table import Table
        mib = 2.0**20
        t = Table(title=(f"jaxmem plan: compiled {self.compiled_bytes / mib:.2f} MiB "
                         f"(budget {self.budget_bytes / mib:.2f}, default "
                         f"{self.default_bytes / mib:.2f}, predicted "
                         f"{self.predicted_bytes / mib:.2f}); time x{self.predicted_time:.2f}; "
                         f"{self.solver_status}"))
        for col in ("unit", "option", "kept MiB", "recompute MFLOP", "why"):
            t.add_column(col)
        for c in self.choices:
            t.add_row(c.label, _option_text(c), f"{c.keep_bytes / mib:.3f}",
                      f"{c.recompute_flops / 1e6:.1f}", c.why)
        return t

    def __str__(self) -> str:
        mib = 2.0**20
        head = (f"MemoryPlan: compiled {self.compiled_bytes / mib:.2f} MiB <= budget "
                f"{self.budget_bytes / mib:.2f} MiB (default {self.default_bytes / mib:.2f}, "
                f"predicted {self.predicted_bytes / mib:.2f}), time x{self.predicted_time:.2f}")
        lines = [head]
        lines += [f"  {c.label:<24} {_option_text(c):<10} {c.why}" for c in self.choices]
        return "\n".join(lines)


def _signature(fn):
    """``inspect.signature(fn)``, or ``None`` when it has none."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind(sig, args, kwargs):
    """``(args, kwargs)`` with every keyword argument that names a positional parameter of
    the loss moved into ``args`` (``TypeError`` for arguments the loss does not take)."""
    if sig is None:
        return tuple(args), dict(kwargs)
    try:
        ba = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"plan.step takes the loss's arguments: {e}") from None
    return tuple(ba.args), dict(ba.kwargs)


def _is_static(x) -> bool:
    """Leaves the planned step does not trace: strings, ``None`` and other non-numbers."""
    return not (isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
                or hasattr(x, "aval") or isinstance(x, jax.ShapeDtypeStruct))


def _hashable(x):
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


def _abstract(x):
    if isinstance(x, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), jax.numpy.result_type(x), weak_type=True)
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def _make_step(fn, factory, cut_labels, runs, conversions, fence=True):
    """The loss evaluated unit by unit: ``runs`` are ``(labels, option)`` over consecutive
    units (cut after ``cut_labels``), ``conversions`` the per-layer tracing conversions,
    recomputed units fenced (``fence``, see :func:`jaxmem.planner.trace.fenced_checkpoint`);
    takes the loss's positional and keyword arguments; re-traced for new shapes."""
    cache: dict[Any, tuple[Any, list[_trace.Unit], dict]] = {}
    cut_labels, runs = tuple(cut_labels), tuple(runs)
    conversions = dict(conversions)
    sig = _signature(fn)
    fn = _trace.unjit(fn)

    def step(*args, **kwargs):
        args, kwargs = _bind(sig, args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        static = tuple(i for i, a in enumerate(leaves) if _is_static(a))
        key = (tree, tuple((i, _hashable(a)) if i in static else
                           (tuple(np.shape(a)), str(jax.numpy.result_type(a)),
                            isinstance(a, (bool, int, float, complex)))
                           for i, a in enumerate(leaves)))
        if key not in cache:
            spec = [a if i in static else _abstract(a) for i, a in enumerate(leaves)]
            static_vals = {i: leaves[i] for i in static}

            def traced(*dyn):
                it = iter(dyn)
                full = [static_vals[i] if i in static_vals else next(it)
                        for i in range(len(leaves))]
                a, k = jax.tree_util.tree_unflatten(tree, full)
                return fn(*a, **k)

            dyn_spec = tuple(x for i, x in enumerate(spec) if i not in static_vals)
            tr = _trace.trace(traced, dyn_spec, factory() if factory else None,
                              conversions or None)
            units = _trace.units_at(tr, cut_labels)
            by_label = {u.label: u for u in units}
            merged, opts, used = [], {}, 0
            for labels, o in runs or [((u.label,), "store") for u in units]:
                present = [by_label[lbl] for lbl in labels if lbl in by_label]
                if not present:
                    raise ValueError(f"plan: the step traced with new shapes has no unit "
                                     f"{labels[-1]!r}; the plan was made for other code")
                used += len(present)
                u = present[0] if len(present) == 1 else _trace.Unit(
                    f"{present[0].label}..{present[-1].label}", present[0].start,
                    present[-1].stop, present[0].depth)
                merged.append(u)
                opts[u.label] = "recompute" if o == "segment" else o
            if used != len(units):
                raise ValueError(f"plan: the step traced with new shapes has {len(units)} "
                                 f"units, the plan covers {used}")
            cache[key] = (tr, merged, opts)
        tr, merged, opts = cache[key]
        dyn = [a for i, a in enumerate(leaves) if i not in static]
        outs = _trace.run_chunks(tr.closed, merged, opts, dyn, fence=fence)
        return jax.tree_util.tree_unflatten(tr.out_tree, outs)

    step.__name__ = getattr(fn, "__name__", "step") + "_planned"
    return step


def _float0_like(x):
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _ordered_step(fn, order_fn, example_args):
    """The loss whose gradient runs the OLLA-ordered ``value_and_grad`` step ``order_fn``.

    For arguments of the example's structure, shapes and dtypes the result is a
    ``jax.custom_vjp`` function: its value is ``fn``'s, its forward pass runs ``order_fn``
    (value and gradient w.r.t. the first argument, in the order), and its backward pass
    scales that gradient by the cotangent, so ``jax.grad`` / ``jax.value_and_grad`` of it
    compile to the ordered step. Cotangents of the other arguments (rarely wanted) are the
    untouched loss's, computed by an extra pass in the backward (XLA drops it when unused);
    non-float leaves get ``float0`` zeros. Other shapes run ``fn`` itself."""
    sig = _signature(fn)
    want = jax.tree_util.tree_structure(tuple(example_args))
    want_leaves = [(tuple(np.shape(a)), str(jax.numpy.result_type(a)))
                   for a in jax.tree_util.tree_leaves(tuple(example_args))]

    @jax.custom_vjp
    def ordered(*args):
        return fn(*args)

    def fwd(*args):
        v, g = order_fn(*args)
        return v, (g, args)

    def bwd(res, ct):
        g, args = res
        out = [jax.tree_util.tree_map(lambda x: (ct * x).astype(x.dtype), g)]
        rest = args[1:]
        leaves, tree = jax.tree_util.tree_flatten(rest)
        fl = [i for i, x in enumerate(leaves) if _trace._is_float(x)]
        cts = [_float0_like(x) for x in leaves]
        if fl:
            def on_float(*xf):
                full = list(leaves)
                for i, x in zip(fl, xf):
                    full[i] = x
                return fn(args[0], *jax.tree_util.tree_unflatten(tree, full))

            _, vjp = jax.vjp(on_float, *[leaves[i] for i in fl])
            for i, c in zip(fl, vjp(ct)):
                cts[i] = c
        out += list(jax.tree_util.tree_unflatten(tree, cts))
        return tuple(out)

    ordered.defvjp(fwd, bwd)

    def step(*args, **kwargs):
        args, kwargs = _bind(sig, args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(args)
        if not kwargs and tree == want and [
                (tuple(np.shape(a)), str(jax.numpy.result_type(a))) for a in leaves] \
                == want_leaves:
            return ordered(*args)
        return fn(*args, **kwargs)

    step.__name__ = getattr(fn, "__name__", "step") + "_ordered"
    return step


def _keep_bytes(jaxpr, u, outer, policy=None) -> tuple[int, int]:
    """(bytes kept for the backward pass, internal residual bytes) of unit ``u`` of
    ``jaxpr`` under ``policy`` (``None``: store)."""
    ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
    f = _trace.chunk_fn(jaxpr, u.start, u.stop, ins, outs)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
    internal, kept = _residual_split(f, avals, policy)
    return internal + sum(_nbytes(ins[i].aval) for i in kept if ins[i] not in outer), internal


FEWBIT_BITS = (1, 2, 3, 4)
#: the OLLA order alone is tried for budgets of at least this fraction of the default (the
#: order's reductions measured here are <= 20 %: GPT -19.8 %, ResNet-50 0 %)
_ORDER_MIN_FRACTION = 0.6
#: when no plan fits, units are split at their layers' children up to this many times
_MAX_FINER = 1
ROW_COUNTS = (2, 4, 8)


def _aligned(tr, units_c, labels, dropped=()) -> bool:
    """Whether the converted trace's units are the base units (minus ``dropped`` labels)."""
    return [u.label for u in units_c] == [lbl for lbl in labels if lbl not in dropped]


def _fewbit_items(step, args, factory, units, cut_labels, keep, total_flops, approx_cost):
    """``fewbit<b>`` items: each unit stored with ``b``-bit codes for its smooth activations,
    where that keeps fewer bytes than exact storage (measured on a trace with every unit at
    ``b`` bits)."""
    labels = [u.label for u in units]
    items = []
    for b in FEWBIT_BITS:
        convs = {lbl: _trace.Conversion("fewbit", b) for lbl in cut_labels}
        tr = _trace.trace(step, args, factory() if factory else None, convs)
        units_c = _trace.units_at(tr, cut_labels)
        if not _aligned(tr, units_c, labels):
            continue
        jx = tr.closed.jaxpr
        outer = set(jx.invars) | set(jx.constvars)
        for u, uc in enumerate(units_c):
            if uc.label not in tr.converted:
                continue
            kb, _ = _keep_bytes(jx, uc, outer)
            if kb < keep[u][0]:
                cost = approx_cost * 3.0 * max(total_flops, 1.0) * (5 - b) / 4
                items.append(((u,), f"fewbit{b}", kb, 0, cost))
    return items


def _row_items(step, args, factory, tr0, units, cut_labels, keep, flops):
    """``rows<r>`` items: a conv trunk (see :func:`jaxmem.planner.trace.row_twin`) that is a
    unit boundary, row-tiled into ``r`` tiles; the item covers the trunk's own units (its
    layers' units merge into it)."""
    labels = [u.label for u in units]
    items = []
    for r in ROW_COUNTS:
        convs = {lbl: _trace.Conversion("rows", r) for lbl in tr0.ends}
        tr = _trace.trace(step, args, factory() if factory else None, convs)
        trunks = sorted(tr.converted & set(cut_labels))
        if not trunks:
            break   # whether a layer has a row twin does not depend on r
        units_c = _trace.units_at(tr, cut_labels)
        jx = tr.closed.jaxpr
        outer = set(jx.invars) | set(jx.constvars)
        for trunk in trunks:
            inside = {lbl for lbl in labels if lbl.startswith(trunk + "/")}
            cover = tuple(u for u, lbl in enumerate(labels) if lbl in inside or lbl == trunk)
            if not cover or cover != tuple(range(cover[0], cover[-1] + 1)):
                continue
            if not _aligned(tr, units_c, labels, inside):
                continue
            uc = next(x for x in units_c if x.label == trunk)
            kb, _ = _keep_bytes(jx, uc, outer)
            held = sum(keep[u][0] for u in cover)
            if kb < held:
                items.append((cover, f"rows{r}", kb, held // r,
                              sum(flops[u][0] for u in cover)))
    return items


def plan(step: Callable[..., Any], *example_args: Any, budget: Any,
         allow_approximate: bool = False, time_limit: float = 10.0,
         max_iterations: int = 6, fence_cost: float = 0.1,
         approx_cost: float = 0.01, offload_bandwidth: float = 25e9,
         offload_flops: float = 50e12, order: bool = True,
         target: str = "cpu") -> MemoryPlan:
    """Fit ``jax.value_and_grad(step)`` (gradient w.r.t. the first argument) into ``budget``.

    ``step(params, *batch) -> scalar loss`` may call Flax Linen modules (their outputs become
    the units; :func:`jaxmem.planner.tag` marks units in other code). Each unit is stored,
    run with ``jax.checkpoint`` under ``dots_saveable`` (``dots``) or ``nothing_saveable``
    (``recompute``), or joined with its neighbours into one recomputed ``segment`` (only the
    segment's inputs are kept). CP-SAT picks the options of least predicted time

        time = 1 + recomputed FLOPs / (3 * step FLOPs) + fence_cost * (checkpointed items)

    subject to predicted bytes <= budget; every chosen plan is compiled, the byte model is
    refitted on all compiled plans and the problem re-solved while the compiled bytes exceed
    ``budget``. When no plan fits under the model, the plan of least predicted bytes is
    compiled as well, so a budget that plan meets is found. Raises :class:`BudgetError` when
    no plan it compiled is within ``budget``.

    Args:
      step: ``step(params, *batch) -> scalar`` loss.
      *example_args: example ``params`` and batch, of the shapes and dtypes to plan for.
      budget: bytes (int), a size string such as ``"512MiB"``, or a float in (0, 1]: a
        fraction of the untouched step's compiled bytes.
      allow_approximate: also offer few-bit activation codes (1..4 bits, per unit) for units
        with smooth activations (GELU, SiLU, tanh, ...): their gradients become the few-bit
        approximation (:mod:`jaxmem.fewbit`), the rest stays exact.
      time_limit: CP-SAT time limit per solve, in seconds.
      max_iterations: most solve-compile rounds.
      fence_cost: predicted extra step time per checkpointed item, as a fraction of the
        untouched step's time (each runs its backward behind a ``lax.cond`` fence; measured
        ~0.2 per unit on CPU for ResNet-50 at width 0.125, ~0 for GPT).
      approx_cost: predicted cost of a unit stored with few-bit codes, as a fraction of a step
        at 1 bit (``(5 - bits) / 4`` of it at ``bits``): the solver prefers exact storage,
        then more bits, then recomputation costing more than this.
      offload_bandwidth: host <-> device bytes per second for the ``offload`` option (offered
        only where the backend has device memory apart from host memory: GPU, TPU; see
        :func:`jaxmem.planner.offload.offload_available`); its predicted cost is the round
        trip ``2 * bytes / offload_bandwidth`` over a step of ``3 * FLOPs / offload_flops``
        seconds.
      offload_flops: the device's sustained FLOP/s for that ratio.
      order: for budgets of at least 0.6 of the default, first try the untouched step in an
        OLLA order (:func:`jaxmem.planner.order.
        ordered`: the step's operations re-emitted in a low-peak order between
        ``optimization_barrier`` fences); when that alone fits, it is returned (nothing
        recomputed): ``plan.step`` is then a ``jax.custom_vjp`` function whose gradient runs
        the ordered step, and :meth:`MemoryPlan.value_and_grad` is the ordered step itself.
      target: whose compiled bytes the plan is made and checked against: ``"cpu"`` (this
        process's CPU, default) or a GPU (``"h100"``, ``"h100_pcie"``, ``"h200"``,
        ``"a100"``, ``"b200"``): XLA:GPU's plan compiled here without a GPU
        (:func:`jaxmem.measure.compiled_memory`; no autotuning, so cuBLAS/cuDNN workspaces
        are not counted). On a GPU target recomputed units run unfenced when that compiles
        to fewer bytes (measured once per plan, every unit recomputed), and host offload is
        offered.

    Returns:
      A :class:`MemoryPlan`: ``plan.step`` takes ``step``'s positional and keyword arguments
      and returns its values; ``jax.value_and_grad(plan.step)`` and ``jax.grad(plan.step)``
      (w.r.t. the first argument) compile within the budget on ``target`` for arguments of
      the example's shapes. With the per-item choices, predicted and compiled bytes.

    Raises:
      BudgetError: no compiled plan fits; ``smallest_bytes`` is a budget this function meets
        for the same step and arguments.
      TypeError / ValueError: a bad argument (``budget``: see :func:`budget_spec`; ``target``
        not one of :data:`jaxmem.measure.target.TARGETS`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jaxmem
      >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)])
      >>> x = jnp.ones((4, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
      >>> mp = jaxmem.plan(loss, params, x, budget=2**30)
      >>> mp.compiled_bytes <= mp.budget_bytes
      True
      >>> bool(jnp.allclose(mp.step(params, x), loss(params, x)))
      True
    """
    if not isinstance(order, bool):
        raise TypeError(f"plan: order must be True or False, got {order!r}")
    err = None
    measured: dict[str, Any] = {}   # default compile and variant choice, shared by the retry
    for finer in range(_MAX_FINER + 1):
        try:
            return _plan(step, *example_args, budget=budget, order=order and finer == 0,
                         target=target,
                         allow_approximate=allow_approximate, time_limit=time_limit,
                         max_iterations=max_iterations, fence_cost=fence_cost,
                         approx_cost=approx_cost, offload_bandwidth=offload_bandwidth,
                         offload_flops=offload_flops, _finer=finer, _measured=measured)
        except BudgetError as e:
            if err is None or e.smallest_bytes < err.smallest_bytes:
                err = e
            if not e.finer_units:
                break
    raise err


def _plan(step: Callable[..., Any], *example_args: Any, budget: Any,
         allow_approximate: bool = False, time_limit: float = 10.0,
         max_iterations: int = 6, fence_cost: float = 0.1,
         approx_cost: float = 0.01, offload_bandwidth: float = 25e9,
         offload_flops: float = 50e12, order: bool = True, target: str = "cpu",
         _finer: int = 0, _measured: dict | None = None) -> MemoryPlan:
    """:func:`plan` with units split ``_finer`` levels below the default cut; ``_measured``
    keeps the untouched step's compile and the variant choice for a later call."""
    if not callable(step):
        raise TypeError(f"plan: step must be callable, got {type(step).__name__}")
    if not example_args:
        raise ValueError("plan: give example arguments, e.g. plan(loss, params, batch, ...)")
    if not isinstance(allow_approximate, bool):
        raise TypeError(f"plan: allow_approximate must be True or False, got "
                        f"{allow_approximate!r}")
    if not (isinstance(approx_cost, (int, float)) and approx_cost >= 0):
        raise ValueError(f"plan: approx_cost must be a number >= 0, got {approx_cost!r}")
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"plan: time_limit must be a positive number of seconds, got "
                         f"{time_limit!r}")
    if not (isinstance(max_iterations, int) and max_iterations >= 1):
        raise ValueError(f"plan: max_iterations must be an int >= 1, got {max_iterations!r}")
    if not (isinstance(fence_cost, (int, float)) and fence_cost >= 0):
        raise ValueError(f"plan: fence_cost must be a number >= 0, got {fence_cost!r}")
    args = tuple(example_args)
    from jaxmem.measure import compiled_memory
    from jaxmem.measure.target import check_target
    budget_spec(budget)   # validate before compiling anything
    target = check_target(target, 1, "plan")
    if _measured is None:
        _measured = {}
    if "default" not in _measured:
        _measured["default"] = compiled_memory(jax.value_and_grad(step), *args, target=target)
    cm0 = _measured["default"]
    default_bytes = cm0.total_bytes
    budget_bytes = parse_budget(budget, default_bytes)
    floor = cm0.argument_bytes + cm0.output_bytes - cm0.alias_bytes
    mib = 2.0**20
    order_result = None
    if order and max(floor, _ORDER_MIN_FRACTION * default_bytes) <= budget_bytes < default_bytes:
        from jaxmem.planner.order import ordered
        order_result = ordered(jax.value_and_grad(step), *args, time_limit=time_limit,
                               min_reduction=0.01, target=target)
        if order_result.applied and order_result.compiled_bytes <= budget_bytes:
            # the returned step's own gradient must run the order: compile what users call
            o_step = _ordered_step(step, order_result.fn, args)
            o_bytes = max(_compiled_total(o_step, args, target),
                          order_result.compiled_bytes)
            if o_bytes <= budget_bytes:
                o_bytes = max(o_bytes, compiled_memory(jax.grad(o_step), *args,
                                                       target=target).total_bytes)
            if o_bytes <= budget_bytes:
                return MemoryPlan(
                    step=o_step, choices=(UnitChoice("(step)", "store", 0, 0, 0.0,
                                                     f"OLLA order: {order_result.why}"),),
                    budget_bytes=budget_bytes, default_bytes=default_bytes,
                    predicted_bytes=order_result.compiled_bytes, compiled_bytes=o_bytes,
                    predicted_time=1.0, selective=False, solver_status="OPTIMAL",
                    solver_gap=0.0, iterations=1,
                    notes=(f"the OLLA order alone fits: {order_result.why}",),
                    order=order_result, target=target)

    if "variant" not in _measured:
        import jaxmem
        variants = [(False, None), (True, lambda: jaxmem.scope())]
        best = None
        for sel, factory in variants:
            s = _make_step(step, factory, (), (), {})
            try:
                b = _compiled_total(s, args, target)
            except Exception:  # noqa: BLE001, S112 - a scope that cannot trace is not used
                continue
            # a tie goes to jaxmem's scope when few-bit codes may be offered (they need it)
            if best is None or b < best[2] or (b == best[2] and allow_approximate):
                best = (sel, factory, b)
        _measured["variant"] = best
    selective, factory, store_bytes = _measured["variant"]

    tr = _trace.trace(step, args, factory() if factory else None)
    units = _trace.choose_units(tr, finer=_finer)
    n = len(units)
    labels = [u.label for u in units]
    cut_labels = [lbl for lbl in labels if lbl != "(rest)"]
    jaxpr = tr.closed.jaxpr
    outer = set(jaxpr.invars) | set(jaxpr.constvars)
    keep, work, flops = [], [], []
    total_flops = 0.0
    for u in units:
        ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
        sub = core.Jaxpr([], list(ins), list(outs), list(jaxpr.eqns[u.start:u.stop]))
        fl, dots = _trace.flops_of(sub)
        total_flops += fl
        row_k, row_w = [], []
        full = None
        for o in OPTIONS:
            kb, internal = _keep_bytes(jaxpr, u, outer, _trace.POLICIES[o])
            if o == "store":
                full = internal
            row_k.append(kb)
            row_w.append(0 if o == "store" else max(0, full - internal))
        keep.append(row_k)
        work.append(row_w)
        flops.append((fl, fl - dots))
    fence = fence_cost * 3.0 * max(total_flops, 1.0)

    # items: (cover, option, raw kept bytes, raw work bytes, predicted extra FLOPs)
    raw = []
    for u in range(n):
        raw.append(((u,), "store", keep[u][0], 0, 0.0))
        raw.append(((u,), "dots", keep[u][1], work[u][1], flops[u][1] + fence))
        raw.append(((u,), "recompute", keep[u][2], work[u][2], flops[u][0] + fence))
    for i in range(n):
        for j in range(i + 2, n + 1):
            ins, _ = _trace.chunk_io(jaxpr, units[i].start, units[j - 1].stop)
            kb = sum(_nbytes(v.aval) for v in ins if v not in outer)
            wb = sum(keep[u][0] for u in range(i, j))
            raw.append((tuple(range(i, j)), "segment", kb, wb,
                        sum(flops[u][0] for u in range(i, j)) + fence))
    notes: list[str] = []
    if order_result is not None:
        notes.append(f"OLLA order alone does not fit: {order_result.why}")
    if allow_approximate:
        if selective:
            raw += _fewbit_items(step, args, factory, units, cut_labels, keep, total_flops,
                                 approx_cost)
        else:
            notes.append("few-bit not offered: jaxmem's conversion did not lower this step")
    raw += _row_items(step, args, factory, tr, units, cut_labels, keep, flops)
    from jaxmem.planner import offload as _offload
    if target == "cpu":
        can_offload, why_not = _offload.offload_available()
    else:   # XLA:GPU plans pinned_host residuals apart from device memory
        can_offload, why_not = True, ""
    if can_offload:
        step_seconds = 3.0 * max(total_flops, 1.0) / offload_flops
        for u in range(n):
            if keep[u][0] > keep[u][2]:
                moved = keep[u][0] - keep[u][2]
                t = _offload.transfer_seconds(moved, offload_bandwidth)
                raw.append(((u,), "offload", keep[u][2], 0,
                            t / step_seconds * 3.0 * max(total_flops, 1.0)))
    else:
        notes.append(f"host offload not offered: {why_not}")
    kinds = ("dots", "recompute", "segment", "fewbit", "offload")
    measured: dict[int, int] = {}   # item -> compiled saving of "this item, the rest stored"

    def kind_of(o):
        return o.rstrip("0123456789")

    def features(choice):
        """Savings by option kind (``kinds``; rows items are measured, see ``known``), minus
        the largest work."""
        f = dict.fromkeys(kinds, 0.0)
        w = 0.0
        for i in choice:
            cover, o, kb, wb, _ = raw[i]
            if i in measured or o == "store" or kind_of(o) not in f:
                continue
            f[kind_of(o)] += sum(keep[u][0] for u in cover) - kb
            w = max(w, wb)
        return np.array([f[k] for k in kinds] + [-w])

    def known(choice):
        """Compiled savings of measured items (jaxpr-level savings of rows items not yet
        measured)."""
        return float(sum(measured[i] if i in measured else
                         sum(keep[u][0] for u in raw[i][0]) - raw[i][2]
                         if kind_of(raw[i][1]) == "rows" else 0 for i in choice))

    tried: dict[tuple[int, ...], int] = {}
    preds: dict[tuple[int, ...], int] = {}
    idx = {(r[0], r[1]): i for i, r in enumerate(raw)}

    def uniform(o):
        return tuple(idx[((u,), o)] for u in range(n))

    def fit(only=None):
        """``default - compiled ~= sum_k a_k * saving_k - b * work`` over option kinds k:
        least squares over every compiled plan (those in ``only``, if given), with a weak
        prior pulling each coefficient to 1."""
        over_plans = [c for c in tried if only is None or c in only]
        rows = [features(c) for c in over_plans]
        ys = [float(store_bytes - tried[c]) - known(c) for c in over_plans]
        lam = 1e-2 * max(store_bytes, 1)
        dim = len(kinds) + 1
        a_mat = np.vstack(rows + [np.eye(dim) * lam]) / max(store_bytes, 1)
        y = np.array(ys + [lam] * dim) / max(store_bytes, 1)
        theta = np.linalg.lstsq(a_mat, y, rcond=None)[0]
        return np.clip(theta, 0.0, None)

    def predict(choice, theta):
        return int(np.rint(store_bytes - float(features(choice) @ theta) - known(choice)))

    def items_for(theta):
        coef = dict(zip(kinds, theta))
        out = []
        for i, (cover, o, kb, wb, cst) in enumerate(raw):
            full = sum(keep[u][0] for u in cover)
            if i in measured:
                out.append(_solve.Item(cover, o, int(full - measured[i]), 0, cst))
                continue
            a = 1.0 if o == "store" else coef[kind_of(o)]
            out.append(_solve.Item(cover, o, int(np.rint(full - a * (full - kb))),
                                   int(np.rint(theta[-1] * wb)), cst))
        return out

    base = store_bytes - sum(k[0] for k in keep)
    all_store = uniform("store")
    tried[all_store] = preds[all_store] = store_bytes

    def realise(choice):
        """(runs, conversions) of a choice, for :func:`_make_step`."""
        runs, convs = [], {}
        for i in sorted(choice, key=lambda i: raw[i][0][0]):
            cover, o = raw[i][0], raw[i][1]
            k = kind_of(o)
            if k in ("fewbit", "rows"):
                convs[labels[cover[-1]]] = _trace.Conversion(k, int(o[len(k):]))
            runs.append((tuple(labels[u] for u in cover),
                         "store" if k in ("fewbit", "rows") else o))
        if any(c.kind == "fewbit" for c in convs.values()):
            for lbl in cut_labels:
                convs.setdefault(lbl, _trace.Conversion("exact"))
        return tuple(runs), convs

    # recomputed units run behind the lax.cond fence on CPU (XLA:CPU undoes a bare
    # jax.checkpoint); on a GPU target both are compiled once (every unit recomputed) and
    # the fewer bytes decide
    fence_mode = {"on": True if target == "cpu" else None}

    def build(choice):
        runs, convs = realise(choice)
        return _make_step(step, factory, cut_labels, runs, convs, fence=fence_mode["on"])

    def compile_choice(choice):
        if choice not in tried:
            preds[choice] = predict(choice, fit())
            tried[choice] = _compiled_total(build(choice), args, target)
        return tried[choice]

    def choose_fence():
        if fence_mode["on"] is not None or not n:
            fence_mode["on"] = True if fence_mode["on"] is None else fence_mode["on"]
            return
        choice = uniform("recompute")
        runs, convs = realise(choice)
        with_fence, without = (_compiled_total(_make_step(step, factory, cut_labels, runs,
                                                          convs, fence=f), args, target)
                               for f in (True, False))
        fence_mode["on"] = with_fence < without
        preds[choice] = predict(choice, fit())
        tried[choice] = min(with_fence, without)
        notes.append(f"{target} plan: recomputed units {'fenced' if fence_mode['on'] else 'unfenced'}"
                     f" (every unit recomputed: fenced {with_fence / mib:.2f} MiB, unfenced "
                     f"{without / mib:.2f} MiB)")

    grad_bytes: dict[tuple[int, ...], int] = {}

    def grad_total(choice):
        """Compiled bytes of ``jax.grad`` of the choice's step (XLA may plan it apart from
        ``value_and_grad``; both are documented uses)."""
        if choice not in grad_bytes:
            from jaxmem.measure import compiled_memory as _cm
            grad_bytes[choice] = _cm(jax.grad(build(choice)), *args,
                                     target=target).total_bytes
        return grad_bytes[choice]

    def fits_budget(choice):
        """Whether the compiled choice holds the budget with ``value_and_grad`` and ``grad``
        (the latter compiled only for a choice whose ``value_and_grad`` fits)."""
        return tried[choice] <= budget_bytes and grad_total(choice) <= budget_bytes

    def cost_of(choice):
        return sum(raw[i][4] for i in choice)

    def least_of(kind):
        """Every unit with an item of ``kind`` takes the one of fewest bytes, others store."""
        best_item: dict[tuple[int, ...], int] = {}
        for i, r in enumerate(raw):
            if kind_of(r[1]) == kind and (r[0] not in best_item
                                           or r[2] < raw[best_item[r[0]]][2]):
                best_item[r[0]] = i
        chosen, covered = [], set()
        for cover, i in sorted(best_item.items()):
            if not covered & set(cover):
                chosen.append(i)
                covered |= set(cover)
        chosen += [idx[((u,), "store")] for u in range(n) if u not in covered]
        return tuple(sorted(chosen)) if best_item else None

    calibration: set[tuple[int, ...]] = {all_store}

    def calibrate():
        """Compile the plans every search starts from (they do not depend on the budget)."""
        choose_fence()
        calibration.add(uniform("recompute"))
        compile_choice(uniform("recompute"))
        if any(keep[u][1] < keep[u][0] for u in range(n)):
            calibration.add(uniform("dots"))
            compile_choice(uniform("dots"))
        for kind in ("fewbit", "offload"):
            c = least_of(kind)
            if c is not None:
                calibration.add(c)
                compile_choice(c)
        for i, r in enumerate(raw):
            if kind_of(r[1]) == "rows" and i not in measured:
                # few row counts per trunk, each with its own tile working set: compile each
                # alone and use the measured saving for this item from then on
                alone = tuple(sorted([i] + [idx[((u,), "store")] for u in range(n)
                                            if u not in r[0]]))
                calibration.add(alone)
                measured[i] = store_bytes - compile_choice(alone)

    def reachable():
        """Compile the plan of least predicted bytes under a model fitted on the calibration
        plans alone: every refused search compiles it (and those plans) whatever its budget,
        so the least of their bytes is a budget :func:`plan` meets. Returns those plans."""
        if not n:
            return {all_store}
        calibrate()
        sol = _solve.solve_items(n, items_for(fit(calibration)), base, None, "bytes",
                                 time_limit)
        if sol.choice is None:
            return set(calibration)
        compile_choice(sol.choice)
        return set(calibration) | {sol.choice}

    def least_bytes():
        """Compile the plan of least predicted bytes (and every unit recomputed)."""
        if n:
            calibrate()
            over = [c for c in tried if not fits_budget(c)]
            sol = _solve.solve_items(n, items_for(fit()), base, None, "bytes", time_limit,
                                     over if budget_bytes >= floor else ())
            if sol.choice is not None:
                compile_choice(sol.choice)

    sol = None
    it = 0
    status = "OPTIMAL"
    if budget_bytes < floor:
        least_bytes()
    elif budget_bytes >= store_bytes or not n:
        pass
    else:
        calibrate()
        slack = 0
        least_tried = False
        for it in range(1, max_iterations + 1):
            fits = [c for c in tried if fits_budget(c)]
            theta = fit()
            items = items_for(theta)
            over = [c for c in tried if c not in fits]
            sol = _solve.solve_items(n, items, base, budget_bytes - slack, "time", time_limit,
                                     over)
            if _DEBUG:
                print("plan: theta", theta, "slack", slack, sol)
            if sol.choice is None or (fits and cost_of(sol.choice) >= min(map(cost_of, fits))):
                if fits:
                    break
                sol = _solve.solve_items(n, items, base, None, "bytes", time_limit, over)
                if sol.choice is None or sol.choice in tried or (
                        least_tried and predict(sol.choice, theta) > 1.1 * budget_bytes):
                    break   # the least-bytes plan was compiled; the model sees none smaller
                least_tried = True
                mode_bytes = True
            else:
                mode_bytes = False
            compiled = compile_choice(sol.choice)
            if _DEBUG:
                print("plan:", realise(sol.choice), "predicted", preds[sol.choice],
                      "compiled", compiled)
            if fits_budget(sol.choice):
                status = sol.status
                if abs(preds[sol.choice] / max(compiled, 1) - 1.0) <= 0.1:
                    break
                # the model missed this plan by more than 10 %: refit on it and re-solve; a
                # cheaper plan the refit model finds within the budget replaces it
            elif not mode_bytes:
                slack += compiled - budget_bytes
        else:
            it = max_iterations
    fits = [c for c in tried if fits_budget(c)]
    if not fits:
        if budget_bytes >= floor:
            least_bytes()
        canonical = reachable()
        fits = [c for c in tried if fits_budget(c)]
    if fits:
        choice = min(fits, key=lambda c: (cost_of(c), tried[c], c))
        choices = []
        for i in sorted(choice, key=lambda i: raw[i][0][0]):
            cover, o, kb, wb, cst = raw[i]
            label = labels[cover[0]] if len(cover) == 1 else \
                f"{labels[cover[0]]}..{labels[cover[-1]]}"
            full = sum(keep[v][0] for v in cover)
            k = kind_of(o)
            extra = cst - (fence if k in ("dots", "recompute", "segment") else 0.0)
            if o == "store":
                why = "fits: keeping its residuals costs no recompute"
            elif k == "fewbit":
                why = (f"{o[len(k):]}-bit activation codes drop {(full - kb) / 2**20:.3f} MiB "
                       f"(approximate gradient)")
            elif k == "offload":
                why = (f"residuals ({(full - kb) / 2**20:.3f} MiB) kept in host memory, "
                       f"copied back for the backward pass")
            elif k == "rows":
                why = (f"row-tiled into {o[len(k):]} tiles: recompute {extra / 1e6:.1f} MFLOP "
                       f"to drop {(full - kb) / 2**20:.3f} MiB (exact)")
            else:
                why = (f"recompute {extra / 1e6:.1f} MFLOP to drop "
                       f"{(full - kb) / 2**20:.3f} MiB")
            choices.append(UnitChoice(label, k if k in ("fewbit", "rows") else o, int(kb),
                                      int(wb), float(extra), why,
                                      bits=int(o[len(k):]) if k == "fewbit" else None,
                                      rows=int(o[len(k):]) if k == "rows" else None))
        return MemoryPlan(step=build(choice), choices=tuple(choices),
                          budget_bytes=budget_bytes, default_bytes=default_bytes,
                          predicted_bytes=preds[choice], compiled_bytes=tried[choice],
                          predicted_time=1.0 + cost_of(choice) / max(3.0 * total_flops, 1.0),
                          selective=selective,
                          solver_status=status if sol is not None else "OPTIMAL",
                          solver_gap=sol.gap if sol is not None and sol.choice is not None
                          else 0.0, iterations=max(it, 1), approximate=any(
                              c.bits is not None for c in choices), notes=tuple(notes),
                          target=target)
    smallest = None
    for c in sorted(canonical, key=lambda c: tried[c]):
        if smallest is not None and tried[c] >= smallest:
            break
        both = max(tried[c], grad_total(c))
        smallest = both if smallest is None else min(smallest, both)
    big = max(range(n), key=lambda i: keep[i][0]) if n else None
    dominant = {"arguments (parameters, batch, state)": cm0.argument_bytes,
                "outputs (loss, gradients)": cm0.output_bytes}
    dominant["temporaries of that plan"] = max(0, smallest - floor)
    if big is not None:
        dominant[f"largest unit working set ({units[big].label}; part of the temporaries)"] \
            = keep[big][0]
    parts = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in
                      sorted(dominant.items(), key=lambda kv: -kv[1]))
    lead = (f"the step's arguments (parameters, batch, state) take "
            f"{cm0.argument_bytes / mib:.2f} MiB and its outputs (loss, gradients) "
            f"{cm0.output_bytes / mib:.2f} MiB before any activation is kept; "
            if budget_bytes < floor else "")
    if not n:
        lead += ("no layer boundary was found in the loss (no Flax Linen method call and no "
                 "jaxmem.planner.tag(x, name)), so nothing can be recomputed: tag the outputs "
                 "of its layers with jaxmem.planner.tag; ")
    raise BudgetError(
        f"plan: budget {budget_bytes / mib:.2f} MiB cannot be met; {lead}the smallest "
        f"compiled total reached is {smallest / mib:.2f} MiB (a budget plan meets; default "
        f"{default_bytes / mib:.2f} MiB; {n} units, {len(tried)} plans compiled); dominated "
        f"by {parts}" + (" (arguments and outputs)" if budget_bytes < floor else ""),
        smallest, dominant, finer_units=budget_bytes >= floor and len(
            _trace.choose_units(tr, finer=_finer + 1)) > n)
