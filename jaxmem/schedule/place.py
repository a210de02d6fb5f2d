"""Tensor placement in one arena (OLLA eq. 15) and an online best-fit allocator.

Given fixed lifetimes — ``(size, first step, last step)`` per tensor, inclusive — choose
an offset ``A_e`` per tensor so that tensors resident at a common step never overlap
(eqs. 6, 7a, 7b) and the arena ``max_e A_e + S_e`` (eq. 8) is minimal. The arena can
never be smaller than ``max_t sum_{e live at t} S_e`` (the peak resident set); an arena
equal to it has *zero fragmentation*.

Method, cheapest first (every stage keeps the best placement so far and stops once the
arena equals the peak or the time limit is reached):

0. a first plan, always made: online best fit over time (``O(n log n)`` in practice);
1. offline heuristics — *greedy by size* (largest first, each at the best-fitting gap
   among the time-overlapping tensors already placed) and the paper's *pyramid
   pre-placement* of long-lived tensors (Function 5) followed by greedy by size;
   if one reaches the peak it is optimal and we stop;
2. window decomposition — only the steps close to the peak are tight: the tensors alive
   there are placed exactly by CP-SAT with the arena fixed at the peak, the rest around
   them by the greedy rules, widening the window until the completion fits;
3. otherwise CP-SAT with ``NoOverlap2D`` over (time, address) rectangles — pairs whose
   lifetimes do not intersect are never constrained (the precedence pruning of section
   4.2 is implicit) — warm-started from the best heuristic placement, anytime.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import operator
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .graph import OutOfTime as _OutOfTime
from .graph import check_size

__all__ = ["Placement", "best_fit_online", "check_placement", "peak_of_spans", "place"]

Span = tuple[int, int, int]  # (size, first, last)


@dataclasses.dataclass
class Placement:
    addresses: list[int]
    arena_size: int
    lower_bound: int
    optimal: bool
    method: str
    seconds: float


def _step(where: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: steps must be ints, got {value!r} of type "
                        f"{type(value).__name__}")
    return operator.index(value)


def _normalize(spans) -> tuple[list, list[Span]]:
    """Validate ``spans`` (sizes: Python/numpy ints >= 0; steps: ints, last >= first)."""
    if isinstance(spans, Mapping):
        keys = list(spans)
        vals = [spans[k] for k in keys]
    elif isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise TypeError(f"spans: expected a sequence or mapping of (size, first_step, "
                        f"last_step), got {spans!r}")
    else:
        keys = None
        vals = list(spans)
    out = []
    for i, sp in enumerate(vals):
        where = f"spans[{keys[i] if keys else i!r}]"
        try:
            size, a, b = sp
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: expected (size, first_step, last_step), got {sp!r}"
            ) from None
        size = check_size(where, size)
        a, b = _step(where, a), _step(where, b)
        if b < a:
            raise ValueError(f"{where}: last step {b} is before first step {a}")
        out.append((size, a, b))
    return keys, out


def _resident_profile(spans: Sequence[Span]) -> tuple[int, np.ndarray]:
    """``(lo, r)`` with ``r[t - lo]`` = bytes resident at step ``t`` (spans non-empty)."""
    lo = min(a for _, a, _ in spans)
    hi = max(b for _, _, b in spans)
    diff = np.zeros(hi - lo + 2, dtype=np.int64)
    for s, a, b in spans:
        diff[a - lo] += s
        diff[b - lo + 1] -= s
    return lo, np.cumsum(diff)


def peak_of_spans(spans: Sequence[Span]) -> int:
    """``max_t`` of the bytes resident at step ``t`` (the placement lower bound)."""
    spans = _normalize(spans)[1]
    if not spans:
        return 0
    return int(_resident_profile(spans)[1].max())


def _peak_step(spans: Sequence[Span]) -> int:
    """A step where the resident bytes are maximal."""
    if not spans:
        return 0
    lo, resident = _resident_profile(spans)
    return int(np.argmax(resident)) + lo


def _overlap(x: Span, y: Span) -> bool:
    return x[1] <= y[2] and y[1] <= x[2]


def _pack(spans: list[Span], order: Sequence[int], fixed: dict[int, int] | None,
          best_fit: bool, deadline: float | None):
    """Place tensors in ``order`` among the already-placed tensors live at the same time
    (numpy over the placed set): best fit takes the smallest gap that fits, first fit the
    lowest; else on top. ``_OutOfTime`` past ``deadline``."""
    n = len(spans)
    size = np.fromiter((x[0] for x in spans), dtype=np.int64, count=n)
    first = np.fromiter((x[1] for x in spans), dtype=np.int64, count=n)
    last = np.fromiter((x[2] for x in spans), dtype=np.int64, count=n)
    addr = np.zeros(n, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    pa, pb = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    plo, phi = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    k = 0
    for i, x in (fixed or {}).items():
        addr[i], done[i] = x, True
        if size[i] > 0:
            pa[k], pb[k], plo[k], phi[k] = first[i], last[i], x, x + size[i]
            k += 1
    for count, i in enumerate(order):
        if done[i]:
            continue
        if deadline is not None and not count & 127 and time.perf_counter() > deadline:
            raise _OutOfTime
        done[i] = True
        s = size[i]
        if s == 0:
            continue
        m = (pa[:k] <= last[i]) & (pb[:k] >= first[i])
        x = 0
        if m.any():
            lo, hi = plo[:k][m], phi[:k][m]
            srt = np.lexsort((hi, lo))
            lo, hi = lo[srt], hi[srt]
            below = np.zeros(len(hi), dtype=np.int64)  # top of the blocks below block j
            np.maximum.accumulate(hi[:-1], out=below[1:])
            gaps = lo - below
            ok = np.flatnonzero(gaps >= s)
            if len(ok):
                x = below[ok[np.argmin(gaps[ok])] if best_fit else ok[0]]
            else:
                x = hi.max()
        addr[i] = x
        pa[k], pb[k], plo[k], phi[k] = first[i], last[i], x, x + s
        k += 1
    if not done.all():
        raise ValueError("internal: placement order does not cover every tensor")
    arena = int((addr + size).max()) if n else 0
    return addr.tolist(), arena


def _greedy_by_size(spans: list[Span], order: list[int], fixed: dict[int, int] | None = None,
                    deadline: float | None = None):
    """Place tensors in ``order``; each goes to the smallest gap that fits among the
    already-placed tensors live at the same time (best fit), else on top."""
    return _pack(spans, order, fixed, True, deadline)


def _first_fit(spans: list[Span], order: list[int], fixed: dict[int, int] | None = None,
               deadline: float | None = None):
    """Place tensors in ``order`` at the lowest offset where they fit among the
    already-placed tensors live at the same time (first fit)."""
    return _pack(spans, order, fixed, False, deadline)


def _release_block(free: list[tuple[int, int]], top: int, lo: int, hi: int) -> int:
    """Return ``[lo, hi)`` to the sorted free blocks ``free`` (below ``top``), merged with
    adjacent free blocks; a block reaching ``top`` lowers it. Returns the new top."""
    k = bisect.bisect_left(free, (lo, hi))
    if k > 0 and free[k - 1][1] == lo:
        lo = free.pop(k - 1)[0]
        k -= 1
    if k < len(free) and free[k][0] == hi:
        hi = free.pop(k)[1]
    if hi == top:
        return lo
    free.insert(k, (lo, hi))
    return top


def _take_best_fit(free: list[tuple[int, int]], top: int, size: int) -> tuple[int, int]:
    """``(offset, new top)`` of ``size`` bytes in the smallest free block that fits (the
    first of equal ones; its remainder stays free), else at ``top``."""
    best = None
    for k, (lo, hi) in enumerate(free):
        if hi - lo >= size and (best is None or hi - lo < free[best][1] - free[best][0]):
            best = k
    if best is None:
        return top, top + size
    lo, hi = free.pop(best)
    if hi - lo > size:
        free.insert(best, (lo + size, hi))
    return lo, top


def _sweep(spans: list[Span], deadline: float | None = None):
    """Online best fit over time: tensors by first step (larger first), freed after
    their last step, each into the smallest free block that fits, else on top (free
    blocks coalesce). ``O(n log n + n * free blocks)``; ``_OutOfTime`` past ``deadline``."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][1], -spans[i][0]))
    addrs = [0] * len(spans)
    free: list[tuple[int, int]] = []  # sorted free blocks below top
    ends: list[tuple[int, int]] = []  # heap of (last step, tensor) for live tensors
    top = 0
    for count, i in enumerate(order):
        if deadline is not None and not count & 255 and time.perf_counter() > deadline:
            raise _OutOfTime
        s, a, _b = spans[i]
        while ends and ends[0][0] < a:
            _, j = heapq.heappop(ends)
            top = _release_block(free, top, addrs[j], addrs[j] + spans[j][0])
        if s == 0:
            continue
        addrs[i], top = _take_best_fit(free, top, s)
        heapq.heappush(ends, (spans[i][2], i))
    arena = max((addrs[i] + spans[i][0] for i in range(len(spans))), default=0)
    return addrs, arena


def _pyramid(spans: list[Span], deadline: float | None = None) -> dict[int, int]:
    """Function 5: stack nested long lifetimes at increasing addresses."""
    fixed: dict[int, int] = {}
    min_start, max_end, base = -math.inf, math.inf, 0
    while True:
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        best, best_dur = None, 0
        for i, (s, a, b) in enumerate(spans):
            if i in fixed or s == 0 or a < min_start or b > max_end:
                continue
            if b - a > best_dur:
                best, best_dur = i, b - a
        if best is None:
            break
        fixed[best] = base
        base += spans[best][0]
        min_start, max_end = spans[best][1], spans[best][2]
    return fixed


def check_placement(spans: Sequence[Span], addresses: Sequence[int]) -> None:
    """Raise ValueError if two co-live tensors overlap in the arena or an address is < 0."""
    keys, spans = _normalize(spans)
    if keys is not None:
        if not isinstance(addresses, Mapping) or set(addresses) != set(keys):
            raise ValueError("addresses: must be a mapping with the same keys as spans")
        addresses = [addresses[k] for k in keys]
    addresses = list(addresses)
    if len(addresses) != len(spans):
        raise ValueError(f"addresses: {len(addresses)} given for {len(spans)} spans")
    for i, x in enumerate(addresses):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"addresses[{i}]: must be an int, got {x!r}")
    items = sorted(
        ((a, s, i) for i, (s, a, _b) in enumerate(spans) if s > 0), key=lambda x: x[0]
    )
    # sweep over time: check pairs live together (O(n^2) worst case, fine for tests/bench)
    idx = [i for _, _, i in items]
    for k, i in enumerate(idx):
        if addresses[i] < 0:
            raise ValueError(f"placement: negative address for tensor {i}")
        si = spans[i]
        for j in idx[k + 1:]:
            sj = spans[j]
            if sj[1] > si[2]:
                break
            if _overlap(si, sj):
                ai, aj = addresses[i], addresses[j]
                if ai < aj + sj[0] and aj < ai + si[0]:
                    raise ValueError(
                        f"placement: tensors {i} and {j} are live together and overlap "
                        f"([{ai}, {ai + si[0]}) vs [{aj}, {aj + sj[0]}))"
                    )


def _check_seconds(name: str, value) -> float:
    """A finite number of seconds > 0 (bools, NaN, inf and non-numbers refused; one
    error class, ValueError, for every bad time limit)."""
    import numbers

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(  # noqa: TRY004
            f"{name}: must be a finite number of seconds > 0, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")
    return value


# seconds per tensor of building a CP-SAT placement model (measured: well below this)
_CPSAT_BUILD_S = 2e-4


def place(
    spans,
    time_limit: float = 10.0,
    num_workers: int = 2,
    preplace: bool | str = "auto",
    return_info: bool = False,
):
    """Minimal-arena placement of tensors with fixed lifetimes.

    Args:
      spans: sequence (or mapping name -> ...) of ``(size_bytes, first_step, last_step)``,
        steps inclusive; sizes are Python/numpy ints >= 0 (floats and bools raise
        TypeError, negative sizes ValueError), steps ints with ``last >= first``.
      time_limit: seconds for the whole call (finite, > 0) beyond the first plan, which
        is always made, in ``O(n log n + n h)`` (online best fit over time; ``h`` free
        blocks at a time); the greedy passes (each checks the deadline every 128
        tensors), the window decomposition and CP-SAT then improve it while time is
        left, stopping as soon as the arena equals the peak resident bytes.
      preplace: fix the pyramid of long-lived tensors (paper, section 4.5) in the CP-SAT
        model; "auto" does it above 200 tensors.

    Returns:
      ``(addresses, arena_size)`` — addresses in the same structure as ``spans`` (list, or
      dict with the same keys) — or a :class:`Placement` when ``return_info``.
    """
    time_limit = _check_seconds("time_limit", time_limit)
    if preplace not in (True, False, "auto"):
        raise ValueError(f"preplace: must be True, False or 'auto', got {preplace!r}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    keys, sp = _normalize(spans)
    lb = peak_of_spans(sp)
    n = len(sp)
    # the first plan is never cut short: it is what every later stage must beat
    addrs, arena = _sweep(sp)
    method = "online_best_fit"

    def passes():
        """The offline heuristics, cheapest to build first (generated lazily)."""
        by_size = sorted(range(n), key=lambda i: (-sp[i][0], -(sp[i][2] - sp[i][1]), sp[i][1]))
        yield "greedy_by_size", _greedy_by_size, by_size, None
        by_dur = sorted(range(n), key=lambda i: (-(sp[i][2] - sp[i][1]), -sp[i][0]))
        yield "greedy_by_duration", _greedy_by_size, by_dur, None
        by_start = sorted(range(n), key=lambda i: (sp[i][1], -sp[i][0]))
        yield "greedy_by_start", _greedy_by_size, by_start, None
        by_area = sorted(range(n),
                         key=lambda i: (-sp[i][0] * (sp[i][2] - sp[i][1] + 1), -sp[i][0]))
        yield "greedy_by_area", _greedy_by_size, by_area, None
        state["orders"] = [by_size, by_dur, by_start, by_area]
        pyr = _pyramid(sp, deadline=heur_deadline)
        state["pyramid"] = pyr
        yield "pyramid+greedy", _greedy_by_size, by_size, pyr
        # tensors live at the peak step must tile [0, peak) exactly: place them first,
        # bottom up by start (long-lived at the bottom, like the pyramid), then the rest
        peak_t = _peak_step(sp)
        at_peak = [i for i in range(n) if sp[i][1] <= peak_t <= sp[i][2]]
        rest_set = set(at_peak)
        anchored = [sorted(at_peak, key=lambda i: (sp[i][1], -sp[i][2])),
                    sorted(at_peak, key=lambda i: (-sp[i][2], sp[i][1]))]
        state["anchored"], state["rest_set"] = anchored, rest_set
        rest = [i for i in by_size if i not in rest_set]
        rest_dur = [i for i in by_dur if i not in rest_set]
        named = [("size", by_size), ("duration", by_dur), ("start", by_start),
                 ("area", by_area), ("peak_by_start", anchored[0] + rest),
                 ("peak_by_end", anchored[1] + rest),
                 ("peak_by_start_dur", anchored[0] + rest_dur),
                 ("peak_by_end_dur", anchored[1] + rest_dur)]
        for name, order in named:
            yield f"first_fit_by_{name}", _first_fit, order, None
            if name.startswith("peak"):
                yield f"best_fit_by_{name}", _greedy_by_size, order, None

    state: dict = {}
    # the exact stages need time to build a model: without it, the passes get it all
    exact_room = n * _CPSAT_BUILD_S < 0.1 * time_limit
    heur_deadline = t0 + (0.6 if exact_room else 0.95) * time_limit
    if arena > lb:
        try:
            for name, fn, order, fixed in passes():
                a2, ar2 = fn(sp, order, fixed, deadline=heur_deadline)
                if ar2 < arena:
                    method, addrs, arena = name, a2, ar2
                if arena <= lb:
                    break
        except _OutOfTime:
            pass
    # randomised restarts: perturb the size order (ties and near-ties) while time allows
    import random

    rng = random.Random(0)
    budget = t0 + min(0.2 * time_limit, 2.0)
    anchored = state.get("anchored")
    while arena > lb and n > 1 and anchored is not None and time.perf_counter() < budget:
        noisy = sorted(range(n), key=lambda i: -sp[i][0] * rng.uniform(0.7, 1.3)
                       * (sp[i][2] - sp[i][1] + 1) ** rng.uniform(0, 0.5))
        if rng.random() < 0.5:  # keep the peak step's tensors first, perturb the rest
            rest_set = state["rest_set"]
            noisy = anchored[rng.randrange(2)] + [i for i in noisy if i not in rest_set]
        try:
            for fn in (_first_fit, _greedy_by_size):
                a2, ar2 = fn(sp, noisy, deadline=budget)
                if ar2 < arena:
                    method, addrs, arena = "random_restart", a2, ar2
        except _OutOfTime:
            break

    def left() -> float:
        return deadline - time.perf_counter()

    # the exact stages build a CP-SAT model (linear in n, in Python): only with time for it
    exact_ok = "orders" in state and n > 1
    if arena > lb and exact_ok and n * _CPSAT_BUILD_S < 0.25 * left():
        res = _window_place(sp, lb, min(0.5 * time_limit, left()), num_workers,
                            orders=state["orders"], deadline=deadline)
        if res is not None and res[1] < arena:
            addrs, arena = res
            method = "window+cp-sat"
    optimal = arena == lb
    if not optimal and exact_ok and n * _CPSAT_BUILD_S < 0.25 * left():
        pyr = state.get("pyramid")
        res = _cpsat_place(sp, addrs, arena, lb, left(), num_workers,
                           pyr if (preplace is True or (preplace == "auto" and n > 200)) else None)
        if res is not None and res[1] <= arena:
            addrs, arena, optimal = res
            method = "cp-sat"
            if optimal:
                lb = arena
    if n <= 2000:  # self-check (O(n * co-live tensors))
        check_placement(sp, addrs)
    info = Placement(addrs, int(arena), int(lb), bool(optimal), method, time.perf_counter() - t0)
    if keys is not None:
        info.addresses = dict(zip(keys, addrs))
    if return_info:
        return info
    return info.addresses, info.arena_size


def _window_place(sp, lb, time_limit, num_workers, orders, deadline=None):
    """Zero fragmentation by decomposition around the peak.

    An arena equal to the peak is tight only near the steps where the resident bytes come
    close to the peak; elsewhere there is slack. So: the tensors alive in the window of
    steps whose resident bytes reach ``(1 - delta) * peak`` are placed exactly by CP-SAT
    (a small feasibility problem with the arena fixed at the peak), then the other tensors
    are added around them by the greedy rules; ``delta`` grows (the window widens) until the
    greedy completion fits in the peak or the time is spent. Returns ``(addresses, arena)``
    of the best completion found, or None.
    """
    t0 = time.perf_counter()
    lo, resident = _resident_profile(sp)
    g = 0
    for s, _, _ in sp:
        g = math.gcd(g, s)
    if not g or lb % g:
        return None
    best = None
    prev_core: set[int] | None = None
    for delta in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05:
            break
        hot = np.flatnonzero(resident >= (1 - delta) * lb) + lo  # sorted steps
        first = np.fromiter((x[1] for x in sp), dtype=np.int64, count=len(sp))
        last = np.fromiter((x[2] for x in sp), dtype=np.int64, count=len(sp))
        size = np.fromiter((x[0] for x in sp), dtype=np.int64, count=len(sp))
        k = np.searchsorted(hot, first)  # first hot step >= first
        hits = (k < len(hot)) & (hot[np.minimum(k, len(hot) - 1)] <= last) & (size > 0)
        core = np.flatnonzero(hits).tolist()
        if prev_core is not None and set(core) == prev_core:
            continue
        prev_core = set(core)
        if len(core) * _CPSAT_BUILD_S > 0.25 * left:
            break
        sub = [sp[i] for i in core]
        res = _cpsat_model(sub, None, lb // g, lb // g, g, 0.5 * left, num_workers, None)
        if res is None:
            continue  # no exact core placement found in time: widen
        fixed = {i: a for i, a in zip(core, res[0])}
        for order in orders:
            for fn in (_greedy_by_size, _first_fit):
                try:
                    addrs, arena = fn(sp, order, fixed=fixed, deadline=deadline)
                except _OutOfTime:
                    return best
                if best is None or arena < best[1]:
                    best = (addrs, arena)
                if arena <= lb:
                    return best
    return best


def _cpsat_place(sp, hint_addrs, hint_arena, lb, time_limit, num_workers, fixed):

    if time_limit <= 0.01:
        return None
    g = 0
    for s, _, _ in sp:
        g = math.gcd(g, s)
    g = g or 1
    if lb % g == 0 and time_limit > 0.1:
        # arena upper-bounded at the peak: a pure feasibility problem propagates far
        # better than the minimisation; fall back to minimising with what is left
        t_start = time.perf_counter()
        # (no hint: the heuristic's addresses lie outside the tighter domain and CP-SAT
        # then loses seconds repairing them)
        res = _cpsat_model(sp, None, lb // g, lb // g, g, 0.6 * time_limit,
                           num_workers, None)
        if res is not None:
            return res
        time_limit -= time.perf_counter() - t_start
        if time_limit <= 0.01:
            return None
    lo = lb // g if lb % g == 0 else lb // g + 1
    return _cpsat_model(sp, hint_addrs, lo, hint_arena // g, g, time_limit, num_workers,
                        fixed, lb)


def _cpsat_model(sp, hint_addrs, lo, ub, g, time_limit, num_workers, fixed, lb=None):
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    arena = m.NewIntVar(lo, ub, "arena")
    xs, ys, A = [], [], []
    for i, (s, a, b) in enumerate(sp):
        if s == 0:
            A.append(0)
            continue
        sz = s // g
        if fixed is not None and i in fixed:
            av = m.NewConstant(fixed[i] // g) if fixed[i] % g == 0 else None
            if av is None:
                av = m.NewIntVar(0, ub - sz, f"A{i}")
        else:
            av = m.NewIntVar(0, max(0, ub - sz), f"A{i}")
        A.append(av)
        xs.append(m.NewFixedSizeIntervalVar(a, b - a + 1, f"T{i}"))
        ys.append(m.NewFixedSizeIntervalVar(av, sz, f"Y{i}"))
        m.Add(av + sz <= arena)
        if hint_addrs is not None and hint_addrs[i] % g == 0:
            m.AddHint(av, hint_addrs[i] // g)
    m.AddNoOverlap2D(xs, ys)
    m.Minimize(arena)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(num_workers)
    st = solver.Solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    addrs = [0 if isinstance(a, int) else solver.Value(a) * g for a in A]
    ar = max((addrs[i] + sp[i][0] for i in range(len(sp))), default=0)
    lb = lo * g if lb is None else lb
    return addrs, ar, (st == cp_model.OPTIMAL and fixed is None) or ar == lb


def best_fit_online(spans: Sequence[Span]) -> tuple[int, int, float]:
    """Simulate an online best-fit allocator with coalescing free blocks.

    Events are processed step by step (frees of tensors whose last step has passed, then
    allocations of tensors created at this step, in the given order). A request takes
    the smallest free block that fits, else grows the arena at the top. Returns
    ``(arena_high_water, resident_at_that_moment, fragmentation)`` with fragmentation
    ``(MR - RS) / MR`` measured when the reserved memory MR first reaches its peak
    (OLLA section 5.4).
    """
    spans = _normalize(spans)[1]
    free: list[tuple[int, int]] = []  # sorted (start, end) free blocks below top
    top = 0
    where: dict[int, int] = {}
    live = 0
    mr, rs_at_peak = 0, 0
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, (s, a, b) in enumerate(spans):
        starts.setdefault(a, []).append(i)
        ends.setdefault(b, []).append(i)
    steps = sorted(set(starts) | set(ends))

    def release(i):
        nonlocal top, live
        s = spans[i][0]
        if s == 0:
            return
        live -= s
        lo = where.pop(i)
        top = _release_block(free, top, lo, lo + s)

    for t in steps:
        for i in starts.get(t, []):
            s = spans[i][0]
            if s == 0:
                continue
            where[i], top = _take_best_fit(free, top, s)
            live += s
            if top > mr:
                mr, rs_at_peak = top, live
        for i in ends.get(t, []):
            release(i)
    frag = (mr - rs_at_peak) / mr if mr else 0.0
    return mr, rs_at_peak, frag
