"""The planner's search: solve for the cheapest choice the byte model puts within the budget,
compile it, refit, repeat; nothing is returned that was not compiled within the budget.

The compiler is injected: any object with ``value_and_grad(choice) -> int`` and
``grad(choice) -> int`` (compiled bytes of ``jax.value_and_grad`` / ``jax.grad`` of the step
a choice runs; :class:`jaxmem.planner.steps.StepCompiler` is the real one). A choice fits
when both are within the budget.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Protocol

from jaxmem.planner import solve as _solve
from jaxmem.planner.model import ByteModel, Choice

__all__ = ["Compiler", "Search", "SearchResult"]

_DEBUG = bool(os.environ.get("JAXMEM_PLAN_DEBUG"))
#: a plan whose compiled bytes the model predicted within this fraction ends the search
_CLOSE = 0.1
#: most plans a refused search compiles joining recomputed neighbours (:meth:`Search.joined`)
_JOIN_TRIES = 3
#: options of items :meth:`Search.joined` joins (a plain segment's text is ``"segment"``)
_JOINABLE = frozenset(("recompute", "segment"))
#: most plans :meth:`Search.cheapen` compiles
_CHEAPEN_TRIES = 6


class Compiler(Protocol):
    def value_and_grad(self, choice: Choice) -> int: ...

    def grad(self, choice: Choice) -> int: ...


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """``choice``: the compiled choice of least cost that fits (``None``: none fits; then
    ``smallest`` is the least compiled total, ``value_and_grad`` and ``grad`` alike, of the
    plans every search compiles whatever its budget: a budget the search meets;
    ``smallest_choice`` the plan that compiles to it)."""

    choice: Choice | None
    status: str
    gap: float
    iterations: int
    smallest: int | None = None
    smallest_choice: Choice | None = None


class Search:
    """State of one search: the compiled plans (``tried``), what the model predicted for each
    before it was compiled (``predicted``), and the ``jax.grad`` totals (``grad_bytes``)."""

    def __init__(self, model: ByteModel, compiler: Compiler, time_limit: float = 10.0):
        self.model = model
        self.compiler = compiler
        self.time_limit = time_limit
        store = model.uniform("store")
        self.tried: dict[Choice, int] = {store: model.store_bytes}
        self.predicted: dict[Choice, int] = {store: model.store_bytes}
        self.grad_bytes: dict[Choice, int] = {}
        self.calibration: set[Choice] = {store}

    def cost(self, choice: Choice) -> float:
        """Predicted extra FLOPs of ``choice``: the model's, plus what the compiler adds to a
        compiled choice (``extra_cost``: the fence on a GPU target, where one was needed)."""
        extra = getattr(self.compiler, "extra_cost", None)
        return self.model.cost(choice) + (float(extra(choice)) if extra else 0.0)

    def compile(self, choice: Choice) -> int:
        """Compiled ``value_and_grad`` bytes of ``choice`` (predicted first, compiled once)."""
        if choice not in self.tried:
            self.predicted[choice] = self.model.predict(choice, self.model.fit(self.tried))
            self.tried[choice] = int(self.compiler.value_and_grad(choice))
        return self.tried[choice]

    def grad_total(self, choice: Choice) -> int:
        """Compiled ``jax.grad`` bytes of ``choice`` (XLA may plan it apart)."""
        if choice not in self.grad_bytes:
            self.grad_bytes[choice] = int(self.compiler.grad(choice))
        return self.grad_bytes[choice]

    def fits(self, choice: Choice, budget: int) -> bool:
        """Compiled ``value_and_grad`` and ``grad`` within ``budget`` (``grad`` compiled only
        when ``value_and_grad`` fits)."""
        return self.tried[choice] <= budget and self.grad_total(choice) <= budget

    def fitting(self, budget: int) -> list[Choice]:
        return [c for c in self.tried if self.fits(c, budget)]

    def solve(self, theta, budget: int | None, objective: str, forbidden=()) -> _solve.Solution:
        """The solver on the model's items under ``theta``, ``partial`` candidates left out:
        :meth:`cheapen` tries those on compiled plans. (Given to the solver they let it dodge
        the plans forbidden after a miss by swapping a stored unit for a ``partial`` one,
        which changed the search's path: ResNet-50 b64 at 25 % on the H100 plan was refused
        under the scope it meets the budget with.)"""
        items = self.model.items(theta)
        keep = [i for i, c in enumerate(self.model.candidates) if c.option.kind != "partial"]
        if len(keep) == len(items):
            return _solve.solve_items(self.model.n_units, items, self.model.base, budget,
                                      objective, self.time_limit, forbidden)
        pos = {i: k for k, i in enumerate(keep)}
        forb = [[pos[i] for i in c] for c in forbidden if all(i in pos for i in c)]
        sol = _solve.solve_items(self.model.n_units, [items[i] for i in keep],
                                 self.model.base, budget, objective, self.time_limit, forb)
        if sol.choice is None:
            return sol
        return dataclasses.replace(sol, choice=tuple(sorted(keep[k] for k in sol.choice)))

    def calibrate(self) -> None:
        """Compile the plans every search starts from (independent of the budget): every unit
        recomputed, with dots kept (when that keeps less), the least of each of ``fewbit`` and
        ``offload``, and each ``rows`` candidate alone (its saving is measured)."""
        m = self.model
        plans = [m.uniform("recompute")]
        if any(c.option.kind == "dots" and c.keep_bytes < m.stored[c.cover[0]]
               for c in m.candidates):
            plans.append(m.uniform("dots"))
        plans += [c for c in (m.least_of("fewbit"), m.least_of("offload")) if c is not None]
        for c in plans:
            self.calibration.add(c)
            self.compile(c)
        for i, c in enumerate(m.candidates):
            if c.option.kind == "rows" and i not in m.measured:
                alone = m.alone(i)
                self.calibration.add(alone)
                m.measured[i] = m.store_bytes - self.compile(alone)

    def least_bytes(self, budget: int, forbid_over: bool) -> None:
        """Compile the plan of least predicted bytes (after calibrating); with
        ``forbid_over`` the plans compiled over ``budget`` are excluded."""
        if not self.model.n_units:
            return
        self.calibrate()
        over = [c for c in self.tried if not self.fits(c, budget)] if forbid_over else ()
        sol = self.solve(self.model.fit(self.tried), None, "bytes", over)
        if sol.choice is not None:
            self.compile(sol.choice)

    def joined(self, budget: int) -> None:
        """A refused search's last tries: in the over-budget plan of fewest compiled bytes,
        two consecutive recomputed items (``recompute`` or a plain ``segment``) joined into one
        segment, which keeps only the joined run's inputs (the first units' outputs that the
        next one reads are not kept); the join of least predicted bytes is compiled, and from
        the then fewest-bytes plan the next, up to ``_JOIN_TRIES`` plans, until one fits.
        The byte model charges a segment's larger working set against every kept byte, so it
        misses such joins where that segment's backward runs after the others' kept bytes are
        freed (GPT 4x128 on the H100 plan: the embeddings joined to the first block, 18.22 ->
        17.72 MiB)."""
        m = self.model
        for _ in range(_JOIN_TRIES):
            over = [c for c in self.tried if not self.fits(c, budget)]
            if not over or len(over) < len(self.tried):   # none compiled, or one fits
                return
            best = min(over, key=lambda c: self.tried[c])
            theta = m.fit(self.tried)
            joins = []
            for a, b, j in self._joins(best):
                choice = tuple(sorted(set(best) - {a, b} | {j}))
                if choice not in self.tried:
                    joins.append((m.predict(choice, theta), choice))
            if not joins:
                return
            self.compile(min(joins)[1])

    def _joins(self, choice: Choice):
        """``(a, b, j)`` for each two neighbouring recomputed items ``a``, ``b`` of ``choice``
        (``recompute`` or a plain ``segment``) and the segment ``j`` over both."""
        m = self.model
        for a, b in itertools.pairwise(m.in_order(choice)):
            ca, cb = m.candidates[a], m.candidates[b]
            j = m.index.get((ca.cover + cb.cover, "segment"))
            if j is not None and {str(ca.option), str(cb.option)} <= _JOINABLE:
                yield a, b, j

    def cheapen(self, budget: int, best: Choice) -> Choice:
        """A local search from ``best`` (a plan that fits) over compiled plans, for ``partial``
        units. Each round tries, in turn: a unit recomputed alone (``recompute``, a segment of
        one unit, or ``partial``) given one of its cheaper ``partial`` candidates, the move
        saving the most FLOPs first and, among equal ones, the latest unit first (its
        residuals live the shortest, from its forward to its backward, which runs first);
        then, when none of those fits, two neighbouring recomputed items joined into one
        segment that costs at most 1 % more (it keeps only the joined run's inputs, making
        room for the next round). A move is compiled and kept when it fits (a join: when it
        also compiles smaller); the search stops when a round keeps nothing or after
        ``_CHEAPEN_TRIES`` compiled plans. The byte model adds a unit's extra residuals to
        every plan, but they cost nothing where that unit's backward runs before the peak:
        GPT 4x64 on the H100 plan, two blocks of four with their attention stored and the
        rest recomputed compile to 6.98 MiB where every block recomputed takes 6.47, under a
        budget of 7.05, for 0.07 of a step less."""
        m = self.model
        partial: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(m.candidates):
            if c.option.kind == "partial":
                partial.setdefault(c.cover, []).append(i)
        if not partial:
            return best
        self._cheapen_tries = 0
        while self._cheapen_tries < _CHEAPEN_TRIES:
            moves = []
            for i in best:
                c = m.candidates[i]
                if c.cover in partial and c.option.kind in ("recompute", "segment", "partial"):
                    moves += [(m.candidates[j].cost - c.cost, -c.cover[0], {i}, j)
                              for j in partial[c.cover] if m.candidates[j].cost < c.cost]
            found = self._first_fitting(best, sorted(moves, key=lambda t: t[:2]), budget)
            if found is None:
                joins = []
                for a, b, j in self._joins(best):
                    pair = m.candidates[a].cost + m.candidates[b].cost
                    if m.candidates[j].cost <= 1.01 * pair:
                        joins.append((m.candidates[j].cost - pair, 0, {a, b}, j))
                found = self._first_fitting(best, sorted(joins, key=lambda t: t[:2]), budget,
                                            smaller=True)
            if found is None:
                break
            best = found
        return best

    def _first_fitting(self, best: Choice, moves, budget: int,
                       smaller: bool = False) -> Choice | None:
        """The first of ``moves`` (``(_, _, items replaced, new item)``) whose plan fits
        (and, with ``smaller``, compiles smaller than ``best``), compiling each in turn
        within :meth:`cheapen`'s budget of compiles."""
        for *_, old, j in moves:
            choice = tuple(sorted(set(best) - old | {j}))
            if choice not in self.tried:
                if self._cheapen_tries >= _CHEAPEN_TRIES:
                    return None
                self._cheapen_tries += 1
                self.compile(choice)
                if _DEBUG:
                    print("plan: cheapen", choice, self.tried[choice])
            better = self.tried[choice] < self.tried[best] if smaller else \
                self.cost(choice) < self.cost(best)
            if better and self.fits(choice, budget):
                return choice
        return None

    def reachable(self) -> set[Choice]:
        """Compile the uniform nested plans (:meth:`ByteModel.nested_plans`) and the plan of
        least predicted bytes under a model fitted on them and the calibration plans alone:
        every refused search compiles these plans whatever its budget,
        so the least of their bytes is a budget the search meets. Returns those plans."""
        if not self.model.n_units:
            return set(self.calibration)
        self.calibrate()
        for c in self.model.nested_plans():   # two-level checkpointing, where offered
            self.calibration.add(c)
            self.compile(c)
        sol = self.solve(self.model.fit(self.tried, self.calibration), None, "bytes")
        if sol.choice is None:
            return set(self.calibration)
        self.compile(sol.choice)
        return set(self.calibration) | {sol.choice}

    def refine(self, budget: int, max_iterations: int) -> tuple[_solve.Solution | None, str, int]:
        """Solve, compile, refit up to ``max_iterations`` times: ``(last solution, status of
        the last fitting plan, iterations)``. A plan over budget tightens the model's budget
        by its miss and is forbidden; while that tightened budget holds nothing cheaper than a
        plan that fits, the tightening is halved (down to none). When the model finds no plan
        within the budget (or none cheaper than one that fits) the plan of least predicted
        bytes is compiled."""
        self.calibrate()
        slack, least_tried, status, sol = 0, False, "OPTIMAL", None
        for it in range(1, max_iterations + 1):
            fits = self.fitting(budget)
            theta = self.model.fit(self.tried)
            over = [c for c in self.tried if c not in fits]
            while True:
                sol = self.solve(theta, budget - slack, "time", over)
                if _DEBUG:
                    print("plan: theta", theta, "slack", slack, sol)
                mode_bytes = sol.choice is None or bool(
                    fits and self.model.cost(sol.choice) >= min(map(self.cost, fits)))
                if not (mode_bytes and fits and slack):
                    break
                # nothing cheaper than a plan that fits within the slack an earlier miss
                # took: halve it (the misses stay forbidden), down to none
                slack = slack // 2 if slack > budget // 64 else 0
            if mode_bytes:
                if fits:
                    return sol, status, it
                sol = self.solve(theta, None, "bytes", over)
                if sol.choice is None or sol.choice in self.tried or (
                        least_tried and self.model.predict(sol.choice, theta) > 1.1 * budget):
                    return sol, status, it   # the model sees no smaller plan than compiled
                least_tried = True
            compiled = self.compile(sol.choice)
            if _DEBUG:
                print("plan:", sol.choice, "predicted", self.predicted[sol.choice],
                      "compiled", compiled)
            if self.fits(sol.choice, budget):
                status = sol.status
                if abs(self.predicted[sol.choice] / max(compiled, 1) - 1.0) <= _CLOSE:
                    return sol, status, it
                # missed by more than _CLOSE: refit on it; a cheaper plan within the budget
                # under the refit model replaces it
            elif not mode_bytes:
                slack += compiled - budget
        return sol, status, max_iterations

    def run(self, budget: int, floor: int, max_iterations: int) -> SearchResult:
        """The search for ``budget``; ``floor`` is the untouched step's arguments + outputs
        (below it no plan fits: only the least-bytes plan is compiled)."""
        sol, status, it = None, "OPTIMAL", 0
        if budget < floor:
            self.least_bytes(budget, forbid_over=False)
        elif budget < self.model.store_bytes and self.model.n_units:
            sol, status, it = self.refine(budget, max_iterations)
        fits = self.fitting(budget)
        canonical: set[Choice] = set()
        if not fits:
            if budget >= floor:
                self.least_bytes(budget, forbid_over=True)
                if not self.fitting(budget):
                    self.joined(budget)
            canonical = self.reachable()
            fits = self.fitting(budget)
        gap = sol.gap if sol is not None and sol.choice is not None else 0.0
        status = status if sol is not None else "OPTIMAL"
        if fits:
            key = lambda c: (self.cost(c), self.tried[c], c)
            # the cheapest plan, and the smallest (the most room for partial units)
            starts = dict.fromkeys((min(fits, key=key),
                                    min(fits, key=lambda c: (self.tried[c], *key(c)))))
            best = min((self.cheapen(budget, s) for s in starts), key=key)
            return SearchResult(best, status, gap, max(it, 1))
        return SearchResult(None, status, gap, max(it, 1), *self.smallest(canonical))

    def smallest(self, plans: set[Choice]) -> tuple[int | None, Choice | None]:
        """``(bytes, plan)``: the least ``max(value_and_grad, grad)`` compiled total over
        ``plans`` and the plan that compiles to it (``(None, None)`` for no plans)."""
        smallest, which = None, None
        for c in sorted(plans, key=lambda c: self.tried[c]):
            if smallest is not None and self.tried[c] >= smallest:
                break
            both = max(self.tried[c], self.grad_total(c))
            if smallest is None or both < smallest:
                smallest, which = both, c
        return smallest, which
