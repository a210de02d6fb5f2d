"""Choose one option per unit with OR-Tools CP-SAT.

Problem (``x[u, o]`` in {0, 1}, one option ``o`` per unit ``u``)::

    minimise   sum_{u,o} cost[u,o] * x[u,o]                      (recomputed FLOPs)
    subject to sum_o x[u,o] = 1                                   for every unit u
               base + sum_{u,o} keep[u,o] * x[u,o] + M <= budget  (predicted bytes)
               M >= work[u,o] * x[u,o]                            for every u, o

``keep`` is what unit ``u`` holds for the backward pass under option ``o``, ``work`` the
bytes it recomputes while its own backward runs (only one unit's at a time), ``base`` the
bytes that do not depend on the choice (arguments, outputs, the backward's own buffers).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Solution", "solve"]

_KIB = 1024


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...] | None   # option index per unit, None if infeasible
    status: str                      # "OPTIMAL", "FEASIBLE", "INFEASIBLE", ...
    objective: float
    bound: float

    @property
    def gap(self) -> float:
        """Relative optimality gap ``(objective - bound) / max(objective, 1)``."""
        if self.choice is None:
            return float("nan")
        return max(0.0, self.objective - self.bound) / max(abs(self.objective), 1.0)


def solve(keep: Sequence[Sequence[int]], work: Sequence[Sequence[int]],
          cost: Sequence[Sequence[float]], base: int, budget: int,
          time_limit: float = 10.0,
          forbidden: Sequence[Sequence[int]] = ()) -> Solution:
    """Solve the problem above (bytes rounded up to KiB, cost to integers; deterministic:
    one worker, fixed seed). ``forbidden`` choices (already compiled and over budget) are
    excluded."""
    from ortools.sat.python import cp_model

    n = len(keep)
    m = cp_model.CpModel()
    scale = max(1.0, max((c for row in cost for c in row), default=1.0) / 1e6)
    x = [[m.NewBoolVar(f"x{u}_{o}") for o in range(len(keep[u]))] for u in range(n)]
    kib = lambda b: -(-int(b) // _KIB)
    cap = kib(budget) - kib(base)
    if cap < 0:
        return Solution(None, "INFEASIBLE", float("nan"), float("nan"))
    mx = m.NewIntVar(0, max(1, cap), "M")
    for u in range(n):
        m.AddExactlyOne(x[u])
        for o in range(len(keep[u])):
            w = kib(work[u][o])
            if w:
                m.Add(mx >= w).OnlyEnforceIf(x[u][o])
    m.Add(sum(kib(keep[u][o]) * x[u][o] for u in range(n) for o in range(len(keep[u])))
          + mx <= cap)
    for c in forbidden:
        m.Add(sum(x[u][o] for u, o in enumerate(c)) <= n - 1)
    m.Minimize(sum(round(cost[u][o] / scale) * x[u][o]
                   for u in range(n) for o in range(len(keep[u]))))
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = float(time_limit)
    s.parameters.num_workers = 1
    s.parameters.random_seed = 0
    st = s.Solve(m)
    name = s.StatusName(st)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution(None, name, float("nan"), float("nan"))
    choice = tuple(next(o for o in range(len(keep[u])) if s.Value(x[u][o]))
                   for u in range(n))
    return Solution(choice, name, s.ObjectiveValue() * scale, s.BestObjectiveBound() * scale)
