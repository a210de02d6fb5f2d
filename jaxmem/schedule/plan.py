"""OLLA end to end: order the nodes, then place the tensors (paper section 4.4).

``optimize(graph)`` returns a :class:`Schedule`:

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
:func:`~jaxmem.schedule.bounds.structural_lower_bound`,
:func:`~jaxmem.schedule.bounds.cut_lower_bound` and
:func:`~jaxmem.schedule.bounds.antichain_lower_bound` (the solver's bound is not used
when early-update control edges restricted the search) — so ``peak - lower_bound`` is the
remaining gap.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time

import numpy as np

from .bounds import antichain_lower_bound, cut_lower_bound, structural_lower_bound
from .graph import Graph, OutOfTime
from .ilp import estimate_time_indexed_vars, solve_order
from .order import best_greedy_order, improve_order
from .place import check_placement, place
from .reach import Reach
from .relocate import relocate_blocks
from .simulate import lifetimes, memory_profile, simulate
from .updates import add_early_update_edges

__all__ = ["Schedule", "node_lower_bound", "optimize", "validate_plan"]


@dataclasses.dataclass
class Schedule:
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
    from .place import _check_seconds

    return _check_seconds(name, value)


# fraction of ``time_limit`` the ordering stages may use when a placement follows
_ORDER_SHARE = 0.7
# seconds per node + edge of building an ILP model in Python (a conservative estimate)
_ILP_BUILD_S = 1e-4
# (search, method suffix, share of the ordering budget, divisor of the time left)
_LOCAL_SEARCH = (improve_order, "+local", 0.1, 4)
_RELOCATION = (relocate_blocks, "+blocks", 0.3, 3)


def _check_optimize_args(graph, time_limit, formulation, gap_limit, place_time_limit,
                         num_workers):
    """Validated ``(time_limit, gap_limit, place_time_limit, num_workers)``."""
    if formulation not in ("auto", "olla", "cumulative"):
        raise ValueError(
            f"formulation: must be 'auto', 'olla' or 'cumulative', got {formulation!r}")
    if not isinstance(graph, Graph):
        raise TypeError(f"graph: expected a jaxmem.schedule.Graph, got {type(graph).__name__}")
    time_limit = _check_time("time_limit", time_limit)
    if (isinstance(gap_limit, (bool, np.bool_)) or not isinstance(gap_limit, numbers.Real)
            or not 0 <= gap_limit < 1):
        raise ValueError(f"gap_limit: must be a number in [0, 1), got {gap_limit!r}")
    if place_time_limit is not None:
        place_time_limit = _check_time("place_time_limit", place_time_limit)
    if (isinstance(num_workers, (bool, np.bool_))
            or not isinstance(num_workers, (int, np.integer)) or num_workers < 1):
        raise ValueError(f"num_workers: must be an int >= 1, got {num_workers!r}")
    return time_limit, float(gap_limit), place_time_limit, int(num_workers)


def _order_budget(time_limit: float, placement: bool) -> float:
    """Seconds for the ordering stages: ``_ORDER_SHARE`` of the limit when a placement
    follows, all of it otherwise."""
    return time_limit * (_ORDER_SHARE if placement else 1.0)


@dataclasses.dataclass
class _Search:
    """The best order so far, its peak, the best proven lower bound and the clock shared
    by the ordering stages."""

    graph: Graph
    work: Graph  # graph, or its early-update-restricted copy that the searches order
    t0: float
    order_limit: float  # seconds after t0 for the ordering stages
    gap_limit: float
    order: list[str]
    peak: int
    method: str
    lb: int
    found: list = dataclasses.field(default_factory=list)  # (peak, order, method) kept
    reach: Reach | None = None
    status: str = "skipped"
    num_vars: int = 0
    formulation: str = ""

    @property
    def work_reach(self) -> Reach | None:
        """``reach`` when it describes ``work`` (no control edges were added)."""
        return self.reach if self.work is self.graph else None

    def remaining(self) -> float:
        """Seconds left of the ordering budget."""
        return max(0.0, self.order_limit - (time.perf_counter() - self.t0))

    def within(self) -> bool:
        """``peak - lb <= gap_limit * peak`` (or ``peak <= lb``)."""
        return self.peak <= self.lb or (self.peak - self.lb) <= self.gap_limit * self.peak

    def keep(self, order: list[str], peak: int, method: str) -> None:
        """Adopt a better order and remember it for the placement."""
        self.order, self.peak, self.method = order, peak, method
        self.found.append((peak, order, method))


def _reach_and_structural_bound(s: _Search, topo: list[str], wanted: bool) -> None:
    """Build the reachability sets (within 40% of the budget) and raise ``lb`` with
    :func:`structural_lower_bound` unless the greedy order is already within the gap."""
    deadline = s.t0 + 0.4 * s.order_limit
    if wanted and not s.within():
        try:
            s.reach = Reach(s.graph, topo, deadline=deadline)
        except OutOfTime:
            s.reach = None
    if s.reach is not None and not s.within():
        s.lb = max(s.lb, structural_lower_bound(s.graph, s.reach, deadline=deadline))


def _search_stage(s: _Search, stage) -> bool:
    """Run one local search (``stage``: search, suffix, share, divisor) for
    ``min(share * budget, remaining / divisor)`` seconds; keep its order when it lowers
    the peak. False when it is skipped (gap reached, no time, or a big graph without
    reachability): the later searches are skipped too."""
    search, suffix, share, div = stage
    if s.within() or (s.reach is None and len(s.graph.nodes) > 2000):
        return False
    budget = min(share * s.order_limit, s.remaining() / div)
    if budget <= 0.01:
        return False
    order, peak = search(s.work, s.order, target=s.lb, time_budget=budget,
                         reach=s.work_reach)
    if peak < s.peak:
        s.keep(order, peak, s.method + suffix)
    return True


def _cut_bound_stage(s: _Search) -> None:
    """Raise ``lb`` with :func:`cut_lower_bound` (at most 25% of the budget)."""
    s.lb = max(s.lb, cut_lower_bound(s.graph, s.reach, floor=s.lb,
                                     time_budget=min(0.25 * s.order_limit, s.remaining() / 3)))


def _antichain_stage(s: _Search, budget: float) -> None:
    """Raise ``lb`` with antichains grown from the 30 top steps of the best order."""
    prof = memory_profile(s.graph, s.order, check=False)
    top = [s.order[t] for t in np.argsort(-prof, kind="stable")[:30]]
    s.lb = max(s.lb, antichain_lower_bound(
        s.graph, top, reach=s.reach, floor=s.lb, max_size=6, time_budget=budget,
        stop_at=math.ceil(s.peak * (1 - s.gap_limit))))


def _ilp_stage(s: _Search, formulation: str, num_workers: int, log: bool,
               early_updates: bool) -> None:
    """The ordering ILP, warm-started from the best order and bounded by ``[lb, peak]``,
    with the time left but 15% of the budget (skipped when building the model would not
    fit). Keeps a lower-peak order; its bound (or, when INFEASIBLE, the peak) raises
    ``lb`` unless early-update edges restricted the search."""
    left = s.remaining() - 0.15 * s.order_limit
    build_est = (len(s.graph.nodes) + len(s.graph.edges)) * _ILP_BUILD_S
    if len(s.graph.nodes) <= 1 or s.within() or left <= 0.05 or build_est >= 0.5 * left:
        return
    if formulation == "auto":
        small = estimate_time_indexed_vars(s.work, s.work_reach) <= 20000
        formulation = "olla" if small else "cumulative"
    res = solve_order(s.work, hint=s.order,
                      time_limit=max(0.05, s.remaining() - 0.15 * s.order_limit),
                      num_workers=num_workers, upper_bound=s.peak, lower_bound=s.lb, log=log,
                      relative_gap_limit=s.gap_limit, reach=s.work_reach,
                      formulation=formulation)
    s.status, s.num_vars, s.formulation = res.status, res.num_vars, formulation
    if res.objective is not None:
        p = simulate(s.graph, res.order)
        if p < s.peak:
            s.keep(res.order, p, "ilp")
    if not early_updates and res.status != "UNKNOWN":
        s.lb = max(s.lb, res.bound)
        if res.status == "INFEASIBLE":  # nothing below the hint's peak
            s.lb = max(s.lb, s.peak)


def _gap_status(s: _Search, default: str) -> str:
    """OPTIMAL when ``peak <= lb``, WITHIN_GAP within the gap limit, else ``default``."""
    return "OPTIMAL" if s.peak <= s.lb else "WITHIN_GAP" if s.within() else default


def _place_best(graph: Graph, found: list, end: float, num_workers: int):
    """Place the kept orders by increasing peak until one places without fragmentation
    or none can beat the smallest arena so far (the first gets 90% of the time left,
    the others 50%). Returns ``(arena, order, peak, method, edge names, offsets)``."""
    base = graph.persistent_bytes()
    best = None
    cands = sorted({tuple(o): (p, m) for p, o, m in found}.items(), key=lambda c: c[1][0])
    for k, (cand, (p_k, m_k)) in enumerate(cands):
        if best is not None and p_k >= best[0]:
            break  # cannot beat the arena already found
        left = end - time.perf_counter()
        if best is not None and left < 0.05:
            break
        live = lifetimes(graph, cand, check=False)
        names = list(live)
        sp = [(graph.edges[e].size, *live[e]) for e in names]
        info = place(sp, time_limit=max(0.05, left * (0.9 if k == 0 else 0.5)),
                     num_workers=num_workers, return_info=True)
        if best is None or base + info.arena_size < best[0]:
            best = (base + info.arena_size, list(cand), p_k, m_k, names, info.addresses)
        if best[0] == p_k:
            break  # zero fragmentation
    return best


def _arena_addresses(graph: Graph, names: list[str], offsets: list[int]) -> dict[str, int]:
    """Persistent tensors stacked from 0 in edge order; the placed ones above them."""
    addresses: dict[str, int] = {}
    off = 0
    for e in graph.edges.values():
        if e.persistent:
            addresses[e.name] = off
            off += e.size
    base = graph.persistent_bytes()
    for name, a in zip(names, offsets):
        addresses[name] = base + a
    return addresses


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
) -> Schedule:
    """Find a low-peak node order (and arena placement) for ``graph``.

    Time: the whole call (ordering and placement) returns within ``time_limit`` plus a
    linear-time overhead — validation, one simulation per kept order, the first
    placement (online best fit over time) and building the plan: about 1-2 s per 20,000
    nodes on one CPU core, plus up to ~0.5 s of CP-SAT overrun. A valid plan is kept
    from the start (program order, or Kahn's order, placed by the online best fit) and
    every stage only replaces it by a better one; a stage that runs out of time is cut
    and the best plan so far is returned (``optimal=False``).

    Args:
      graph: the :class:`Graph` to schedule (e.g. ``trace(step, *args).graph``).
      time_limit: seconds for the whole call: finite and > 0 (``inf``, NaN, bools and
        non-numbers raise ValueError; there is no "no limit" mode — pass a large
        number). Ordering stages use the first 70% (all of it when
        ``placement=False``): local search (at most 10%), block relocation (30%),
        min-cut bound (25%), a quick antichain bound (10%), the ILP with what is left
        but 15%, then the antichain bound again; every stage is skipped once the gap is
        within ``gap_limit``.
      placement: also compute arena addresses (eq. 15); otherwise ``addresses`` is empty
        and ``arena_size == peak`` is what a fragmentation-free allocator would need.
      place_time_limit: at most this many seconds for the placement (default: what is
        left of ``time_limit``; it never extends the call beyond ``time_limit``). When
        the best order cannot be placed without fragmentation, the orders found on the way
        whose peak is below that arena are placed too (in the same time) and the smallest
        arena wins; ``peak``/``order`` are then that order's.
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
      num_workers: CP-SAT worker threads (an int >= 1).
      log: print CP-SAT's search log.

    When CP-SAT finds no order in time (status ``"UNKNOWN"``), the plan is the best
    order of the other stages (``method`` names it) with the bounds they proved.

    Returns:
      A :class:`Schedule`: ``order`` (a topological node order), its ``peak``, the arena
      ``addresses`` and ``arena_size``, the proven ``lower_bound`` and ``optimal``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem import schedule
      >>> def step(w, x):
      ...     return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
      >>> traced = schedule.trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> plan = schedule.optimize(traced.graph, time_limit=2.0)
      >>> len(plan.order) == len(traced.graph.nodes)
      True
      >>> plan.lower_bound <= plan.peak <= plan.arena_size
      True
    """
    time_limit, gap_limit, place_time_limit, num_workers = _check_optimize_args(
        graph, time_limit, formulation, gap_limit, place_time_limit, num_workers)
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    order_limit = _order_budget(time_limit, placement)
    topo = graph.topological_order()  # GraphError naming a cycle
    try:
        baseline = simulate(graph, graph.program_order)
    except ValueError:
        baseline = None
    work = add_early_update_edges(graph) if early_updates else graph

    # 1. warm start; lower bounds hold for every order of the *original* graph, hence
    # also for the early-update-restricted one
    g_order, g_peak, g_rule = best_greedy_order(work, deadline=t0 + 0.25 * order_limit)
    s = _Search(graph, work, t0, order_limit, gap_limit, g_order, g_peak, g_rule,
                node_lower_bound(graph), found=[(g_peak, g_order, g_rule)])
    _reach_and_structural_bound(s, topo, wanted=use_ilp or local_search)
    # 2. search first (it is what lowers the peak), then the bounds that prove it
    if use_ilp and local_search and _search_stage(s, _LOCAL_SEARCH):
        _search_stage(s, _RELOCATION)
    exact = use_ilp and s.reach is not None
    if exact and not s.within() and s.remaining() > 0.05:
        _cut_bound_stage(s)
    if exact and not s.within() and s.remaining() > 0.05:
        _antichain_stage(s, min(0.1 * order_limit, s.remaining() / 3))  # often a proof
    # 3. the ILP, then a last antichain pass seeded at the final order's peak steps
    if exact:
        _ilp_stage(s, formulation, num_workers, log, early_updates)
    if exact and not s.within() and s.remaining() > 0.05:
        _antichain_stage(s, s.remaining())
    if use_ilp:
        s.status = _gap_status(s, s.status)
    s.lb = min(s.lb, s.peak)
    order_s = time.perf_counter() - t0

    # 4. placement: an earlier order with a higher peak may need a smaller arena
    addresses: dict[str, int] = {}
    arena = s.peak
    if placement:
        t_place = time.perf_counter()
        end = deadline if place_time_limit is None else min(deadline, t_place + place_time_limit)
        arena, s.order, p_best, s.method, names, offsets = _place_best(
            graph, s.found, end, num_workers)
        if p_best != s.peak:  # a higher-peak order with a smaller arena won
            s.peak = p_best
            s.status = _gap_status(s, "FEASIBLE")
        addresses = _arena_addresses(graph, names, offsets)
    total = time.perf_counter() - t0
    return Schedule(
        order=list(s.order), peak=int(s.peak), addresses=addresses, arena_size=int(arena),
        lower_bound=int(s.lb), optimal=bool(s.peak == s.lb and arena == s.peak),
        solve_seconds=total, baseline_peak=baseline, greedy_peak=int(g_peak),
        method=s.method, status=s.status, order_seconds=order_s,
        place_seconds=total - order_s, num_vars=s.num_vars,
        formulation=s.formulation if s.num_vars else "",
    )


def validate_plan(graph: Graph, plan: Schedule) -> None:
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
