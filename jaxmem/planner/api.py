"""``plan``: fit the gradient step of a loss into a memory budget (see docs/plan.md)."""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core

from jaxmem.planner import solve as _solve
from jaxmem.planner import trace as _trace

__all__ = ["BudgetError", "MemoryPlan", "UnitChoice", "parse_budget", "plan"]

_DEBUG = bool(__import__("os").environ.get("JAXMEM_PLAN_DEBUG"))
OPTIONS = ("store", "dots", "recompute")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


class BudgetError(ValueError):
    """The budget cannot be met; ``smallest_bytes`` is the least compiled total reached."""

    def __init__(self, msg: str, smallest_bytes: int, dominant: dict[str, int]):
        super().__init__(msg)
        self.smallest_bytes = smallest_bytes
        self.dominant = dominant


def parse_budget(budget: Any, default_bytes: int | None = None) -> int:
    """Bytes from an int (bytes), a string ``"512MiB"`` / ``"1.5GB"`` / ``"4096"``, or a float
    in (0, 1] (fraction of ``default_bytes``, the untouched step's compiled bytes)."""
    if isinstance(budget, bool):
        raise TypeError(f"plan: budget must be int bytes, a size string or a float fraction "
                        f"in (0, 1], got {budget!r}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"plan: budget must be > 0 bytes, got {budget}")
        return int(budget)
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(f"plan: a float budget is a fraction in (0, 1] of the default "
                             f"step's compiled bytes, got {budget}")
        if default_bytes is None:
            raise ValueError("plan: a fraction budget needs the default compiled bytes")
        return int(budget * default_bytes)
    if isinstance(budget, str):
        mt = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", budget)
        if not mt or mt.group(2).lower() not in _UNITS | {"": 1}:
            raise ValueError(f"plan: budget string {budget!r} is not a size like '512MiB', "
                             f"'1.5GB' or '4096' (units: B, KB, MB, GB, KiB, MiB, GiB)")
        val = int(float(mt.group(1)) * _UNITS.get(mt.group(2).lower(), 1))
        if val <= 0:
            raise ValueError(f"plan: budget must be > 0 bytes, got {budget!r}")
        return val
    raise TypeError(f"plan: budget must be int bytes, a size string or a float fraction in "
                    f"(0, 1], got {type(budget).__name__} {budget!r}")


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """One unit's option: ``store`` (keep its residuals), ``dots`` (keep matmul/conv outputs,
    recompute the rest), ``recompute`` (keep its inputs only); ``bits`` is ``None`` (exact)."""

    label: str
    option: str
    keep_bytes: int
    work_bytes: int
    recompute_flops: float
    why: str
    bits: int | None = None


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize if hasattr(aval, "shape") \
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


def _compiled_total(fn, args) -> int:
    from jaxmem.measure import compiled_memory
    return compiled_memory(jax.value_and_grad(fn), *args).total_bytes


@dataclasses.dataclass
class MemoryPlan:
    """What :func:`plan` chose. ``step`` has the loss's signature and values; its gradients
    are the untouched loss's (exact options only)."""

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

    @property
    def prediction_error(self) -> float:
        """``predicted / compiled - 1``."""
        return self.predicted_bytes / max(self.compiled_bytes, 1) - 1.0

    @property
    def why(self) -> dict[str, str]:
        return {c.label: c.why for c in self.choices}

    def to_dict(self) -> dict[str, Any]:
        keys = ("budget_bytes", "default_bytes", "predicted_bytes", "compiled_bytes",
                "predicted_time", "selective", "solver_status", "solver_gap", "iterations")
        d = {k: getattr(self, k) for k in keys}
        d["prediction_error"] = self.prediction_error
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
            t.add_row(c.label, c.option, f"{c.keep_bytes / mib:.3f}",
                      f"{c.recompute_flops / 1e6:.1f}", c.why)
        return t

    def __str__(self) -> str:
        mib = 2.0**20
        head = (f"MemoryPlan: compiled {self.compiled_bytes / mib:.2f} MiB <= budget "
                f"{self.budget_bytes / mib:.2f} MiB (default {self.default_bytes / mib:.2f}, "
                f"predicted {self.predicted_bytes / mib:.2f}), time x{self.predicted_time:.2f}")
        lines = [head]
        lines += [f"  {c.label:<24} {c.option:<9} {c.why}" for c in self.choices]
        return "\n".join(lines)


def _make_step(fn, example_args, scope_factory, options: dict[str, str]):
    """The loss evaluated unit by unit under ``options`` (re-traced for new shapes)."""
    cache: dict[Any, tuple[Any, list[_trace.Unit]]] = {}

    def step(*args):
        flat, tree = jax.tree_util.tree_flatten(tuple(args))
        key = (tree, tuple((tuple(np.shape(a)), str(jax.numpy.result_type(a))) for a in flat))
        if key not in cache:
            abstract = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a)), args)
            tr = _trace.trace(fn, abstract, scope_factory() if scope_factory else None)
            cache[key] = (tr, _trace.choose_units(tr))
        tr, units = cache[key]
        outs = _trace.run_chunks(tr.closed, units, options, flat)
        return jax.tree_util.tree_unflatten(tr.out_tree, outs)

    step.__name__ = getattr(fn, "__name__", "step") + "_planned"
    return step


def plan(step: Callable[..., Any], *example_args: Any, budget: Any,
         allow_approximate: bool = False, time_limit: float = 10.0,
         max_iterations: int = 5) -> MemoryPlan:
    """Fit ``jax.value_and_grad(step)`` (gradient w.r.t. the first argument) into ``budget``.

    ``step(params, *batch) -> scalar loss`` may call Flax Linen modules (their outputs become
    the units; :func:`jaxmem.planner.tag` marks units in other code). Per unit the planner
    chooses ``store``, ``dots`` or ``recompute`` (``jax.checkpoint`` with ``dots_saveable`` /
    ``nothing_saveable``) by CP-SAT (minimum recomputed FLOPs with predicted bytes <= budget),
    compiles the result and re-solves with a tighter model budget when the compiled bytes
    exceed ``budget``. Raises :class:`BudgetError` when no plan it tried compiles within
    ``budget``.

    Args:
      step: ``step(params, *batch) -> scalar`` loss.
      *example_args: example ``params`` and batch, of the shapes and dtypes to plan for.
      budget: bytes (int), a size string such as ``"512MiB"``, or a float in (0, 1]: a
        fraction of the untouched step's compiled bytes.
      allow_approximate: must be ``False`` (only exact options are planned).
      time_limit: CP-SAT time limit per solve, in seconds.
      max_iterations: most solve-compile rounds.

    Returns:
      A :class:`MemoryPlan`: ``plan.step`` has ``step``'s signature and values, with the
      per-unit choices, predicted and compiled bytes.

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
    if not callable(step):
        raise TypeError(f"plan: step must be callable, got {type(step).__name__}")
    if not example_args:
        raise ValueError("plan: give example arguments, e.g. plan(loss, params, batch, ...)")
    if allow_approximate:
        raise NotImplementedError("plan: allow_approximate=True (few-bit bits per activation) "
                                  "is not implemented yet; use allow_approximate=False")
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"plan: time_limit must be a positive number of seconds, got "
                         f"{time_limit!r}")
    args = tuple(example_args)
    from jaxmem.measure import compiled_memory
    if isinstance(budget, float):
        parse_budget(budget, 1)   # validate before compiling anything
    elif not isinstance(budget, (int, np.integer, str)) or isinstance(budget, bool):
        parse_budget(budget)
    cm0 = compiled_memory(jax.value_and_grad(step), *args)
    default_bytes = cm0.total_bytes
    budget_bytes = parse_budget(budget, default_bytes)
    floor = cm0.argument_bytes + cm0.output_bytes - cm0.alias_bytes
    if budget_bytes < floor:
        mib = 2.0**20
        raise BudgetError(
            f"plan: budget {budget_bytes / mib:.2f} MiB cannot be met: the step's arguments "
            f"(parameters, batch, state) take {cm0.argument_bytes / mib:.2f} MiB and its outputs "
            f"(loss, gradients) {cm0.output_bytes / mib:.2f} MiB before any activation is kept "
            f"(default {default_bytes / mib:.2f} MiB); dominated by arguments and outputs",
            floor, {"arguments (parameters, batch, state)": cm0.argument_bytes,
                    "outputs (loss, gradients)": cm0.output_bytes})

    import jaxmem
    variants = [(False, None), (True, lambda: jaxmem.scope())]
    best = None
    for sel, factory in variants:
        s = _make_step(step, args, factory, {})
        try:
            b = _compiled_total(s, args)
        except Exception:  # noqa: BLE001, S112 - a scope that cannot trace is simply not used
            continue
        if best is None or b < best[2]:
            best = (sel, factory, b)
    selective, factory, store_bytes = best

    tr = _trace.trace(step, args, factory() if factory else None)
    units = _trace.choose_units(tr)
    jaxpr = tr.closed.jaxpr
    outer = set(jaxpr.invars) | set(jaxpr.constvars)
    keep, work, cost = [], [], []
    total_flops = 0.0
    for u in units:
        ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
        f = _trace.chunk_fn(jaxpr, u.start, u.stop, ins, outs)
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
        sub = core.Jaxpr([], list(ins), list(outs), list(jaxpr.eqns[u.start:u.stop]))
        fl, dots = _trace.flops_of(sub)
        total_flops += fl
        row_k, row_w, row_c = [], [], []
        full = None
        for o in OPTIONS:
            internal, kept = _residual_split(f, avals, _trace.POLICIES[o])
            kb = internal + sum(_nbytes(ins[i].aval) for i in kept if ins[i] not in outer)
            if o == "store":
                full = internal
            row_k.append(kb)
            row_w.append(0 if o == "store" else max(0, full - internal))
            row_c.append({"store": 0.0, "dots": fl - dots, "recompute": fl}[o])
        keep.append(row_k)
        work.append(row_w)
        cost.append(row_c)
    base = store_bytes - sum(k[0] for k in keep)

    def predicted(choice):
        return base + sum(keep[u][o] for u, o in enumerate(choice)) + \
            max([work[u][o] for u, o in enumerate(choice)] + [0])

    n_opt = len(OPTIONS)
    all_store = tuple(0 for _ in units)
    all_rec = tuple(n_opt - 1 for _ in units)
    tried: dict[tuple[int, ...], int] = {all_store: store_bytes}
    if units and budget_bytes < store_bytes:
        tried[all_rec] = _compiled_total(
            _make_step(step, args, factory, {u.label: "recompute" for u in units}), args)

    def fit():
        """compiled ~= a + s * predicted, least squares over every compiled plan."""
        xs = np.array([float(predicted(c)) for c in tried])
        ys = np.array([float(v) for v in tried.values()])
        if len(xs) < 2 or np.ptp(xs) == 0:
            return float(np.mean(ys - xs)), 1.0
        s_, a_ = np.polyfit(xs, ys, 1)
        return float(a_), float(max(s_, 1e-3))

    def calibrated(choice):
        a_, s_ = fit()
        return round(a_ + s_ * predicted(choice))

    sol = None
    it = 0
    slack = 0
    if budget_bytes >= store_bytes:
        candidates = [all_store]
    else:
        candidates = []
    for it in range(1, max_iterations + 1):
        if candidates:
            choice = candidates.pop()
            sol = _solve.Solution(choice, "OPTIMAL", 0.0, 0.0)
        else:
            a_, s_ = fit()
            model_budget = int((budget_bytes - slack - a_) / s_)
            over = [c for c, v in tried.items() if v > budget_bytes]
            sol = _solve.solve(keep, work, cost, base, model_budget, time_limit, over)
            if _DEBUG:
                print("plan: model budget", model_budget, "fit", (a_, s_), sol)
            if sol.choice is None:
                break
        choice = sol.choice
        pred = calibrated(choice)   # before this plan's own compiled bytes are known
        if choice not in tried:
            opts = {u.label: OPTIONS[o] for u, o in zip(units, choice)}
            tried[choice] = _compiled_total(_make_step(step, args, factory, opts), args)
        compiled = tried[choice]
        if _DEBUG:
            print("plan:", [OPTIONS[o] for o in choice], "predicted", pred, "compiled", compiled,
                  "raw", predicted(choice), "fit", fit())
        if compiled <= budget_bytes:
            opts = {u.label: OPTIONS[o] for u, o in zip(units, choice)}
            s = _make_step(step, args, factory, opts)
            choices = []
            for u, o, k, w, c in zip(units, choice, keep, work, cost):
                name = OPTIONS[o]
                why = ("fits: keeping its residuals costs no recompute" if name == "store" else
                       f"recompute {c[o] / 1e6:.1f} MFLOP to drop "
                       f"{(k[0] - k[o]) / 2**20:.3f} MiB")
                choices.append(UnitChoice(u.label, name, k[o], w[o], c[o], why))
            return MemoryPlan(step=s, choices=tuple(choices), budget_bytes=budget_bytes,
                              default_bytes=default_bytes, predicted_bytes=pred,
                              compiled_bytes=compiled,
                              predicted_time=1.0 + sol.objective / max(3.0 * total_flops, 1.0),
                              selective=selective, solver_status=sol.status,
                              solver_gap=sol.gap, iterations=it)
        slack += max(0, compiled - budget_bytes)

    # every unit recomputed: the least this mechanism can reach
    if units and all_rec not in tried:
        tried[all_rec] = _compiled_total(
            _make_step(step, args, factory, {u.label: "recompute" for u in units}), args)
    fits = [c for c, v in tried.items() if v <= budget_bytes]
    if fits:   # a compiled plan (e.g. every unit recomputed) fits although the model missed it
        choice = min(fits, key=lambda c: (sum(cost[u][o] for u, o in enumerate(c)), c))
        obj = sum(cost[u][o] for u, o in enumerate(choice))
        opts = {u.label: OPTIONS[o] for u, o in zip(units, choice)}
        choices = []
        for u, o, k, w, c in zip(units, choice, keep, work, cost):
            name = OPTIONS[o]
            why = ("fits: keeping its residuals costs no recompute" if name == "store" else
                   f"recompute {c[o] / 1e6:.1f} MFLOP to drop {(k[0] - k[o]) / 2**20:.3f} MiB")
            choices.append(UnitChoice(u.label, name, k[o], w[o], c[o], why))
        return MemoryPlan(step=_make_step(step, args, factory, opts), choices=tuple(choices),
                          budget_bytes=budget_bytes, default_bytes=default_bytes,
                          predicted_bytes=calibrated(choice), compiled_bytes=tried[choice],
                          predicted_time=1.0 + obj / max(3.0 * total_flops, 1.0),
                          selective=selective, solver_status="FEASIBLE (compiled fallback)",
                          solver_gap=float("nan"), iterations=it)
    smallest = min(list(tried.values()) + [store_bytes])
    cm = cm0
    big = max(range(len(units)), key=lambda i: keep[i][0]) if units else None
    dominant = {"arguments (parameters, batch, state)": cm.argument_bytes,
                "outputs (loss, gradients)": cm.output_bytes}
    if big is not None:
        dominant[f"largest unit working set ({units[big].label})"] = keep[big][0]
    mib = 2.0**20
    parts = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in
                      sorted(dominant.items(), key=lambda kv: -kv[1]))
    raise BudgetError(
        f"plan: budget {budget_bytes / mib:.2f} MiB cannot be met; the smallest compiled total "
        f"reached is {smallest / mib:.2f} MiB (default {default_bytes / mib:.2f} MiB; "
        f"{len(units)} units, {len(tried)} plans compiled, solver "
        f"{sol.status if sol else 'not run'}); dominated by {parts}", smallest, dominant)
