"""The node-ordering ILP of OLLA (eq. 14), solved with OR-Tools CP-SAT.

Two models of the same problem (one node per step, a sequential order of ``n`` steps);
both restrict every node ``v`` to ``SPAN(v)`` (:func:`jaxmem.schedule.reach.spans`).

:func:`solve_order` — the paper's time-indexed model (section 3.2):

* ``C_{v,t}`` (Boolean) — node ``v`` runs at step ``t``, only for ``t in SPAN(v)``. The paper
  has one ``C_{e,t}`` per tensor and ties siblings together (eq. 5); one per node is the same
  thing with eq. 5 substituted.
* ``P_{e,t}`` (Boolean) — tensor ``e`` is preserved (kept from an earlier step) at ``t``; only
  for ``t in MUL(e)``, fixed to 1 on ``PRES(e)`` (eqs. 11, 12); none for persistent tensors
  (constant) or size-0 control edges (they only order nodes).
* (3) ``ExactlyOne_t C_{v,t}`` — every node runs once;
* one node per step: the linear equality ``sum_v C_{v,t} = 1`` (sequential execution; the
  paper allows concurrent nodes — a sequential order is never worse, and it makes the tight
  spans exact);
* ``time(v) = sum_t t C_{v,t}`` (an integer variable) and ``time(snk) >= time(src) + 1``
  for every edge (control edges included; it helps propagation);
* (2) ``P_{e,t} <= P_{e,t-1} + C_{src(e),t-1}`` — preserved only if created or preserved the
  step before; an equality for step outputs (kept until the end); on ``PRES(e)`` the right
  side must be >= 1;
* (1) ``P_{e,t} + C_{src(e),t} <= 1`` is implied by (2) and (3) and is not added;
* (4) ``C_{v,t} => P_{f,t}`` (an implication) for every input ``f`` of ``v`` — inputs are
  resident; ``C_{v,t} = 0`` where ``f`` cannot be;
* (13) ``sum_v C_{v,t} out(v) + sum_e S_e P_{e,t} <= peak`` at every step.

:func:`solve_order_cumulative` — a compact form, ``O(|V| + |E|)`` variables: one integer step
``t_v in SPAN(v)`` per node; a ``NoOverlap`` of the unit intervals ``[t_v, t_v + 1)`` (one node
per step; an ``AllDifferent`` would be expanded by the presolve into a quadratic Boolean
encoding); ``t_snk >= t_src + 1`` per edge; one interval ``[t_src(e), end_e]`` per tensor,
``end_e = max_s t_s`` (``n - 1`` for step outputs), in a ``Cumulative`` constraint of capacity
``peak`` (eq. 13's resident-set bound).

Both minimise ``peak`` (in units of the gcd of the tensor sizes, persistent bytes added
back). A hint order is given as a complete solution hint (warm start) and the solver is
anytime: on its time limit it returns the best order found with its proven lower bound.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from .graph import Graph
from .reach import Reach, edge_ranges, spans
from .simulate import lifetimes, simulate

__all__ = ["OrderResult", "estimate_time_indexed_vars", "solve_order", "solve_order_cumulative"]

# above this many variables CP-SAT's probing/symmetry presolve costs seconds per round on the
# time-indexed model and does not pay off: search from the warm start instead
_BIG_MODEL_VARS = 5000


def _check_args(graph, hint, time_limit, reach):
    """Validated ``(time_limit, hint as a list or None, reach)``."""
    from .place import _check_seconds

    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a jaxmem.schedule.Graph, got {type(graph).__name__}")
    time_limit = _check_seconds("time_limit", time_limit)
    if hint is not None:
        hint = list(hint)
        graph.check_order(hint)
    return time_limit, hint, reach if reach is not None else Reach(graph)


@dataclasses.dataclass
class OrderResult:
    """Result of :func:`solve_order` / :func:`solve_order_cumulative`.

    When CP-SAT returns no solution (time-out: ``UNKNOWN``; or ``INFEASIBLE`` below an
    ``upper_bound``), ``order`` is the hint (else Kahn's topological order), always valid,
    ``objective`` is None and ``bound`` is the persistent bytes (or ``upper_bound`` when
    ``INFEASIBLE`` proves nothing better exists).
    """

    order: list[str]
    objective: int | None  # solver's objective for its order (an upper bound of the peak)
    bound: int  # proven lower bound of the optimal peak of the model's graph
    status: str  # OPTIMAL / FEASIBLE / WITHIN_GAP / UNKNOWN / INFEASIBLE / MODEL_INVALID
    seconds: float
    num_vars: int


# ---- stages shared by both models -------------------------------------------------------

def _scaled_sizes(graph: Graph) -> tuple[list[int], int]:
    """``(sizes, unit)``: the sizes of the tensors that occupy memory (not persistent,
    > 0 bytes) and their gcd ``unit``, the solver's byte unit (1 when there are none)."""
    sizes = [e.size for e in graph.edges.values() if not e.persistent and e.size > 0]
    return sizes, math.gcd(*sizes) or 1


def _objective_bounds(graph: Graph, sizes: list[int], unit: int, upper_bound: int | None,
                      lower_bound: int | None) -> tuple[int, int]:
    """Domain ``[lo, hi]`` of ``peak`` in units, persistent bytes removed:
    ``hi = min(sum sizes, floor(upper_bound))`` and ``lo = ceil(lower_bound)`` clipped to
    ``[0, hi]`` (``hi >= 0``)."""
    persistent = graph.persistent_bytes()
    total = sum(sizes) // unit
    if upper_bound is not None:
        total = min(total, max(0, (upper_bound - persistent) // unit))
    hi = max(total, 0)
    lo = 0
    if lower_bound is not None:
        lo = min(max(0, -(-(lower_bound - persistent) // unit)), hi)
    return lo, hi


def _add_precedences(m, graph: Graph, step: dict) -> None:
    """``step[snk] >= step[src] + 1`` for every edge (skipped where both steps are fixed)."""
    for e in graph.edges.values():
        for s in e.sinks:
            if not (isinstance(step[s], int) and isinstance(step[e.src], int)):
                m.Add(step[s] >= step[e.src] + 1)


def _add_peak_hint(m, peak, graph: Graph, hint: list[str], unit: int, hi: int) -> None:
    """Hint ``peak`` with the hint order's simulated peak in units (when in its domain)."""
    hp = -(-(simulate(graph, hint) - graph.persistent_bytes()) // unit)
    if 0 <= hp <= hi:
        m.AddHint(peak, hp)


def _solver(time_limit: float, t0: float, num_workers: int, log: bool,
            relative_gap_limit: float, **params):
    """A CP-SAT solver whose clock ends ``time_limit`` seconds after ``t0`` (at least
    0.05 s: model building counts against the limit), with extra ``params``."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.log_search_progress = bool(log)
    solver.parameters.relative_gap_limit = float(relative_gap_limit)
    for key, value in params.items():
        setattr(solver.parameters, key, value)
    solver.parameters.max_time_in_seconds = max(
        0.05, float(time_limit) - (time.perf_counter() - t0))
    return solver


def _extract_order(graph: Graph, reach: Reach, steps: dict[str, int]) -> list[str]:
    """Nodes sorted by solver step (ties, none in a feasible solution, by topological
    index)."""
    return sorted(graph.nodes, key=lambda v: (steps[v], reach.index[v]))


def _result(solver, status, m, graph: Graph, reach: Reach, steps: Callable[[], dict],
            unit: int, hint: list[str] | None, upper_bound: int | None,
            relative_gap_limit: float, t0: float) -> OrderResult:
    """The :class:`OrderResult` of a solve. With a solution: its order, its objective
    ``peak * unit + persistent`` and the proven bound ``ceil(best bound) * unit +
    persistent`` (the objective itself when OPTIMAL without a gap limit; with a gap limit
    CP-SAT says OPTIMAL once the gap is reached: the status is then ``WITHIN_GAP``).
    Without one: the fallback documented in :class:`OrderResult`."""
    from ortools.sat.python import cp_model

    name = solver.StatusName(status)
    num_vars = len(m.Proto().variables)
    persistent = graph.persistent_bytes()
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        order = _extract_order(graph, reach, steps())
        obj = round(solver.ObjectiveValue()) * unit + persistent
        bound = min(obj, math.ceil(solver.BestObjectiveBound() - 1e-6) * unit + persistent)
        if status == cp_model.OPTIMAL and relative_gap_limit == 0:
            bound = obj
        if bound < obj and name == "OPTIMAL":
            name = "WITHIN_GAP"
        return OrderResult(order, obj, bound, name, time.perf_counter() - t0, num_vars)
    bound = persistent
    if status == cp_model.INFEASIBLE and upper_bound is not None:
        bound = upper_bound  # nothing strictly better than the upper bound exists
    return OrderResult(list(hint) if hint is not None else list(reach.order), None, bound,
                       name, time.perf_counter() - t0, num_vars)


# ---- the time-indexed model (eq. 14) -----------------------------------------------------

def _add_step_vars(m, graph: Graph, span) -> dict[str, dict[int, object]]:
    """``C[v][t]`` for ``t in SPAN(v)`` (the constant 1 for a one-step span) with
    ``ExactlyOne_t C[v][t]`` (eq. 3)."""
    C: dict[str, dict[int, object]] = {}
    for v in graph.nodes:
        a, b = span[v]
        if a > b:
            raise RuntimeError(f"internal: empty span for node {v!r}")
        if a == b:
            C[v] = {a: 1}
        else:
            C[v] = {t: m.NewBoolVar(f"C[{v},{t}]") for t in range(a, b + 1)}
            m.AddExactlyOne(C[v].values())
    return C


def _add_one_node_per_step(m, C, n: int) -> None:
    """``sum_v C[v][t] = 1`` at every step ``t`` with a free variable."""
    by_step: dict[int, list] = {t: [] for t in range(n)}
    for d in C.values():
        for t, x in d.items():
            by_step[t].append(x)
    for xs in by_step.values():
        free = [x for x in xs if not isinstance(x, int)]
        if free:
            m.Add(sum(free) == 1 - (len(xs) - len(free)))


def _add_time_vars(m, C) -> dict[str, object]:
    """``time(v) = sum_t t C[v][t]`` (an int for a one-step span)."""
    tvar = {}
    for v, d in C.items():
        if len(d) == 1:
            tvar[v] = next(iter(d))
        else:
            tv = m.NewIntVar(min(d), max(d), f"t[{v}]")
            m.Add(tv == sum(t * x for t, x in d.items()))
            tvar[v] = tv
    return tvar


def _add_preserve_vars(m, graph: Graph, ranges, C) -> dict[str, dict[int, object]]:
    """``P[e][t]`` for ``t in MUL(e)`` after its creation step (1 on ``PRES(e)``) with
    eq. 2 (equality for outputs) and eq. 4 for its readers."""
    P: dict[str, dict[int, object]] = {}
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        (mul_a, mul_b), (pres_a, pres_b) = ranges[e.name]
        d: dict[int, object] = {}
        for t in range(mul_a + 1, mul_b + 1):
            d[t] = 1 if pres_a <= t <= pres_b else m.NewBoolVar(f"P[{e.name},{t}]")
        P[e.name] = d
        for t, p in d.items():
            before = (d.get(t - 1, 0), C[e.src].get(t - 1, 0))
            rhs = [x for x in before if not isinstance(x, int)]
            const = sum(x for x in before if isinstance(x, int))
            if isinstance(p, int):
                # forced preservation (PRES): it must have been created or kept before
                if rhs and const == 0:
                    m.Add(sum(rhs) >= 1)
                continue
            if e.output:
                m.Add(p == sum(rhs) + const)
            elif const == 0:
                m.Add(p <= sum(rhs))
        for s in e.sinks:  # eq. 4: a reader runs only while its input is resident
            for t, x in C[s].items():
                if isinstance(x, int):
                    continue
                p = d.get(t, 0)
                if isinstance(p, int):
                    if p == 0:
                        m.Add(x == 0)
                    continue
                m.AddImplication(x, p)
    return P


def _add_resident_bytes(m, graph: Graph, C, P, unit: int, peak) -> None:
    """Eq. 13: outputs of the running node plus preserved tensors ``<= peak`` per step."""
    n = len(graph.nodes)
    out_bytes = {
        v: sum(graph.edges[e].size for e in graph.fanout(v)
               if not graph.edges[e].persistent) // unit
        for v in graph.nodes
    }
    terms: dict[int, list] = {t: [] for t in range(n)}
    const = [0] * n
    for v, d in C.items():
        if out_bytes[v] == 0:
            continue
        for t, x in d.items():
            if isinstance(x, int):
                const[t] += out_bytes[v] * x
            else:
                terms[t].append(out_bytes[v] * x)
    for name, d in P.items():
        sz = graph.edges[name].size // unit
        for t, p in d.items():
            if isinstance(p, int):
                const[t] += sz * p
            else:
                terms[t].append(sz * p)
    for t in range(n):
        if terms[t]:
            m.Add(sum(terms[t]) + const[t] <= peak)
        else:
            m.Add(peak >= const[t])


def _hint_time_indexed(m, graph: Graph, hint: list[str], C, P, tvar) -> None:
    """Hint every free C, P and time variable with the values of the ``hint`` order."""
    pos = {v: i for i, v in enumerate(hint)}
    for v, d in C.items():
        for t, x in d.items():
            if not isinstance(x, int):
                m.AddHint(x, 1 if pos[v] == t else 0)
    live = lifetimes(graph, hint, check=False)
    for name, d in P.items():
        a, b = live[name]
        for t, p in d.items():
            if not isinstance(p, int):
                m.AddHint(p, 1 if a < t <= b else 0)
    for v, tv in tvar.items():
        if not isinstance(tv, int):
            m.AddHint(tv, pos[v])


def _chosen_step(solver, d: dict[int, object]) -> int:
    """The step whose ``C`` variable the solution sets."""
    if len(d) == 1:
        return next(iter(d))
    return next(t for t, x in d.items() if solver.Value(x))


class _TimeIndexed:
    """Stages of the time-indexed model (eq. 14): ``C``/``time``/``P`` variables, then
    eq. 13 against ``peak``; the solution is read from ``C``."""

    def __init__(self, m, graph: Graph, span, unit: int):
        self.m, self.graph, self.unit = m, graph, unit
        self.C = _add_step_vars(m, graph, span)
        _add_one_node_per_step(m, self.C, len(graph.nodes))
        self.tvar = _add_time_vars(m, self.C)
        _add_precedences(m, graph, self.tvar)
        self.P = _add_preserve_vars(m, graph, edge_ranges(graph, span), self.C)

    def bound_memory(self, peak) -> None:
        _add_resident_bytes(self.m, self.graph, self.C, self.P, self.unit, peak)

    def add_hint(self, hint: list[str]) -> None:
        _hint_time_indexed(self.m, self.graph, hint, self.C, self.P, self.tvar)

    def solver_params(self) -> dict:
        if len(self.m.Proto().variables) > _BIG_MODEL_VARS:
            return {"cp_model_probing_level": 0, "symmetry_level": 0}
        return {}

    def steps(self, solver) -> dict[str, int]:
        return {v: _chosen_step(solver, d) for v, d in self.C.items()}


def solve_order(
    graph: Graph,
    hint: Sequence[str] | None = None,
    time_limit: float = 10.0,
    num_workers: int = 2,
    upper_bound: int | None = None,
    log: bool = False,
    lower_bound: int | None = None,
    relative_gap_limit: float = 0.0,
    reach: Reach | None = None,
    formulation: str = "olla",
) -> OrderResult:
    """Minimise the peak of ``graph``'s node order; ``hint`` is a topological order used as
    warm start.

    Both formulations share one frame: validate the arguments, scale sizes to units,
    build the step constraints, add ``peak`` in ``[lo, hi]`` and its memory bound,
    minimise ``peak``, warm-start from ``hint``, solve and read the result.

    Args:
      formulation: ``"olla"`` — eq. 14, the time-indexed model (module docstring);
        ``"cumulative"`` — the compact model (:func:`solve_order_cumulative`).
      time_limit: finite seconds > 0 for the whole call (model building included; CP-SAT
        gets at least 0.05 s).
      upper_bound, lower_bound: known bytes that bound the optimal peak (prune the domain).
      relative_gap_limit: stop once ``(objective - bound) / objective`` is below it.

    Returns:
      An :class:`OrderResult`. When CP-SAT finds no order in time (status ``UNKNOWN``) it is
      the fallback documented there: the hint (or Kahn's topological order) with
      ``objective=None`` and the trivial bound — never an invalid order.
    """
    from ortools.sat.python import cp_model

    if formulation not in _FORMULATIONS:
        raise ValueError(f"formulation: must be one of {tuple(_FORMULATIONS)}, "
                         f"got {formulation!r}")
    t0 = time.perf_counter()
    time_limit, hint, reach = _check_args(graph, hint, time_limit, reach)
    span = spans(graph, reach)
    sizes, unit = _scaled_sizes(graph)
    m = cp_model.CpModel()
    model = _FORMULATIONS[formulation](m, graph, span, unit)
    lo, hi = _objective_bounds(graph, sizes, unit, upper_bound, lower_bound)
    peak = m.NewIntVar(lo, hi, "peak")
    model.bound_memory(peak)
    m.Minimize(peak)
    if hint is not None:
        model.add_hint(hint)
        _add_peak_hint(m, peak, graph, hint, unit, hi)
    solver = _solver(time_limit, t0, num_workers, log, relative_gap_limit,
                     **model.solver_params())
    status = solver.Solve(m)
    return _result(solver, status, m, graph, reach, lambda: model.steps(solver),
                   unit, hint, upper_bound, relative_gap_limit, t0)


def estimate_time_indexed_vars(graph: Graph, reach: Reach | None = None) -> int:
    """Number of C and P variables the time-indexed model of eq. 14 would create."""
    span = spans(graph, reach)
    ranges = edge_ranges(graph, span)
    total = sum(b - a + 1 for a, b in span.values() if b > a)
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        (ma, mb), (pa, pb) = ranges[e.name]
        free = (mb - ma) - max(0, min(pb, mb) - max(pa, ma + 1) + 1)
        total += max(0, free)
    return total


# ---- the compact scheduling model --------------------------------------------------------

def _add_tensor_intervals(m, graph: Graph, span, tv, unit: int):
    """One interval ``[t_src(e), end_e]`` per tensor that occupies memory, ``end_e`` its
    last reader's step (``n - 1`` for outputs, ``t_src`` when unread). Returns
    ``(intervals, demands in units, ends)``; ``ends`` holds the max-of-readers variables."""
    n = len(graph.nodes)
    intervals, demands, ends = [], [], {}
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        start = tv[e.src]
        if e.output:
            end = m.NewConstant(n - 1)
        elif not e.sinks:
            end = start
        elif len(e.sinks) == 1:
            end = tv[e.sinks[0]]
        else:
            lo = max(span[s][0] for s in e.sinks)
            hi = max(span[s][1] for s in e.sinks)
            end = m.NewIntVar(lo, hi, f"end[{e.name}]")
            m.AddMaxEquality(end, [tv[s] for s in e.sinks])
            ends[e.name] = end
        size = m.NewIntVar(1, n, f"len[{e.name}]")
        iv = m.NewIntervalVar(start, size, end + 1, f"I[{e.name}]")
        intervals.append((e.name, iv, size))
        demands.append(e.size // unit)
    return intervals, demands, ends


def _hint_cumulative(m, graph: Graph, hint: list[str], tv, intervals, ends) -> None:
    """Hint steps, ends and interval lengths with the values of the ``hint`` order."""
    pos = {v: i for i, v in enumerate(hint)}
    for v, x in tv.items():
        m.AddHint(x, pos[v])
    live = lifetimes(graph, hint, check=False)
    for name, end in ends.items():
        m.AddHint(end, live[name][1])
    for name, _iv, size in intervals:
        a, b = live[name]
        m.AddHint(size, b - a + 1)


class _Compact:
    """Stages of the compact model: one step variable per node, a ``NoOverlap`` of unit
    intervals (one node per step), precedences; then a ``Cumulative`` of the tensor
    intervals of capacity ``peak``; the solution is read from the step variables."""

    def __init__(self, m, graph: Graph, span, unit: int):
        self.m, self.graph, self.span, self.unit = m, graph, span, unit
        self.tv = {v: m.NewIntVar(*span[v], f"t[{v}]") for v in graph.nodes}
        m.AddNoOverlap([m.NewFixedSizeIntervalVar(x, 1, f"u[{v}]")
                        for v, x in self.tv.items()])
        _add_precedences(m, graph, self.tv)

    def bound_memory(self, peak) -> None:
        self.intervals, demands, self.ends = _add_tensor_intervals(
            self.m, self.graph, self.span, self.tv, self.unit)
        self.m.AddCumulative([iv for _, iv, _ in self.intervals], demands, peak)

    def add_hint(self, hint: list[str]) -> None:
        _hint_cumulative(self.m, self.graph, hint, self.tv, self.intervals, self.ends)

    def solver_params(self) -> dict:
        # the presolve rediscovers the permutation and fully encodes every step variable
        # (|V| x span Booleans): keep the compact model
        return {"cp_model_presolve": False}

    def steps(self, solver) -> dict[str, int]:
        return {v: solver.Value(x) for v, x in self.tv.items()}


_FORMULATIONS = {"olla": _TimeIndexed, "cumulative": _Compact}


def solve_order_cumulative(graph: Graph, hint: Sequence[str] | None = None,
                           **options: Any) -> OrderResult:
    """The same problem as :func:`solve_order` in the compact scheduling form described in
    the module docstring (``NoOverlap`` of unit step intervals, precedences, one
    ``Cumulative`` of tensor intervals of capacity ``peak``). Its optimum equals eq. 14's;
    its size is ``O(|V| + |E|)`` instead of ``O(|E| * span)``, so it scales to thousands of
    nodes. ``solve_order(graph, hint, formulation="cumulative", **options)``.
    """
    return solve_order(graph, hint, formulation="cumulative", **options)
