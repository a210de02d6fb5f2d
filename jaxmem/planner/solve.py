"""Choose one item per unit with OR-Tools CP-SAT.

An *item* covers one or more consecutive units with one option: a single unit stored, with its
matmul outputs kept (``dots``) or recomputed, or a *segment* of several units recomputed as one
checkpointed chunk. Problem (``x[i]`` in {0, 1} per item)::

    minimise   sum_i cost[i] * x[i]                  (objective "time": predicted extra time)
           or  sum_i bytes[i] * x[i] + M             (objective "bytes": predicted bytes)
    subject to sum_{i covers u} x[i] = 1             for every unit u
               base + sum_i bytes[i] * x[i] + M <= budget
               M >= work[i] * x[i]                   for every item i

``bytes[i]`` is what item ``i`` holds for the backward pass (calibrated, may be negative: a
saving), ``work[i]`` the bytes it recomputes while its own backward runs (one item's at a
time), ``base`` the bytes that do not depend on the choice.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

__all__ = ["Item", "Solution", "solve", "solve_items"]

_KIB = 1024


@dataclasses.dataclass(frozen=True)
class Item:
    """Units ``cover`` (consecutive indices) run with ``option`` (the caller's label, e.g. a
    :class:`jaxmem.planner.options.Option`; the solver does not read it); bytes, work and
    cost as above."""

    cover: tuple[int, ...]
    option: Hashable
    bytes: int
    work: int
    cost: float


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...] | None   # chosen item (or option) indices, None if infeasible
    status: str                      # "OPTIMAL", "FEASIBLE", "INFEASIBLE", ...
    objective: float
    bound: float

    @property
    def gap(self) -> float:
        """Relative optimality gap ``(objective - bound) / max(objective, 1)``."""
        if self.choice is None:
            return float("nan")
        return max(0.0, self.objective - self.bound) / max(abs(self.objective), 1.0)


def _kib(b: float) -> int:
    return -(-int(b) // _KIB)


def solve_items(n_units: int, items: Sequence[Item], base: int, budget: int | None,
                objective: str = "time", time_limit: float = 10.0,
                forbidden: Sequence[Sequence[int]] = ()) -> Solution:
    """Solve the problem above; ``choice`` is the sorted tuple of chosen item indices. Bytes
    are rounded up to KiB, cost to integers; deterministic (one worker, fixed seed).
    ``budget=None`` drops the bytes constraint; ``forbidden`` item sets are excluded."""
    from ortools.sat.python import cp_model

    if objective not in ("time", "bytes"):
        raise ValueError(f"solve_items: objective must be 'time' or 'bytes', got {objective!r}")
    m = cp_model.CpModel()
    x = [m.NewBoolVar(f"x{i}") for i in range(len(items))]
    for u in range(n_units):
        m.AddExactlyOne([x[i] for i, it in enumerate(items) if u in it.cover])
    big = sum(abs(_kib(it.bytes)) + _kib(it.work) for it in items) + 1
    mx = m.NewIntVar(0, max(1, max((_kib(it.work) for it in items), default=0)), "M")
    for i, it in enumerate(items):
        w = _kib(it.work)
        if w:
            m.Add(mx >= w).OnlyEnforceIf(x[i])
    held = sum(_kib(it.bytes) * x[i] for i, it in enumerate(items)) + mx
    if budget is not None:
        m.Add(held <= _kib(budget) - _kib(base))
    for c in forbidden:
        m.Add(sum(x[i] for i in c) <= len(c) - 1)
    scale = max(1.0, max((it.cost for it in items), default=1.0) / 1e6)
    if objective == "time":
        # ties broken towards fewer bytes (weight below one cost unit in total)
        m.Minimize(sum(round(it.cost / scale) * big * x[i] for i, it in enumerate(items))
                   + held)
    else:
        m.Minimize(held * (10**6) + sum(round(it.cost / scale) * x[i]
                                        for i, it in enumerate(items)))
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = float(time_limit)
    s.parameters.num_workers = 1
    s.parameters.random_seed = 0
    st = s.Solve(m)
    name = s.StatusName(st)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution(None, name, float("nan"), float("nan"))
    choice = tuple(i for i in range(len(items)) if s.Value(x[i]))
    if objective == "time":
        obj = sum(items[i].cost for i in choice)
        bound = s.BestObjectiveBound() / big * scale
    else:
        obj = float(s.Value(held)) * _KIB
        bound = s.BestObjectiveBound() / 10**6 * _KIB
    return Solution(choice, name, float(obj), float(min(bound, obj)))


def solve(keep: Sequence[Sequence[int]], work: Sequence[Sequence[int]],
          cost: Sequence[Sequence[float]], base: int, budget: int,
          time_limit: float = 10.0,
          forbidden: Sequence[Sequence[int]] = ()) -> Solution:
    """One option per unit (``keep[u][o]``, ``work[u][o]``, ``cost[u][o]``): minimum total cost
    with ``base + sum keep + max work <= budget``; ``choice`` is the option index per unit."""
    items, index = [], {}
    for u in range(len(keep)):
        for o in range(len(keep[u])):
            index[(u, o)] = len(items)
            items.append(Item((u,), o, int(keep[u][o]), int(work[u][o]), float(cost[u][o])))
    forb = [[index[(u, o)] for u, o in enumerate(c)] for c in forbidden]
    sol = solve_items(len(keep), items, base, budget, "time", time_limit, forb)
    if sol.choice is None:
        return sol
    per_unit = {items[i].cover[0]: int(items[i].option) for i in sol.choice}
    return Solution(tuple(per_unit[u] for u in range(len(keep))), sol.status, sol.objective,
                    sol.bound)
