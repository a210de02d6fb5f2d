"""The planner's byte model: what each candidate keeps, fitted to compiled plans.

A *choice* is a sorted tuple of candidate indices covering every unit once. Its jaxpr-level
saving by option kind ``k`` is ``saving_k = sum over its candidates of kind k of (stored bytes
of the covered units - keep_bytes)``; XLA's fusion decides how much of it survives, so::

    store_bytes - compiled(choice) ~= sum_k a_k * saving_k - b * max work - measured(choice)

with ``theta = (a_k..., b)`` fitted by least squares over the compiled plans (a weak prior
pulls each coefficient to 1). ``rows`` candidates are not fitted: each is compiled alone once
and its measured saving is used (until then, its jaxpr-level saving).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxmem.planner import solve as _solve
from jaxmem.planner.options import Candidate

__all__ = ["FITTED", "ByteModel"]

#: option kinds with a fitted coefficient (``store`` saves nothing, ``rows`` is measured)
FITTED = ("dots", "recompute", "segment", "fewbit", "offload", "partial")

Choice = tuple[int, ...]


class ByteModel:
    """Bytes of choices over ``candidates``: ``stored[u]`` is what unit ``u`` keeps when
    stored, ``store_bytes`` the compiled bytes of every unit stored. ``measured`` maps a
    candidate index to its compiled saving (set by calibration)."""

    def __init__(self, candidates: Sequence[Candidate], stored: Sequence[int],
                 store_bytes: int):
        self.candidates = list(candidates)
        self.stored = [int(b) for b in stored]
        self.store_bytes = int(store_bytes)
        self.measured: dict[int, int] = {}
        self.index = {(c.cover, str(c.option)): i for i, c in enumerate(self.candidates)}

    @property
    def n_units(self) -> int:
        return len(self.stored)

    @property
    def base(self) -> int:
        """Compiled bytes that no choice changes: every unit stored minus what they keep."""
        return self.store_bytes - sum(self.stored)

    def held(self, cand: Candidate) -> int:
        """Bytes the covered units keep when stored."""
        return sum(self.stored[u] for u in cand.cover)

    def saving(self, i: int) -> int:
        """Jaxpr-level bytes candidate ``i`` stops keeping."""
        return self.held(self.candidates[i]) - self.candidates[i].keep_bytes

    def split(self, i: int) -> dict[str, int]:
        """Candidate ``i``'s saving by fitted kind. A nested segment saves what recomputing
        each of its units saves (the ``recompute`` part) plus the unit inputs it drops on
        top (the ``segment`` part): the ``recompute`` coefficient, calibrated on every
        search's first plans, covers most of it."""
        c = self.candidates[i]
        if c.option.nested:
            rec = [self.index.get(((u,), "recompute")) for u in c.cover]
            if None not in rec:
                r = sum(self.candidates[j].keep_bytes for j in rec)
                if c.keep_bytes <= r <= self.held(c):
                    return {"recompute": self.held(c) - r, "segment": r - c.keep_bytes}
        return {c.option.kind: self.saving(i)}

    def features(self, choice: Iterable[int]) -> np.ndarray:
        """Savings by fitted kind (:data:`FITTED`), then minus the largest work."""
        f = dict.fromkeys(FITTED, 0.0)
        w = 0.0
        for i in choice:
            kind = self.candidates[i].option.kind
            if i in self.measured or kind not in f:
                continue
            for k, v in self.split(i).items():
                f[k] += v
            w = max(w, self.candidates[i].work_bytes)
        return np.array([f[k] for k in FITTED] + [-w])

    def known(self, choice: Iterable[int]) -> float:
        """Savings not fitted: measured ones, and jaxpr-level ones of unmeasured rows."""
        return float(sum(self.measured[i] if i in self.measured else self.saving(i)
                         if self.candidates[i].option.kind == "rows" else 0 for i in choice))

    def fit(self, compiled: Mapping[Choice, int], only: Iterable[Choice] | None = None
            ) -> np.ndarray:
        """``theta`` by least squares over the ``compiled`` plans (those in ``only``, if
        given), with a prior ``lam * (theta - 1)`` of weight 1 % of ``store_bytes``."""
        keep = None if only is None else set(only)
        plans = [c for c in compiled if keep is None or c in keep]
        scale = max(self.store_bytes, 1)
        lam = 1e-2 * scale
        dim = len(FITTED) + 1
        ys = [float(self.store_bytes - compiled[c]) - self.known(c) for c in plans]
        a_mat = np.vstack([self.features(c) for c in plans] + [np.eye(dim) * lam]) / scale
        y = np.array(ys + [lam] * dim) / scale
        return np.clip(np.linalg.lstsq(a_mat, y, rcond=None)[0], 0.0, None)

    def predict(self, choice: Iterable[int], theta: np.ndarray) -> int:
        """Predicted compiled bytes of ``choice``."""
        choice = tuple(choice)
        return int(np.rint(self.store_bytes - float(self.features(choice) @ theta)
                           - self.known(choice)))

    def items(self, theta: np.ndarray) -> list[_solve.Item]:
        """The solver's items: calibrated bytes ``held - a_kind * saving`` (measured saving
        for a measured candidate) and work ``b * work_bytes``."""
        coef = dict(zip(FITTED, theta))
        out = []
        for i, c in enumerate(self.candidates):
            full = self.held(c)
            if i in self.measured:
                out.append(_solve.Item(c.cover, c.option, int(full - self.measured[i]), 0,
                                       c.cost))
                continue
            saved = 0.0 if c.option.kind == "store" else sum(
                coef[k] * v for k, v in self.split(i).items())
            out.append(_solve.Item(c.cover, c.option, int(np.rint(full - saved)),
                                   int(np.rint(theta[-1] * c.work_bytes)), c.cost))
        return out

    def uniform(self, kind: str) -> Choice:
        """Every unit alone with option ``kind`` (``store``, ``dots`` or ``recompute``)."""
        return tuple(self.index[((u,), kind)] for u in range(self.n_units))

    def least_of(self, kind: str) -> Choice | None:
        """Every unit with a candidate of ``kind`` takes its one of fewest kept bytes, the
        others are stored; ``None`` when no candidate has that kind."""
        best: dict[tuple[int, ...], int] = {}
        for i, c in enumerate(self.candidates):
            if c.option.kind == kind and (c.cover not in best or c.keep_bytes
                                          < self.candidates[best[c.cover]].keep_bytes):
                best[c.cover] = i
        if not best:
            return None
        chosen, covered = [], set()
        for cover, i in sorted(best.items()):
            if not covered & set(cover):
                chosen.append(i)
                covered |= set(cover)
        chosen += [self.index[((u,), "store")] for u in range(self.n_units) if u not in covered]
        return tuple(sorted(chosen))

    def nested_plans(self) -> list[Choice]:
        """The uniform nested plans, where nested candidates exist: every unit that has one
        recomputed with its children checkpointed again inside (the others recomputed), and
        runs of ``round(sqrt(units))`` units each a nested segment (two-level sqrt(n)
        checkpointing)."""
        out = []
        rec = [self.index.get(((u,), "recompute")) for u in range(self.n_units)]
        if None in rec:
            return out
        kids = [self.index.get(((u,), "segment2"), rec[u]) for u in range(self.n_units)]
        if kids != rec:
            out.append(tuple(sorted(kids)))
        k = max(2, round(self.n_units ** 0.5))
        runs = []
        for a in range(0, self.n_units, k):
            cover = tuple(range(a, min(a + k, self.n_units)))
            i = self.index.get((cover, "segment2"))
            runs += [i] if i is not None else [rec[u] for u in cover]
        if runs != rec and tuple(sorted(runs)) not in out:
            out.append(tuple(sorted(runs)))
        return out

    def alone(self, i: int) -> Choice:
        """Candidate ``i`` with every other unit stored."""
        cover = self.candidates[i].cover
        return tuple(sorted([i] + [self.index[((u,), "store")] for u in range(self.n_units)
                                   if u not in cover]))

    def cost(self, choice: Iterable[int]) -> float:
        """Predicted extra FLOPs of ``choice``."""
        return sum(self.candidates[i].cost for i in choice)

    def in_order(self, choice: Iterable[int]) -> list[int]:
        """The candidates of ``choice`` by first unit."""
        return sorted(choice, key=lambda i: self.candidates[i].cover[0])
