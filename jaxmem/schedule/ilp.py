"""The node-ordering ILP of OLLA (eq. 14), solved with OR-Tools CP-SAT.

Variables (section 3.2), restricted by the spans of section 4.1:

* ``C_{v,t}`` — node ``v`` runs at step ``t`` (only for ``t in SPAN(v)``). The paper has one
  ``C_{e,t}`` per tensor and ties siblings together (eq. 5); we keep one per node, which is
  the same thing with eq. 5 substituted.
* ``P_{e,t}`` — tensor ``e`` is preserved (kept from an earlier step) at ``t``; only for
  ``t in MUL(e)``, fixed to 1 on ``PRES(e)`` (eqs. 11, 12); none for persistent tensors
  (constant) or size-0 control edges (they only order nodes, see below).

Constraints:

* (3)  ``sum_t C_{v,t} = 1`` — every node runs once;
* one node per step: ``sum_v C_{v,t} = 1`` (sequential execution; the paper allows
  concurrent nodes — a sequential order is never worse, and this makes the tight spans of
  :func:`jaxmem.schedule.analysis.spans` exact);
* (2)  ``P_{e,t} <= P_{e,t-1} + C_{src(e),t-1}`` — preserved only if created or preserved
  the step before; for outputs it is an equality (kept until the end);
* (1)  ``P_{e,t} + C_{src(e),t} <= 1`` is implied by (2), (3) and is not added;
* (4)  ``C_{v,t} <= P_{f,t}`` for every input ``f`` of ``v`` — inputs are resident;
  for control edges ``time(src) < time(v)`` with ``time(v) = sum_t t C_{v,t}``
  (added for every edge: it helps propagation);
* (13) ``sum_v C_{v,t} out(v) + sum_e S_e P_{e,t} + persistent <= peak``;

objective ``min peak``. The greedy order is given as a complete solution hint (warm
start) and the solver is anytime: on its time limit it returns the best order found
with its proven lower bound.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from .analysis import Reach, edge_ranges, spans
from .graph import Graph
from .simulate import lifetimes

__all__ = ["OrderResult", "estimate_time_indexed_vars", "solve_order", "solve_order_cumulative"]


@dataclasses.dataclass
class OrderResult:
    order: list[str]
    objective: int | None  # solver's objective for its order (an upper bound of the peak)
    bound: int  # proven lower bound of the optimal peak of the model's graph
    status: str  # OPTIMAL / FEASIBLE / UNKNOWN / INFEASIBLE / MODEL_INVALID
    seconds: float
    num_vars: int


def solve_order(
    graph: Graph,
    hint: Sequence[str] | None = None,
    time_limit: float = 10.0,
    num_workers: int = 2,
    upper_bound: int | None = None,
    log: bool = False,
    lower_bound: int | None = None,
    relative_gap_limit: float = 0.0,
) -> OrderResult:
    """Solve eq. 14 for ``graph``; ``hint`` is a topological order used as warm start."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    reach = Reach(graph)
    span = spans(graph, reach)
    ranges = edge_ranges(graph, span)
    n = len(graph.nodes)
    persistent = graph.persistent_bytes()

    # scale sizes by their gcd (bytes of f32 tensors are multiples of 4 at least)
    sizes = [e.size for e in graph.edges.values() if not e.persistent and e.size > 0]
    g = math.gcd(*sizes) or 1  # solver byte unit (f32 sizes are multiples of 4)

    m = cp_model.CpModel()
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
    # one node per step
    by_step: dict[int, list] = {t: [] for t in range(n)}
    for v, d in C.items():
        for t, x in d.items():
            by_step[t].append(x)
    for t, xs in by_step.items():
        if all(isinstance(x, int) for x in xs):
            continue
        consts = sum(1 for x in xs if isinstance(x, int))
        m.Add(sum(x for x in xs if not isinstance(x, int)) == 1 - consts)
    # time variables and precedence for every edge
    tvar = {}
    for v, d in C.items():
        if len(d) == 1:
            tvar[v] = next(iter(d))
        else:
            tv = m.NewIntVar(min(d), max(d), f"t[{v}]")
            m.Add(tv == sum(t * x for t, x in d.items()))
            tvar[v] = tv
    for e in graph.edges.values():
        for s in e.sinks:
            m.Add(tvar[s] >= tvar[e.src] + 1) if not (
                isinstance(tvar[s], int) and isinstance(tvar[e.src], int)
            ) else None

    def Cvt(v: str, t: int):
        return C[v].get(t, 0)

    # P variables for tensors that occupy memory
    P: dict[str, dict[int, object]] = {}
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        (mul_a, mul_b), (pres_a, pres_b) = ranges[e.name]
        d: dict[int, object] = {}
        for t in range(mul_a + 1, mul_b + 1):
            if pres_a <= t <= pres_b:
                d[t] = 1
            else:
                d[t] = m.NewBoolVar(f"P[{e.name},{t}]")
        P[e.name] = d
        for t, p in d.items():
            prev = d.get(t - 1, 0)
            rhs = [x for x in (prev, Cvt(e.src, t - 1)) if not isinstance(x, int)]
            const = sum(x for x in (prev, Cvt(e.src, t - 1)) if isinstance(x, int))
            if isinstance(p, int):
                # forced preservation (PRES): it must have been created or kept before
                if rhs and const == 0:
                    m.Add(sum(rhs) >= 1)
                continue
            if e.output:
                m.Add(p == sum(rhs) + const)
            elif const == 0:
                m.Add(p <= sum(rhs))
        # eq. 4 for readers
        for s in e.sinks:
            for t, x in C[s].items():
                if isinstance(x, int):
                    continue
                p = d.get(t, 0)
                if isinstance(p, int):
                    if p == 0:
                        m.Add(x == 0)
                    continue
                m.AddImplication(x, p)

    # eq. 13: peak
    out_bytes = {
        v: sum(graph.edges[e].size for e in graph.fanout(v)
               if not graph.edges[e].persistent) // g
        for v in graph.nodes
    }
    total = sum(sizes) // g
    if upper_bound is not None:
        ub = max(0, (upper_bound - persistent) // g)
        total = min(total, ub)
    lo = 0
    if lower_bound is not None:
        lo = min(max(0, -(-(lower_bound - persistent) // g)), max(total, 0))
    peak = m.NewIntVar(lo, max(total, 0), "peak")
    step_terms: dict[int, list] = {t: [] for t in range(n)}
    step_const = [0] * n
    for v, d in C.items():
        if out_bytes[v] == 0:
            continue
        for t, x in d.items():
            if isinstance(x, int):
                step_const[t] += out_bytes[v] * x
            else:
                step_terms[t].append(out_bytes[v] * x)
    for name, d in P.items():
        sz = graph.edges[name].size // g
        for t, p in d.items():
            if isinstance(p, int):
                step_const[t] += sz * p
            else:
                step_terms[t].append(sz * p)
    for t in range(n):
        if step_terms[t]:
            m.Add(sum(step_terms[t]) + step_const[t] <= peak)
        else:
            m.Add(peak >= step_const[t])
    m.Minimize(peak)

    # warm start from the hint order
    if hint is not None:
        pos = {v: i for i, v in enumerate(hint)}
        for v, d in C.items():
            for t, x in d.items():
                if not isinstance(x, int):
                    m.AddHint(x, 1 if pos[v] == t else 0)
        spans_h = lifetimes(graph, hint, check=False)
        for name, d in P.items():
            a, b = spans_h[name]
            for t, p in d.items():
                if not isinstance(p, int):
                    m.AddHint(p, 1 if a < t <= b else 0)
        for v, tv in tvar.items():
            if not isinstance(tv, int):
                m.AddHint(tv, pos[v])
        from .simulate import simulate as _sim

        hp = -(-(_sim(graph, hint) - persistent) // g)
        if 0 <= hp <= max(total, 0):
            m.AddHint(peak, hp)

    num_vars_est = len(m.Proto().variables)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.log_search_progress = bool(log)
    solver.parameters.relative_gap_limit = float(relative_gap_limit)
    # big time-indexed models: CP-SAT's probing/symmetry presolve costs seconds per round
    # and does not pay off here; search from the warm start instead
    if num_vars_est > 5000:
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.symmetry_level = 0
    build_s = time.perf_counter() - t0
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit) - build_s)
    status = solver.Solve(m)
    name = solver.StatusName(status)
    num_vars = len(m.Proto().variables)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        steps = {}
        for v, d in C.items():
            if len(d) == 1:
                steps[v] = next(iter(d))
            else:
                steps[v] = next(t for t, x in d.items() if solver.Value(x))
        topo_idx = reach.index
        order = sorted(graph.nodes, key=lambda v: (steps[v], topo_idx[v]))
        obj = round(solver.ObjectiveValue()) * g + persistent
        # with a relative gap limit CP-SAT reports OPTIMAL when the gap is reached: keep
        # its proven bound, not the objective
        bound = min(obj, math.ceil(solver.BestObjectiveBound() - 1e-6) * g + persistent)
        if status == cp_model.OPTIMAL and relative_gap_limit == 0:
            bound = obj
        if bound < obj and name == "OPTIMAL":
            name = "WITHIN_GAP"
        return OrderResult(order, obj, bound, name, time.perf_counter() - t0, num_vars)
    bound = persistent
    if status == cp_model.INFEASIBLE and upper_bound is not None:
        bound = upper_bound  # nothing strictly better than the upper bound exists
    return OrderResult(list(hint) if hint else [], None, bound, name,
                       time.perf_counter() - t0, num_vars)


def estimate_time_indexed_vars(graph: Graph) -> int:
    """Number of C and P variables the time-indexed model of eq. 14 would create."""
    span = spans(graph)
    ranges = edge_ranges(graph, span)
    total = sum(b - a + 1 for a, b in span.values() if b > a)
    for e in graph.edges.values():
        if e.persistent or e.size == 0:
            continue
        (ma, mb), (pa, pb) = ranges[e.name]
        free = (mb - ma) - max(0, min(pb, mb) - max(pa, ma + 1) + 1)
        total += max(0, free)
    return total


def solve_order_cumulative(
    graph: Graph,
    hint: Sequence[str] | None = None,
    time_limit: float = 10.0,
    num_workers: int = 2,
    upper_bound: int | None = None,
    log: bool = False,
    lower_bound: int | None = None,
    relative_gap_limit: float = 0.0,
) -> OrderResult:
    """The same problem as :func:`solve_order` in a compact scheduling form that scales
    to thousands of nodes: one integer step ``t_v in SPAN(v)`` per node,
    ``AllDifferent(t)`` (one node per step), ``t_src + 1 <= t_snk`` per edge, and one
    interval ``[t_src(e), max_s t_s]`` per tensor in a ``Cumulative`` constraint of
    capacity ``peak`` (the resident-set bound of eq. 13). Its optimum equals eq. 14's;
    only its size is ``O(|V| + |E|)`` instead of ``O(|E| * span)``.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    reach = Reach(graph)
    span = spans(graph, reach)
    n = len(graph.nodes)
    persistent = graph.persistent_bytes()
    sizes = [e.size for e in graph.edges.values() if not e.persistent and e.size > 0]
    g = math.gcd(*sizes) or 1  # solver byte unit (f32 sizes are multiples of 4)
    m = cp_model.CpModel()
    tv = {}
    for v in graph.nodes:
        a, b = span[v]
        tv[v] = m.NewIntVar(a, b, f"t[{v}]")
    # one node per step: unit intervals that may not overlap (AllDifferent would be
    # expanded into a quadratic Boolean encoding by the presolve)
    m.AddNoOverlap([m.NewFixedSizeIntervalVar(x, 1, f"u[{v}]") for v, x in tv.items()])
    for e in graph.edges.values():
        for s in e.sinks:
            m.Add(tv[s] >= tv[e.src] + 1)
    total = sum(sizes) // g
    if upper_bound is not None:
        total = min(total, max(0, (upper_bound - persistent) // g))
    lo = 0
    if lower_bound is not None:
        lo = min(max(0, -(-(lower_bound - persistent) // g)), max(total, 0))
    peak = m.NewIntVar(lo, max(total, 0), "peak")
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
        demands.append(e.size // g)
    m.AddCumulative([iv for _, iv, _ in intervals], demands, peak)
    m.Minimize(peak)
    if hint is not None:
        pos = {v: i for i, v in enumerate(hint)}
        for v, x in tv.items():
            m.AddHint(x, pos[v])
        lt = lifetimes(graph, hint, check=False)
        for name, end in ends.items():
            m.AddHint(end, lt[name][1])
        for name, _iv, size in intervals:
            a, b = lt[name]
            m.AddHint(size, b - a + 1)
        from .simulate import simulate as _sim

        hp = -(-(_sim(graph, hint) - persistent) // g)
        if 0 <= hp <= max(total, 0):
            m.AddHint(peak, hp)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.log_search_progress = bool(log)
    solver.parameters.relative_gap_limit = float(relative_gap_limit)
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit) - (time.perf_counter() - t0))
    # the presolve rediscovers the permutation and fully encodes every step variable
    # (|V| x span Booleans): keep the compact model
    solver.parameters.cp_model_presolve = False
    status = solver.Solve(m)
    name = solver.StatusName(status)
    num_vars = len(m.Proto().variables)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        order = sorted(graph.nodes, key=lambda v: (solver.Value(tv[v]), reach.index[v]))
        obj = round(solver.ObjectiveValue()) * g + persistent
        # with a relative gap limit CP-SAT reports OPTIMAL when the gap is reached: keep
        # its proven bound, not the objective
        bound = min(obj, math.ceil(solver.BestObjectiveBound() - 1e-6) * g + persistent)
        if status == cp_model.OPTIMAL and relative_gap_limit == 0:
            bound = obj
        if bound < obj and name == "OPTIMAL":
            name = "WITHIN_GAP"
        return OrderResult(order, obj, bound, name, time.perf_counter() - t0, num_vars)
    bound = persistent
    if status == cp_model.INFEASIBLE and upper_bound is not None:
        bound = upper_bound
    return OrderResult(list(hint) if hint else [], None, bound, name,
                       time.perf_counter() - t0, num_vars)
