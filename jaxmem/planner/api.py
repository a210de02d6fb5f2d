"""``plan``: fit the gradient step of a loss into a memory budget (see docs/plan.md).

Stages: baseline (the untouched step compiled, the OLLA order tried, the scope variant
chosen) -> unit profile (:mod:`jaxmem.planner.candidates`) -> candidates per option kind ->
search (:class:`jaxmem.planner.search.Search` over a :class:`jaxmem.planner.model.ByteModel`,
compiling with :class:`jaxmem.planner.steps.StepCompiler`) -> explain
(:mod:`jaxmem.planner.explain`: a :class:`MemoryPlan` or a :class:`BudgetError`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxmem.planner import candidates as _cand
from jaxmem.planner import explain as _explain
from jaxmem.planner import trace as _trace
from jaxmem.planner.budget import budget_spec, parse_budget
from jaxmem.planner.model import ByteModel
from jaxmem.planner.result import BudgetError, MemoryPlan, UnitChoice
from jaxmem.planner.search import Search
from jaxmem.planner.steps import StepCompiler, compiled_total
from jaxmem.planner.steps import make_step as _make_step
from jaxmem.planner.steps import ordered_step as _ordered_step

__all__ = ["BudgetError", "MemoryPlan", "UnitChoice", "budget_spec", "conversion_time",
           "parse_budget", "plan"]

#: the OLLA order alone is tried for budgets of at least this fraction of the default (the
#: order's reductions measured here are <= 20 %: GPT -19.8 %, ResNet-50 0 %)
_ORDER_MIN_FRACTION = 0.6
#: when no plan fits, units are split at their layers' children up to this many times
_MAX_FINER = 1
#: variants planned at most (plain, scope, scope with ResNet block outputs kept)
_MAX_VARIANTS = 3


@dataclasses.dataclass(frozen=True)
class _Settings:
    """:func:`plan`'s keyword arguments other than the budget."""

    allow_approximate: bool = False
    time_limit: float = 10.0
    max_iterations: int = 6
    fence_cost: float = 0.1
    approx_cost: float = 0.01
    offload_bandwidth: float = 25e9
    offload_flops: float = 50e12
    order: bool = True
    target: str = "cpu"
    logits_chunk: int | None = 1024
    attention_chunk: int | None = 512
    mlp_chunk: int | None = None

    def checked(self, step, example_args, budget) -> _Settings:
        """These settings with ``target`` normalised; a bad value (``budget`` included)
        raises naming it, before anything is compiled."""
        from jaxmem.measure.target import check_target

        if not callable(step):
            raise TypeError(f"plan: step must be callable, got {type(step).__name__}")
        if not example_args:
            raise ValueError("plan: give example arguments, e.g. plan(loss, params, batch, ...)")
        if not isinstance(self.allow_approximate, bool):
            raise TypeError(f"plan: allow_approximate must be True or False, got "
                            f"{self.allow_approximate!r}")
        for name, v in (("approx_cost", self.approx_cost), ("time_limit", self.time_limit),
                        ("max_iterations", self.max_iterations),
                        ("fence_cost", self.fence_cost)):
            _check_number(name, v)
        budget_spec(budget)
        self.check_chunks()
        return dataclasses.replace(self, target=check_target(self.target, 1, "plan"))

    def check_chunks(self) -> None:
        """Raise ``ValueError`` naming a chunk option that is not ``None`` or an int >= 1."""
        for name, what in (("logits_chunk", "rows per chunk of a language-model head"),
                           ("attention_chunk", "query rows per chunk of an attention"),
                           ("mlp_chunk", "rows per chunk of a two-layer perceptron")):
            n = getattr(self, name)
            if n is not None and (type(n) is not int or n < 1):
                raise ValueError(f"plan: {name} must be None or an int >= 1 ({what}), got "
                                 f"{n!r}")


def _check_number(name: str, v: Any) -> None:
    want = {"approx_cost": "a number >= 0", "fence_cost": "a number >= 0",
            "time_limit": "a positive number of seconds", "max_iterations": "an int >= 1"}[name]
    if name == "max_iterations":
        ok = isinstance(v, int) and v >= 1
    else:
        ok = isinstance(v, (int, float)) and (v > 0 if name == "time_limit" else v >= 0)
    if not ok:
        raise ValueError(f"plan: {name} must be {want}, got {v!r}")


def plan(step: Callable[..., Any], *example_args: Any, budget: Any,
         allow_approximate: bool = False, time_limit: float = 10.0,
         max_iterations: int = 6, fence_cost: float = 0.1,
         approx_cost: float = 0.01, offload_bandwidth: float = 25e9,
         offload_flops: float = 50e12, order: bool = True,
         target: str = "cpu", logits_chunk: int | None = 1024,
         attention_chunk: int | None = 512, mlp_chunk: int | None = None) -> MemoryPlan:
    """Fit ``jax.value_and_grad(step)`` (gradient w.r.t. the first argument) into ``budget``.

    ``step(params, *batch) -> scalar loss`` may call Flax Linen modules (their outputs become
    the units; :func:`jaxmem.planner.tag` marks units in other code). Each unit is stored,
    run with ``jax.checkpoint`` under ``dots_saveable`` (``dots``) or ``nothing_saveable``
    (``recompute``), or joined with its neighbours into one recomputed ``segment``. CP-SAT
    picks the options of least predicted time

        time = 1 + recomputed FLOPs / (3 * step FLOPs) + fence_cost * (checkpointed items)

    subject to predicted bytes <= budget; every chosen plan is compiled, the byte model
    refitted on all compiled plans and the problem re-solved while the compiled bytes exceed
    ``budget``; when no plan fits under the model, the plan of least predicted bytes is
    compiled as well.

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
        untouched step's time (each runs its backward behind a ``lax.cond`` fence). On a GPU
        target items run as plain ``jax.checkpoint`` (no fence, no cost) unless a plan
        compiled that way exceeds the budget and compiles smaller fenced.
      approx_cost: predicted cost of a unit stored with few-bit codes, as a fraction of a step
        at 1 bit (``(5 - bits) / 4`` of it at ``bits``): the solver prefers exact storage,
        then more bits, then recomputation costing more than this.
      offload_bandwidth: host <-> device bytes per second for the ``offload`` option (offered
        where the backend has device memory apart from host memory: GPU, TPU); its cost is
        ``2 * bytes / offload_bandwidth`` over a step of ``3 * FLOPs / offload_flops`` seconds.
      offload_flops: the device's sustained FLOP/s for that ratio.
      order: for budgets of at least 0.6 of the default, first try the untouched step in an
        OLLA order (:func:`jaxmem.planner.order.ordered`); when that alone fits it is
        returned: ``plan.step`` is then a ``jax.custom_vjp`` function whose gradient runs the
        ordered step, and :meth:`MemoryPlan.value_and_grad` is the ordered step itself.
      target: whose compiled bytes the plan is made and checked against: ``"cpu"`` (default)
        or a GPU (``"h100"``, ``"h100_pcie"``, ``"h200"``, ``"a100"``, ``"b200"``): XLA:GPU's
        plan compiled here without a GPU (:func:`jaxmem.measure.compiled_memory`; no
        autotuning). There recomputed units run as plain ``jax.checkpoint`` (unfenced) when
        that fits the budget, fenced only where needed and smaller, and host offload is
        offered.
      logits_chunk: a language-model head in the loss (a product ``h W`` wider than ``h``
        feeding a softmax-like loss per row, however it is spelled) may be computed this many
        rows at a time, as ``jaxmem.transform(step, logits_chunk=...)`` computes it: no
        ``tokens x vocab`` array is kept; the head's product runs again in the backward pass
        (counted in ``predicted_time``). Used where the step compiles at least 1 % smaller
        so; ``None``: never.
      attention_chunk, mlp_chunk: the conversion's options of those names, for a loss
        planned under ``jaxmem.scope()`` (``jaxmem.transform``'s ``attention_chunk`` /
        ``mlp_chunk``): an attention with more query rows, or a transformer MLP with more
        rows, runs both passes that many rows at a time, so a recomputed block's
        working set is that much smaller (exact). A chunked MLP keeps its input instead of
        its hidden activation and recomputes its first product in its backward pass (in
        ``conversion_time`` where stored). Defaults: ``512`` and ``None`` (never).

    Returns:
      A :class:`MemoryPlan`: ``plan.step`` takes ``step``'s positional and keyword arguments
      and returns its values; ``jax.value_and_grad(plan.step)`` and ``jax.grad(plan.step)``
      compile within the budget on ``target`` for arguments of the example's shapes.
      ``plan.predicted_time`` prices the plan's choices; a plan traced under jaxmem's
      conversion (``plan.selective``) prices what that conversion runs by itself apart, as
      ``plan.conversion_time`` (:func:`conversion_time`; the sum:
      ``plan.predicted_time_total``).

    The loss is planned traced plainly or under ``jaxmem.scope()``, each with its LM head
    whole or chunked (``logits_chunk``), whichever untouched step compiles smallest; when no
    plan of that variant fits, the best of the other selectivity is planned too.

    Raises:
      BudgetError: no compiled plan fits; ``smallest_bytes`` is a budget this function meets
        for the same step and arguments.
      TypeError / ValueError: a bad argument (``budget``: see :func:`budget_spec`).

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
    return _plan_finer(step, example_args, budget, _Settings(
        allow_approximate, time_limit, max_iterations, fence_cost, approx_cost,
        offload_bandwidth, offload_flops, order, target, logits_chunk, attention_chunk,
        mlp_chunk))


def _plan_finer(step, example_args, budget, settings: _Settings) -> MemoryPlan:
    """:func:`_plan` at the default cut into units, then (while refused and a finer cut
    exists) once more finely; when every cut of the variant :func:`_variant` picked is
    refused, the same for the next variant (:func:`_next_variant`: a step that compiles
    smaller under ``jaxmem.scope()`` can still recompute to less without it, or with the
    scope's ResNet block outputs kept). A plan found for such a later variant that carries
    the conversion's own FLOPs (``conversion_time``) is weighed against the next variant's
    plan too, and the one of least ``predicted_time_total`` returned: the variants are tried
    fewest untouched bytes first, which after a refusal can be a converted step that costs
    more (ResNet-50 b4 at 50 % on the H100 plan: the scope with block outputs kept 1.13x +
    0.17, unconverted 1.20x). The refusal of least ``smallest_bytes`` is raised."""
    err, found = None, None
    cache: dict[str, Any] = {}   # default compile and variant choice, shared by the retry
    for attempt in range(_MAX_VARIANTS):
        for finer in range(_MAX_FINER + 1):
            s = settings if finer == 0 and attempt == 0 else dataclasses.replace(
                settings, order=False)
            try:
                p = _plan(step, tuple(example_args), budget, s, finer, cache)
            except BudgetError as e:
                if err is None or e.smallest_bytes < err.smallest_bytes:
                    err = e
                if not e.finer_units:
                    break
                continue
            if found is None or p.predicted_time_total < found.predicted_time_total:
                found = p
            break
        if found is not None and (attempt == 0 or not found.conversion_time
                                  or found is not p):
            return found
        nxt = _next_variant(step, tuple(example_args), settings, cache)
        if nxt is None:
            break
        cache["variant"] = nxt
    if found is not None:
        return found
    raise err


def _glue_scope(residual_adds: bool = True, attention_chunk: int | None = 512,
                mlp_chunk: int | None = None):
    """The conversion a plan may trace the loss under: each outermost Linen call runs as
    ``jaxmem.linen.convert(model, residual_adds=..., attention_chunk=..., mlp_chunk=...)``
    would run it (exact options)."""
    from jaxmem._glue import options as _options
    from jaxmem.linen import scope_options

    return scope_options(_options.Options(residual_adds=residual_adds,
                                          attention_chunk=attention_chunk,
                                          mlp_chunk=mlp_chunk), label="jaxmem.plan")


def _scope_factory(s: _Settings, residual_adds: bool = True):
    """:func:`_glue_scope` with ``s``'s chunk options; the plain default where they are
    the defaults (one factory, so traces and compiles are shared)."""
    if residual_adds and s.attention_chunk == 512 and s.mlp_chunk is None:
        return _glue_scope
    return functools.partial(_glue_scope, residual_adds=residual_adds,
                             attention_chunk=s.attention_chunk, mlp_chunk=s.mlp_chunk)


def _live_peak(step, args, target):
    """What is live at the peak of ``value_and_grad(step)`` compiled for ``target``."""
    from jaxmem.measure import live_peak

    return live_peak(jax.value_and_grad(step), *args, target=target)


def _baseline(step, args, target, cache):
    """Compiled memory of the untouched ``value_and_grad(step)`` (kept in ``cache``)."""
    if "default" not in cache:
        from jaxmem.measure import compiled_memory
        cache["default"] = compiled_memory(jax.value_and_grad(step), *args, target=target)
    return cache["default"]


def _untouched_bytes(step, args, cm0, target, cache) -> int:
    """Compiled total of the untouched step as users run it: the larger of
    ``value_and_grad(step)`` (``cm0``) and ``grad(step)`` (kept in ``cache``)."""
    if "untouched" not in cache:
        cache["untouched"] = max(cm0.total_bytes,
                                 compiled_total(jax.grad(step), args, target))
    return cache["untouched"]


def _untouched_plan(step, budget_bytes, untouched, cm0, s: _Settings) -> MemoryPlan:
    """The loss itself as the plan: a budget the untouched step already meets (the planner's
    own step, cut into units, may compile to a few more bytes than the loss as written)."""
    why = (f"the untouched step fits: {untouched:,} <= {budget_bytes:,} bytes "
           "(value_and_grad and grad)")
    return MemoryPlan(
        step=step, choices=(UnitChoice("(step)", "store", 0, 0, 0.0, why),),
        budget_bytes=budget_bytes, default_bytes=cm0.total_bytes, predicted_bytes=untouched,
        compiled_bytes=cm0.total_bytes, predicted_time=1.0, selective=False,
        solver_status="OPTIMAL", solver_gap=0.0, iterations=1, notes=(why,), target=s.target,
        traced_time=1.0)


def _order_plan(step, args, budget_bytes, cm0, s: _Settings):
    """``(order result, MemoryPlan or None)``: the untouched step in an OLLA order, returned
    as the plan when it and the gradient of the step that runs it fit."""
    from jaxmem.planner.order import ordered

    res = ordered(jax.value_and_grad(step), *args, time_limit=s.time_limit,
                  min_reduction=0.01, target=s.target)
    if not (res.applied and res.compiled_bytes <= budget_bytes):
        return res, None
    # the returned step's own gradient must run the order: compile what users call
    o_step = _ordered_step(step, res.fn, args)
    o_bytes = max(compiled_total(jax.value_and_grad(o_step), args, s.target),
                  res.compiled_bytes)
    if o_bytes <= budget_bytes:
        o_bytes = max(o_bytes, compiled_total(jax.grad(o_step), args, s.target))
    if o_bytes > budget_bytes:
        return res, None
    return res, MemoryPlan(
        step=o_step, choices=(UnitChoice("(step)", "store", 0, 0, 0.0,
                                         f"OLLA order: {res.why}"),),
        budget_bytes=budget_bytes, default_bytes=cm0.total_bytes,
        predicted_bytes=res.compiled_bytes, compiled_bytes=o_bytes, predicted_time=1.0,
        selective=False, solver_status="OPTIMAL", solver_gap=0.0, iterations=1,
        notes=(f"the OLLA order alone fits: {res.why}",), order=res, target=s.target)


@dataclasses.dataclass(frozen=True)
class _Variant:
    """How the loss is traced for planning: under ``jaxmem.scope()`` (``selective``, its
    ``factory``; ``residual_adds``: the scope's option of that name) or not, and as ``step``
    -- the loss itself, or (``chunked``) the loss with its LM head computed ``logits_chunk``
    rows at a time (:func:`_head_chunked`); ``bytes`` its untouched step's compiled total."""

    selective: bool
    factory: Callable[[], Any] | None
    bytes: int
    step: Callable[..., Any]
    chunked: bool = False
    residual_adds: bool = True


def _head_chunked(step, args, chunk, factory):
    """``step`` with its language-model heads computed ``chunk`` rows at a time
    (``jaxmem.transform(step, logits_chunk=chunk)``, nothing else converted), or ``None``
    when the transform chunks no head of it (traced under ``factory``'s scope, if any)."""
    import contextlib

    from jaxmem.transform import transform
    from jaxmem.transform.options import SWITCHES

    chunked = transform(step, logits_chunk=chunk, **dict.fromkeys(SWITCHES, False))
    try:
        with factory() if factory else contextlib.nullcontext():
            rows = chunked.report(*args).by_kind("logits")
    except Exception:  # noqa: BLE001 - a loss the transform cannot trace is planned as written
        return None
    return chunked if any(r.converted for r in rows) else None


def _variant(step, args, s: _Settings, cache) -> _Variant | None:
    """The loss traced plainly or under ``jaxmem.scope()``, its LM head whole or in chunks
    (``s.logits_chunk``; only where that compiles at least 1 % smaller than the same trace
    with the head whole): the variant whose untouched step compiles to the fewest bytes (a tie
    goes to the scope when few-bit codes may be offered: they need it; then to the whole
    head). The best variant of the other selectivity, where one traces, is kept in
    ``cache['pending']`` for :func:`_next_variant`."""
    if "variant" not in cache:
        found: list[_Variant] = []
        for sel in (False, True):
            found += _traced_variants(step, args, s, sel)
        found.sort(key=lambda v: (v.bytes, not (v.selective and s.allow_approximate),
                                  v.chunked))
        cache["variant"] = found[0] if found else None
        other = [v for v in found[1:] if v.selective != found[0].selective]
        cache["pending"] = other[:1]
    return cache["variant"]


def _traced_variants(step, args, s: _Settings, sel: bool,
                     residual_adds: bool = True) -> list[_Variant]:
    """The variants of one tracing (under ``jaxmem.scope()`` with ``residual_adds`` when
    ``sel``, else plain): the loss as written and, where that compiles at least 1 % smaller,
    with its LM head in ``s.logits_chunk``-row chunks; none when the loss does not trace
    so."""
    found: list[_Variant] = []
    whole = None
    factory = None if not sel else _scope_factory(s, residual_adds)
    for chunked in (False, True):
        if chunked and (whole is None or s.logits_chunk is None):
            continue
        p_step = _head_chunked(step, args, s.logits_chunk, factory) if chunked else step
        if p_step is None:
            continue
        s_step = _make_step(p_step, factory, (), (), {})
        try:
            b = compiled_total(jax.value_and_grad(s_step), args, s.target)
        except Exception:  # noqa: BLE001, S112 - a scope that cannot trace is not used
            continue
        if not chunked:
            whole = b
        elif b > 0.99 * whole:
            continue
        found.append(_Variant(sel, factory, b, p_step, chunked, residual_adds))
    return found


def _next_variant(step, args, s: _Settings, cache) -> _Variant | None:
    """The variant to plan after ``cache['variant']`` was refused, fewest untouched bytes
    first, or ``None``: the best of the other selectivity (from :func:`_variant`) and, after
    a refused scope with ``residual_adds`` (jaxmem's default), the same scope with
    ``residual_adds=False``. Under the default a ResNet block's output is never kept: the
    next block's first convolution recomputes it from the add's inputs, so a recomputed
    unit's inputs are those inputs (two or three maps), where with the block outputs kept it
    is the block output alone -- recomputation then reaches fewer bytes (ResNet-50 w 0.125,
    32², batch 64, H100 plan: five nested segments 43.95 MiB against 75.99 under the default
    scope and 49.78 without one). Traced and compiled only here (one untouched compile), and
    kept only where it compiles to other bytes than the refused scope (no residual adds: the
    same program)."""
    pending = cache.setdefault("pending", [])
    v = cache.get("variant")
    if v is not None and v.selective and v.residual_adds:
        twin = _traced_variants(step, args, s, True, residual_adds=False)
        pending += [t for t in twin if t.chunked == v.chunked and t.bytes != v.bytes]
    pending.sort(key=lambda t: t.bytes)
    return pending.pop(0) if pending else None


def _candidates(step, args, factory, prof, selective, fence, s: _Settings):
    """``(candidates, notes)``: every option kind offered for the profiled units."""
    from jaxmem.planner import offload as _offload

    cands, notes = _cand.exact_candidates(prof, fence), []
    if s.target != "cpu":
        # a unit with its costly children stored and the rest recomputed: on XLA:CPU each
        # recomputed run would sit behind its own lax.cond fence (fence_cost each)
        cands += _cand.partial_candidates(prof, fence)
    if s.allow_approximate:
        if selective:
            cands += _cand.fewbit_candidates(step, args, factory, prof, s.approx_cost)
        else:
            notes.append("few-bit not offered: jaxmem's conversion did not lower this step")
    cands += _cand.row_candidates(step, args, factory, prof)
    # XLA:GPU plans pinned_host residuals apart from device memory
    can, why_not = _offload.offload_available() if s.target == "cpu" else (True, "")
    if can:
        cands += _cand.offload_candidates(prof, s.offload_bandwidth, s.offload_flops)
    else:
        notes.append(f"host offload not offered: {why_not}")
    return cands, notes


def _plan(step, args, budget, s: _Settings, finer: int, cache: dict) -> MemoryPlan:
    """One search at ``finer`` levels below the default cut into units; ``cache`` keeps the
    untouched step's compile and the variant choice for a later call."""
    s = s.checked(step, args, budget)
    cm0 = _baseline(step, args, s.target, cache)
    budget_bytes = parse_budget(budget, cm0.total_bytes)
    floor = cm0.argument_bytes + cm0.output_bytes - cm0.alias_bytes
    if budget_bytes >= cm0.total_bytes:
        untouched = _untouched_bytes(step, args, cm0, s.target, cache)
        if untouched <= budget_bytes:
            return _untouched_plan(step, budget_bytes, untouched, cm0, s)
    order_res, notes = None, []
    if s.order and max(floor, _ORDER_MIN_FRACTION * cm0.total_bytes) <= budget_bytes \
            < cm0.total_bytes:
        order_res, done = _order_plan(step, args, budget_bytes, cm0, s)
        if done is not None:
            return done
        notes.append(f"OLLA order alone does not fit: {order_res.why}")
    v = _variant(step, args, s, cache)
    selective, factory, p_step = v.selective, v.factory, v.step
    tr = _trace.trace(p_step, args, factory() if factory else None)
    prof = _cand.profile_units(tr, finer)
    fence_flops = s.fence_cost * 3.0 * max(prof.total_flops, 1.0)
    # on a GPU target a unit runs as plain jax.checkpoint unless its plan needs the fence
    # (StepCompiler decides per plan and adds the fence's cost to the plans it fences)
    fence = fence_flops if s.target == "cpu" else 0.0
    cands, more = _candidates(p_step, args, factory, prof, selective, fence, s)
    model = ByteModel(cands, prof.stored, v.bytes)
    compiler = StepCompiler(p_step, factory, prof.cut_labels, prof.labels, cands, args, s.target,
                            budget=budget_bytes, fence_flops=fence_flops)
    search = Search(model, compiler, s.time_limit)
    res = search.run(budget_bytes, floor, s.max_iterations)
    notes += more + compiler.notes
    if res.choice is None:
        finer_units = len(_trace.choose_units(tr, finer=finer + 1)) > len(prof.units)
        # the untouched step is a plan too: it meets any budget of at least its own bytes
        untouched = _untouched_bytes(step, args, cm0, s.target, cache)
        smallest = untouched if res.smallest is None else min(res.smallest, untouched)
        smallest_step = step if smallest == untouched else compiler.build(res.smallest_choice)
        raise _explain.refusal(budget_bytes, smallest, cm0, prof.labels, prof.stored,
                               len(search.tried), finer_units,
                               peak_of=functools.partial(_live_peak, smallest_step, args,
                                                         s.target))
    choices = _explain.unit_choices(model, res.choice, prof.labels, fence)
    if s.target != "cpu" and compiler.checkpointed(res.choice):
        notes.append(f"{s.target} plan: this plan's recomputed units run "
                     + ("behind the lax.cond fence (smaller than plain jax.checkpoint here)"
                        if compiler.fence_of(res.choice) else
                        "as plain jax.checkpoint (no lax.cond fence)"))
    if selective and not v.residual_adds:
        notes.append("traced under jaxmem.scope() with residual_adds=False: ResNet block "
                     "outputs are kept (a recomputed unit keeps its block's output, not the "
                     "add's inputs); the scope with its default options was refused")
    conversion = 0.0
    if selective:
        conversion = _conversion_time(v.step, args, factory)
        notes.append(f"conversion_time {conversion:+.3f}: the FLOPs jaxmem's conversion runs "
                     "by itself (attention inputs and weights, ResNet block outputs, bottleneck "
                     "expansions recomputed in its layers' backward passes; masks packed), as "
                     "a fraction of a step, apart from predicted_time (the plan's own choices)")
    head_flops = _head_recompute(step, tr, args, factory) if v.chunked else 0.0
    if selective and (s.attention_chunk != 512 or s.mlp_chunk is not None):
        notes.append(f"traced under jaxmem.scope() with attention_chunk={s.attention_chunk}, "
                     f"mlp_chunk={s.mlp_chunk}: attentions and MLPs with more rows run both "
                     "passes that many rows at a time")
    if v.chunked:
        notes.append(f"the loss's language-model head runs {s.logits_chunk} rows at a time "
                     "(jaxmem.transform's logits_chunk): no tokens x vocab array is kept, "
                     "its product runs again in the backward pass (in predicted time: "
                     f"+{head_flops / max(3.0 * prof.total_flops, 1.0):.3f})")
    built = compiler.build(res.choice)
    return MemoryPlan(
        step=built, choices=choices, budget_bytes=budget_bytes,
        default_bytes=cm0.total_bytes, predicted_bytes=search.predicted[res.choice],
        compiled_bytes=search.tried[res.choice],
        predicted_time=1.0 + (search.cost(res.choice) + head_flops)
        / max(3.0 * prof.total_flops, 1.0),
        selective=selective, solver_status=res.status, solver_gap=res.gap,
        iterations=res.iterations, approximate=any(c.bits is not None for c in choices),
        notes=tuple(notes), order=order_res, target=s.target,
        logits_chunk=s.logits_chunk if v.chunked else None,
        residual_adds=v.residual_adds if selective else None, conversion_time=conversion,
        traced_time=_traced_time(built, step, args))


def _step_flops(fn, args) -> float:
    """FLOPs of ``value_and_grad(fn)``'s jaxpr, repeated identical equations counted once
    (:func:`jaxmem.planner.trace.flops_of`)."""
    jaxpr = jax.make_jaxpr(jax.value_and_grad(fn))(*args).jaxpr
    return _trace.flops_of(jaxpr, merge_identical=True)[0]


def _traced_time(planned, step, args) -> float:
    """FLOPs of ``value_and_grad(planned)``'s jaxpr over ``value_and_grad(step)``'s."""
    return _step_flops(planned, args) / max(_step_flops(step, args), 1.0)


def conversion_time(loss: Callable[..., Any], *args: Any, residual_adds: bool = True,
                    logits_chunk: int | None = None, attention_chunk: int | None = 512,
                    mlp_chunk: int | None = None) -> float:
    """The FLOPs that jaxmem's conversion adds to ``loss``'s ``value_and_grad`` step by itself
    (each Linen call run as ``jaxmem.linen.convert(model, residual_adds=residual_adds)`` runs
    it: what a selective plan traces), as a fraction of the untouched step's::

        (F(value_and_grad(scoped)) - F(value_and_grad(loss))) / (3 F(loss))

    ``F`` counts the traced jaxpr (:func:`jaxmem.planner.trace.flops_of`: ``2 m n k`` per
    matmul or convolution, one per element of every other equation; an equation repeating an
    earlier one on the same inputs counted once, as XLA's CSE runs it), so it prices the
    recomputations inside converted layers' backward passes (attention inputs and weights,
    ResNet block outputs, bottleneck expansions) and mask packing; it is negative where the
    converted step traces fewer FLOPs. With ``logits_chunk`` both steps compute the LM
    head in chunks (as a chunked plan does; the chunks' own recomputation is not the
    conversion's). A plan under the scope reports this as ``MemoryPlan.conversion_time``.

    Args:
        loss: a scalar loss of Flax Linen models, as :func:`plan` takes it.
        *args: example arguments (only traced, nothing runs).
        residual_adds: the conversion's option of that name.
        logits_chunk: rows per chunk of the LM head in both steps, or ``None``.
        attention_chunk, mlp_chunk: the conversion's options of those names.

    Returns:
        The added FLOPs over ``3 F(loss)``, a float (``0.25``: a quarter of a step more).

    Example:
        >>> import jax, flax.linen as nn
        >>> from jaxmem.planner import conversion_time
        >>> m = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])
        >>> x = jax.random.normal(jax.random.key(1), (8, 32))
        >>> p = m.init(jax.random.key(0), x)
        >>> t = conversion_time(lambda p, x: m.apply(p, x).sum(), p, x)
        >>> 0.0 < t < 0.2   # the 1-bit ReLU mask packed and unpacked: elementwise work
        True
    """
    chunks = _Settings(attention_chunk=attention_chunk, mlp_chunk=mlp_chunk)
    chunks.check_chunks()
    factory = _scope_factory(chunks, residual_adds)
    step = loss
    if logits_chunk is not None:
        step = _head_chunked(loss, args, logits_chunk, factory) or loss
    return _conversion_time(step, args, factory)


def _conversion_time(step, args, factory) -> float:
    """:func:`conversion_time` of ``step`` under ``factory``'s scope."""
    scoped = _make_step(step, factory, (), (), {})
    vg = [_step_flops(fn, args) for fn in (scoped, step)]
    fwd = _trace.flops_of(jax.make_jaxpr(step)(*args).jaxpr)[0]
    return (vg[0] - vg[1]) / max(3.0 * fwd, 1.0)


def _head_recompute(step, tr, args, factory) -> float:
    """FLOPs the chunked LM head of ``tr`` (the traced chunked step) runs again in the
    backward pass: its ``jax.checkpoint`` bodies' FLOPs beyond the loss's own."""
    base = _trace.trace(step, args, factory() if factory else None)
    return max(0.0, _trace.recomputed_flops(tr.closed.jaxpr)
               - _trace.recomputed_flops(base.closed.jaxpr))
