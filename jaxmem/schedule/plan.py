"""OLLA end to end: order the nodes, then place the tensors (paper section 4.4).

``optimize(graph)`` returns a :class:`Plan`:

1. warm start — the best greedy order (:mod:`jaxmem.schedule.order`), always available;
2. local search and bounds — local search around the peak step
   (:func:`~jaxmem.schedule.order.improve_order`), block relocation
   (:func:`~jaxmem.schedule.relocate.relocate_blocks`), the min-cut bound, then a quick
   antichain bound seeded at the new order's peak steps;
3. ordering — the ILP of eq. 14 (:mod:`jaxmem.schedule.ilp`) with CP-SAT, anytime,
   warm-started from (2) and bounded above by its peak, then a last antichain pass; every
   stage is skipped once the gap is within the limit;
4. placement — eq. 15 (:func:`jaxmem.schedule.place.place`) for the lifetimes the order
   implies; persistent tensors sit at the bottom of the arena.

The plan's ``lower_bound`` is a proven lower bound of the best peak of *any* order of
the given graph — the largest of the solver's bound,
:func:`~jaxmem.schedule.analysis.structural_lower_bound`,
:func:`~jaxmem.schedule.analysis.cut_lower_bound` and
:func:`~jaxmem.schedule.analysis.antichain_lower_bound` (the solver's bound is not used
when early-update control edges restricted the search) — so ``peak - lower_bound`` is the
remaining gap.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from .analysis import (
    add_early_update_edges,
    antichain_lower_bound,
    cut_lower_bound,
    structural_lower_bound,
)
from .graph import Graph
from .ilp import estimate_time_indexed_vars, solve_order, solve_order_cumulative
from .order import best_greedy_order, improve_order
from .place import best_fit_online, check_placement, place
from .relocate import relocate_blocks
from .simulate import lifetimes, memory_profile, simulate

__all__ = ["Plan", "node_lower_bound", "optimize", "validate_plan"]


@dataclasses.dataclass
class Plan:
    """Result of :func:`optimize`.

    Attributes:
      order: node names, one per step (a topological order).
      peak: peak resident bytes of ``order`` (persistent tensors included).
      addresses: edge name -> byte offset in the arena (every edge; size-0 at 0).
      arena_size: bytes of the arena; equals ``peak`` when there is no fragmentation.
      lower_bound: proven lower bound of the optimal peak.
      optimal: ``peak == lower_bound`` (order proven optimal) and arena == peak.
      solve_seconds: wall time of the whole optimisation.
      baseline_peak: peak of the program order (None if it is not topological).
      greedy_peak: peak of the best greedy order (the fallback).
      method: which stage produced the order ("ilp", or the greedy rule's name).
      status: CP-SAT's status for the ordering problem ("skipped" when not run).
    """

    order: list[str]
    peak: int
    addresses: dict[str, int]
    arena_size: int
    lower_bound: int
    optimal: bool
    solve_seconds: float
    baseline_peak: int | None = None
    greedy_peak: int | None = None
    method: str = ""
    status: str = ""
    order_seconds: float = 0.0
    place_seconds: float = 0.0
    num_vars: int = 0
    formulation: str = ""

    @property
    def gap(self) -> float:
        """Relative gap ``(peak - lower_bound) / peak``."""
        return (self.peak - self.lower_bound) / self.peak if self.peak else 0.0

    @property
    def fragmentation(self) -> float:
        return (self.arena_size - self.peak) / self.arena_size if self.arena_size else 0.0

    @property
    def reduction(self) -> float | None:
        """``1 - peak / baseline_peak``."""
        if not self.baseline_peak:
            return None
        return 1.0 - self.peak / self.baseline_peak


def node_lower_bound(graph: Graph) -> int:
    """``persistent + max_v (inputs(v) + outputs(v))``: every order needs at least this."""
    best = 0
    for v in graph.nodes:
        es = set(graph.fanin(v)) | set(graph.fanout(v))
        best = max(best, sum(graph.edges[e].size for e in es if not graph.edges[e].persistent))
    return best + graph.persistent_bytes()


def _check_time(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")
    return float(value)


def optimize(
    graph: Graph,
    time_limit: float = 10.0,
    placement: bool = True,
    *,
    place_time_limit: float | None = None,
    early_updates: bool = False,
    use_ilp: bool = True,
    formulation: str = "auto",
    num_workers: int = 2,
    gap_limit: float = 0.01,
    local_search: bool = True,
    log: bool = False,
) -> Plan:
    """Find a low-peak node order (and arena placement) for ``graph``.

    Args:
      time_limit: seconds for the whole ordering stage (> 0): local search (at most 10%
        of it), block relocation (30%), min-cut bound (25%), a quick antichain bound (10%),
        the ILP with what is left but 15%, then the antichain bound again. Every stage is
        anytime: when time runs out the best order found so far is returned with
        ``optimal=False``.
      placement: also compute arena addresses (eq. 15); otherwise ``addresses`` is empty
        and ``arena_size == peak`` is what a fragmentation-free allocator would need.
      place_time_limit: seconds for the placement (default ``time_limit``). When the best
        order cannot be placed without fragmentation, the orders found on the way whose
        peak is below that arena are placed too (in the same time) and the smallest arena
        wins; ``peak``/``order`` are then that order's.
      early_updates: add the paper's early-weight-update control edges (section 4.3) to
        nodes of kind ``"update"`` before solving (faster, but restricts the search; the
        reported lower bound then falls back to :func:`node_lower_bound`).
      use_ilp: False returns the greedy plan without calling the solver.
      gap_limit: stop as soon as ``(peak - lower_bound) / peak <= gap_limit`` (default
        1%, the paper's "within 1% of optimal"; 0 searches until proven optimal or out of
        time). ``optimal`` is only True when the gap is 0.
      local_search: improve the greedy warm start with
        :func:`jaxmem.schedule.order.improve_order` and
        :func:`jaxmem.schedule.relocate.relocate_blocks` before the ILP.
      formulation: ``"olla"`` (the paper's time-indexed C/P model, eq. 14),
        ``"cumulative"`` (the same problem as integer steps + a cumulative constraint,
        compact for big graphs) or ``"auto"`` (olla up to 20 000 C/P variables).
    """
    if formulation not in ("auto", "olla", "cumulative"):
        raise ValueError(
            f"formulation: must be 'auto', 'olla' or 'cumulative', got {formulation!r}")
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a jaxmem.schedule.Graph, got {type(graph).__name__}")
    time_limit = _check_time("time_limit", time_limit)
    if (isinstance(gap_limit, bool) or not isinstance(gap_limit, (int, float))
            or not 0 <= gap_limit < 1):
        raise ValueError(f"gap_limit: must be a number in [0, 1), got {gap_limit!r}")
    place_time_limit = _check_time(
        "place_time_limit", time_limit if place_time_limit is None else place_time_limit
    )
    t0 = time.perf_counter()
    graph.validate()
    try:
        baseline = simulate(graph, graph.program_order)
    except ValueError:
        baseline = None
    work = add_early_update_edges(graph) if early_updates else graph
    g_order, g_peak, g_rule = best_greedy_order(work)
    greedy_peak = g_peak
    order, peak, method, status, num_vars = g_order, g_peak, g_rule, "skipped", 0
    found = [(g_peak, g_order, g_rule)]  # every order each stage returned (for placement)
    # lower bounds hold for every order of the *original* graph, hence also for the
    # early-update-restricted one
    lb = max(node_lower_bound(graph), structural_lower_bound(graph))

    def within(p: int, b: int) -> bool:
        return p <= b or (p - b) <= gap_limit * p

    def remaining() -> float:
        return max(0.0, time_limit - (time.perf_counter() - t0))

    # search first (it is what lowers the peak), then the bounds that prove it
    searches = ((improve_order, "+local", 0.1, 4), (relocate_blocks, "+blocks", 0.3, 3))
    for search, suffix, share, div in searches if use_ilp and local_search else ():
        if within(peak, lb):
            break
        s_order, s_peak = search(work, order, target=lb,
                                 time_budget=min(share * time_limit, remaining() / div))
        if s_peak < peak:
            order, peak, method = s_order, s_peak, method + suffix
            found.append((peak, order, method))

    def antichain(budget: float) -> None:
        """Raise ``lb`` with antichains grown from the top steps of the best order."""
        nonlocal lb
        prof = memory_profile(graph, order, check=False)
        top = [order[t] for t in np.argsort(-prof, kind="stable")[:30]]
        lb = max(lb, antichain_lower_bound(graph, top, floor=lb, max_size=6, time_budget=budget,
                                           stop_at=math.ceil(peak * (1 - gap_limit))))

    if use_ilp and not within(peak, lb):
        lb = max(lb, cut_lower_bound(graph, time_budget=min(0.25 * time_limit, remaining() / 3)))
    if use_ilp and not within(peak, lb):
        antichain(min(0.1 * time_limit, remaining() / 3))  # a quick pass: often a proof
    left = remaining() - 0.15 * time_limit  # keep some time for a last antichain pass
    if use_ilp and len(graph.nodes) > 1 and not within(peak, lb) and left > 0.05:
        if formulation == "auto":
            formulation = "olla" if estimate_time_indexed_vars(work) <= 20000 else "cumulative"
        solver_fn = solve_order if formulation == "olla" else solve_order_cumulative
        res = solver_fn(work, hint=order, time_limit=left, num_workers=num_workers,
                        upper_bound=peak, lower_bound=lb, log=log,
                        relative_gap_limit=gap_limit)
        status, num_vars = res.status, res.num_vars
        if res.order:
            p = simulate(graph, res.order)
            if p < peak:
                order, peak, method = res.order, p, "ilp"
                found.append((peak, order, method))
        if not early_updates and res.status != "UNKNOWN":
            lb = max(lb, res.bound)
            if res.status == "INFEASIBLE":  # nothing below the hint's peak
                lb = max(lb, peak)
    if use_ilp and not within(peak, lb) and remaining() > 0.05:
        antichain(remaining())  # seeded at the final order's peak steps
    if use_ilp and peak <= lb:
        status = "OPTIMAL"
    elif use_ilp and within(peak, lb):
        status = "WITHIN_GAP"
    lb = min(lb, peak)
    order_s = time.perf_counter() - t0
    addresses: dict[str, int] = {}
    arena = peak
    place_optimal = True
    if placement:
        # the arena is what an allocation needs: when the best order cannot be placed
        # without fragmentation, an earlier order whose peak is below that arena may do
        # better (candidates by increasing peak; each gets part of the remaining time)
        base = graph.persistent_bytes()
        t_place = time.perf_counter()
        best = None
        cands = sorted({tuple(o): (p, m) for p, o, m in found}.items(), key=lambda c: c[1][0])
        for k, (cand, (p_k, m_k)) in enumerate(cands):
            if best is not None and p_k >= best[0]:
                break  # cannot beat the arena already found
            left = place_time_limit - (time.perf_counter() - t_place)
            if best is not None and left < 0.05:
                break
            spans = lifetimes(graph, cand)
            names = list(spans)
            sp = [(graph.edges[k2].size, *spans[k2]) for k2 in names]
            info = place(sp, time_limit=max(0.05, left * (0.6 if k == 0 else 0.5)),
                         num_workers=num_workers, return_info=True)
            if best is None or base + info.arena_size < best[0]:
                best = (base + info.arena_size, list(cand), p_k, m_k, names, info.addresses)
            if best[0] == p_k:
                break  # zero fragmentation
        arena, order, p_best, method, names, addrs = best
        if p_best != peak:  # a higher-peak order with a smaller arena won
            peak = p_best
            status = ("OPTIMAL" if peak <= lb else "WITHIN_GAP" if within(peak, lb)
                      else "FEASIBLE")
        off = 0
        for e in graph.edges.values():
            if e.persistent:
                addresses[e.name] = off
                off += e.size
        for k2, a in zip(names, addrs):
            addresses[k2] = base + a
        place_optimal = arena == peak
    total = time.perf_counter() - t0
    return Plan(
        order=list(order), peak=int(peak), addresses=addresses, arena_size=int(arena),
        lower_bound=int(lb), optimal=bool(peak == lb and place_optimal),
        solve_seconds=total, baseline_peak=baseline, greedy_peak=int(greedy_peak), method=method,
        status=status, order_seconds=order_s, place_seconds=total - order_s,
        num_vars=num_vars, formulation=formulation if num_vars else "",
    )


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise ValueError unless ``plan.order`` is topological, ``plan.peak`` is its
    simulated peak, and (when placed) no two co-live tensors overlap in the arena."""
    graph.check_order(plan.order)
    p = simulate(graph, plan.order)
    if p != plan.peak:
        raise ValueError(f"plan.peak {plan.peak} != simulated peak {p}")
    if plan.lower_bound > plan.peak:
        raise ValueError("plan.lower_bound exceeds plan.peak")
    if plan.addresses:
        spans = lifetimes(graph, plan.order)
        n = len(plan.order)
        names = [e for e in graph.edges]
        sp = []
        addrs = []
        for e in names:
            ed = graph.edges[e]
            a, b = (0, n - 1) if ed.persistent else spans[e]
            sp.append((ed.size, a, b))
            addrs.append(plan.addresses[e])
            if plan.addresses[e] + ed.size > plan.arena_size:
                raise ValueError(f"edge {e!r} placed beyond the arena")
        check_placement(sp, addrs)


def fragmentation_best_fit(graph: Graph, order: Sequence[str]) -> tuple[int, float]:
    """Arena high-water and fragmentation of an online best-fit allocator on ``order``
    (persistent tensors allocated first)."""
    spans = lifetimes(graph, order)
    n = len(order)
    sp = [(e.size, -1, n) for e in graph.edges.values() if e.persistent]
    # program creation order for allocation within a step: edges in fanout order
    sp += [(graph.edges[k].size, *spans[k]) for k in spans]
    mr, _rs, frag = best_fit_online(sp)
    return mr, frag
