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


def _merged_units(units: list[_trace.Unit], segments) -> tuple[list[_trace.Unit], dict]:
    """Units of ``segments`` (``(first, stop, option)`` over unit indices) and their options."""
    merged, opts = [], {}
    for i, j, o in segments:
        if j - i == 1:
            u = units[i]
        else:
            u = _trace.Unit(f"{units[i].label}..{units[j - 1].label}", units[i].start,
                            units[j - 1].stop, units[i].depth)
        merged.append(u)
        opts[u.label] = "recompute" if o == "segment" else o
    return merged, opts


def _make_step(fn, example_args, scope_factory, segments):
    """The loss evaluated item by item under ``segments`` (re-traced for new shapes)."""
    cache: dict[Any, tuple[Any, list[_trace.Unit], dict]] = {}
    segments = tuple(segments)

    def step(*args):
        flat, tree = jax.tree_util.tree_flatten(tuple(args))
        key = (tree, tuple((tuple(np.shape(a)), str(jax.numpy.result_type(a))) for a in flat))
        if key not in cache:
            abstract = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a)), args)
            tr = _trace.trace(fn, abstract, scope_factory() if scope_factory else None)
            units = _trace.choose_units(tr)
            if segments and segments[-1][1] != len(units):
                raise ValueError(f"plan: the step traced with new shapes has {len(units)} "
                                 f"units, the plan was made for {segments[-1][1]}")
            merged, opts = _merged_units(units, segments) if segments else (units, {})
            cache[key] = (tr, merged, opts)
        tr, merged, opts = cache[key]
        outs = _trace.run_chunks(tr.closed, merged, opts, flat)
        return jax.tree_util.tree_unflatten(tr.out_tree, outs)

    step.__name__ = getattr(fn, "__name__", "step") + "_planned"
    return step


def plan(step: Callable[..., Any], *example_args: Any, budget: Any,
         allow_approximate: bool = False, time_limit: float = 10.0,
         max_iterations: int = 6, fence_cost: float = 0.1) -> MemoryPlan:
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
      allow_approximate: must be ``False`` (only exact options are planned).
      time_limit: CP-SAT time limit per solve, in seconds.
      max_iterations: most solve-compile rounds.
      fence_cost: predicted extra step time per checkpointed item, as a fraction of the
        untouched step's time (each runs its backward behind a ``lax.cond`` fence; measured
        ~0.2 per unit on CPU for ResNet-50 at width 0.125, ~0 for GPT).

    Returns:
      A :class:`MemoryPlan`: ``plan.step`` has ``step``'s signature and values, with the
      per-item choices, predicted and compiled bytes.

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
    if not (isinstance(max_iterations, int) and max_iterations >= 1):
        raise ValueError(f"plan: max_iterations must be an int >= 1, got {max_iterations!r}")
    if not (isinstance(fence_cost, (int, float)) and fence_cost >= 0):
        raise ValueError(f"plan: fence_cost must be a number >= 0, got {fence_cost!r}")
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
    mib = 2.0**20

    import jaxmem
    variants = [(False, None), (True, lambda: jaxmem.scope())]
    best = None
    for sel, factory in variants:
        s = _make_step(step, args, factory, ())
        try:
            b = _compiled_total(s, args)
        except Exception:  # noqa: BLE001, S112 - a scope that cannot trace is simply not used
            continue
        if best is None or b < best[2]:
            best = (sel, factory, b)
    selective, factory, store_bytes = best

    tr = _trace.trace(step, args, factory() if factory else None)
    units = _trace.choose_units(tr)
    n = len(units)
    jaxpr = tr.closed.jaxpr
    outer = set(jaxpr.invars) | set(jaxpr.constvars)
    keep, work, flops = [], [], []
    total_flops = 0.0
    for u in units:
        ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
        f = _trace.chunk_fn(jaxpr, u.start, u.stop, ins, outs)
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
        sub = core.Jaxpr([], list(ins), list(outs), list(jaxpr.eqns[u.start:u.stop]))
        fl, dots = _trace.flops_of(sub)
        total_flops += fl
        row_k, row_w = [], []
        full = None
        for o in OPTIONS:
            internal, kept = _residual_split(f, avals, _trace.POLICIES[o])
            kb = internal + sum(_nbytes(ins[i].aval) for i in kept if ins[i] not in outer)
            if o == "store":
                full = internal
            row_k.append(kb)
            row_w.append(0 if o == "store" else max(0, full - internal))
        keep.append(row_k)
        work.append(row_w)
        flops.append((fl, fl - dots))
    fence = fence_cost * 3.0 * max(total_flops, 1.0)

    # items: (cover, option, raw kept bytes, raw work bytes, kind, predicted extra FLOPs)
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
    def features(choice):
        """(saving by dots items, by recompute items, by segments, minus the largest work)."""
        fd = fr = fs = 0.0
        w = 0.0
        for i in choice:
            cover, o, kb, wb, _ = raw[i]
            save = sum(keep[u][0] for u in cover) - kb
            if o == "dots":
                fd += save
            elif o == "recompute":
                fr += save
            elif o == "segment":
                fs += save
            w = max(w, wb)
        return np.array([fd, fr, fs, -w])

    tried: dict[tuple[int, ...], int] = {}
    preds: dict[tuple[int, ...], int] = {}
    idx = {(r[0], r[1]): i for i, r in enumerate(raw)}

    def uniform(o):
        return tuple(idx[((u,), o)] for u in range(n))

    def fit():
        """``default - compiled ~= a_d * saving_dots + a_r * saving_recompute + a_s *
        saving_segments - b * work``: least squares over every compiled plan, with a weak
        prior pulling each coefficient to 1."""
        rows = [features(c) for c in tried]
        ys = [float(store_bytes - v) for v in tried.values()]
        lam = 1e-2 * max(store_bytes, 1)
        a_mat = np.vstack(rows + [np.eye(4) * lam]) / max(store_bytes, 1)
        y = np.array(ys + [lam] * 4) / max(store_bytes, 1)
        theta = np.linalg.lstsq(a_mat, y, rcond=None)[0]
        return np.clip(theta, 0.0, None)

    def predict(choice, theta):
        return int(np.rint(store_bytes - float(features(choice) @ theta)))

    def items_for(theta):
        out = []
        for cover, o, kb, wb, cst in raw:
            full = sum(keep[u][0] for u in cover)
            a = {"store": 1.0, "dots": theta[0], "recompute": theta[1],
                 "segment": theta[2]}[o]
            out.append(_solve.Item(cover, o, int(np.rint(full - a * (full - kb))),
                                   int(np.rint(theta[3] * wb)), cst))
        return out

    base = store_bytes - sum(k[0] for k in keep)
    all_store = uniform("store")
    tried[all_store] = preds[all_store] = store_bytes

    def compile_choice(choice):
        if choice not in tried:
            preds[choice] = predict(choice, fit())
            tried[choice] = _compiled_total(
                _make_step(step, args, factory, _segments(choice)), args)
        return tried[choice]

    def _segments(choice):
        return tuple(sorted((raw[i][0][0], raw[i][0][-1] + 1, raw[i][1]) for i in choice))

    def cost_of(choice):
        return sum(raw[i][4] for i in choice)

    def least_bytes():
        """Compile the plan of least predicted bytes (and every unit recomputed)."""
        if n:
            compile_choice(uniform("recompute"))
            over = [c for c, v in tried.items() if v > budget_bytes]
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
        compile_choice(uniform("recompute"))
        if any(keep[u][1] < keep[u][0] for u in range(n)):
            compile_choice(uniform("dots"))
        slack = 0
        least_tried = False
        for it in range(1, max_iterations + 1):
            fits = [c for c, v in tried.items() if v <= budget_bytes]
            theta = fit()
            items = items_for(theta)
            over = [c for c, v in tried.items() if v > budget_bytes]
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
                print("plan:", _segments(sol.choice), "predicted", preds[sol.choice],
                      "compiled", compiled)
            if compiled <= budget_bytes:
                status = sol.status
                if abs(preds[sol.choice] / max(compiled, 1) - 1.0) <= 0.1:
                    break
                # the model missed this plan by more than 10 %: refit on it and re-solve; a
                # cheaper plan the refit model finds within the budget replaces it
            elif not mode_bytes:
                slack += compiled - budget_bytes
        else:
            it = max_iterations
    fits = [c for c, v in tried.items() if v <= budget_bytes]
    if fits:
        choice = min(fits, key=lambda c: (cost_of(c), tried[c], c))
        segs = _segments(choice)
        merged, _ = _merged_units(units, segs)
        choices = []
        for i, u in zip(sorted(choice, key=lambda i: raw[i][0][0]), merged):
            cover, o, kb, wb, cst = raw[i]
            full = sum(keep[v][0] for v in cover)
            extra = cst - (fence if o != "store" else 0.0)
            why = ("fits: keeping its residuals costs no recompute" if o == "store" else
                   f"recompute {extra / 1e6:.1f} MFLOP to drop {(full - kb) / 2**20:.3f} MiB")
            choices.append(UnitChoice(u.label, o, int(kb), int(wb), float(extra), why))
        return MemoryPlan(step=_make_step(step, args, factory, segs), choices=tuple(choices),
                          budget_bytes=budget_bytes, default_bytes=default_bytes,
                          predicted_bytes=preds[choice], compiled_bytes=tried[choice],
                          predicted_time=1.0 + cost_of(choice) / max(3.0 * total_flops, 1.0),
                          selective=selective,
                          solver_status=status if sol is not None else "OPTIMAL",
                          solver_gap=sol.gap if sol is not None and sol.choice is not None
                          else 0.0, iterations=max(it, 1))
    if budget_bytes >= floor:
        least_bytes()
    smallest = min(tried.values())
    big = max(range(n), key=lambda i: keep[i][0]) if n else None
    dominant = {"arguments (parameters, batch, state)": cm0.argument_bytes,
                "outputs (loss, gradients)": cm0.output_bytes}
    if big is not None:
        dominant[f"largest unit working set ({units[big].label})"] = keep[big][0]
    parts = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in
                      sorted(dominant.items(), key=lambda kv: -kv[1]))
    lead = (f"the step's arguments (parameters, batch, state) take "
            f"{cm0.argument_bytes / mib:.2f} MiB and its outputs (loss, gradients) "
            f"{cm0.output_bytes / mib:.2f} MiB before any activation is kept; "
            if budget_bytes < floor else "")
    raise BudgetError(
        f"plan: budget {budget_bytes / mib:.2f} MiB cannot be met; {lead}the smallest "
        f"compiled total reached is {smallest / mib:.2f} MiB (default "
        f"{default_bytes / mib:.2f} MiB; {n} units, {len(tried)} plans compiled); dominated "
        f"by {parts}" + (" (arguments and outputs)" if budget_bytes < floor else ""),
        smallest, dominant)
