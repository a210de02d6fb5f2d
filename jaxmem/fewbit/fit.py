"""Optimal piecewise-constant approximation of an activation's derivative.

Given a derivative ``f'`` and a weight ``w >= 0`` supported on ``[A, B]``, find ``k = 2**bits``
levels ``y_1..y_k`` and interior borders ``s_1 < ... < s_{k-1}`` minimising (paper, eq. 3)::

    L(s, y) = ∫ (f'(x) - q(x | s, y))**2 w(x) dx,   q = Σ_i y_i 1[x ∈ [s_{i-1}, s_i)]

with ``s_0 = A`` and ``s_k = B``.  For fixed borders the optimal level of a bin is the
``w``-weighted mean of ``f'`` on it (eq. 4).

Algorithm (paper, section 3):

1. Discretise ``A = t_0 < ... < t_n = B`` (uniform, ``n = grid``) and compute the cumulative
   integrals (eqs. 8-9) ``W(i) = ∫_A^{t_i} w``, ``FW(i) = ∫_A^{t_i} f' w``,
   ``F2(i) = ∫_A^{t_i} f'^2 w`` with 8-point Gauss-Legendre quadrature on every cell, so that
   the cost of one bin ``[t_j, t_i]`` is available in O(1)::

       T(j, i) = F2(i) - F2(j) - (FW(i) - FW(j))**2 / (W(i) - W(j)).

2. Dynamic programme (eqs. 6-7) ``DP(i, m) = min_j DP(j, m-1) + T(j, i)``, ``DP(0, 0) = 0``,
   over ``m = 1..k``; O(n^2 k) time, O(n k) memory (only argmins are kept for backtracking).
   ``DP(n, k)`` is the optimum among borders restricted to the grid.

3. Optional refinement (eq. 5): the gradient
   ``∂L/∂s_i = (2 f'(s_i) - y_i - y_{i+1}) (y_{i+1} - y_i) w(s_i)`` (levels re-solved by eq. 4)
   drives an L-BFGS-B search for continuous borders, starting at the DP solution.  The
   refined solution is kept only if it lowers ``L``.

Symmetric mode (for even derivatives such as Sigmoid' and Tanh'): the approximation is a
function of ``|x|``; the fit runs on ``[0, max(|A|, |B|)]`` with the folded weight
``w(x) + w(-x)`` and all ``2**bits`` levels, which doubles the resolution.  ``error`` is
always the full-line error ``L`` of eq. 3 (for symmetric fits: the error of ``q(|x|)``
against ``f'(x)`` on the whole line).

Everything is float64 numpy and deterministic.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

__all__ = ["Fit", "approximation_error", "check_finite_derivative", "fit", "gaussian_weight",
           "uniform_weight"]

_GL_X, _GL_W = np.polynomial.legendre.leggauss(8)


@dataclasses.dataclass(frozen=True)
class Fit:
    """A piecewise-constant approximation ``q`` of a derivative.

    Attributes:
      borders: ``(2**bits - 1,)`` ascending interior borders.  Bin ``c`` of ``x`` is
        ``#{i : x >= borders[i]}`` (for ``symmetric``: of ``|x|``); bins extend to ±inf.
      levels: ``(2**bits,)`` value of ``q`` on each bin.
      error: weighted L2 error ``∫ (f' - q)^2 w dx`` (eq. 3) on the whole line.
      bits: number of bits per element of the code.
      interval: ``(A, B)`` support of the weight.
      symmetric: whether the code is taken of ``|x|``.
    """

    borders: np.ndarray
    levels: np.ndarray
    error: float
    bits: int
    interval: tuple[float, float]
    symmetric: bool = False

    def code(self, x: np.ndarray) -> np.ndarray:
        """Bin index of every element of ``x`` (numpy; compare-and-sum)."""
        x = np.asarray(x, dtype=np.float64)
        if self.symmetric:
            x = np.abs(x)
        return (x[..., None] >= self.borders).sum(-1).astype(np.uint8)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Evaluate ``q(x)``."""
        return self.levels[self.code(x)]


def uniform_weight(a: float, b: float) -> Callable[[np.ndarray], np.ndarray]:
    """``w(x) = 1[a <= x <= b]`` (the paper's eq. 10 for ``a, b = -10, 10``)."""

    def w(x):
        x = np.asarray(x, dtype=np.float64)
        return ((x >= a) & (x <= b)).astype(np.float64)

    return w


def gaussian_weight(mean: float = 0.0, std: float = 1.0) -> Callable[[np.ndarray], np.ndarray]:
    """Normal density ``N(mean, std^2)`` as the weight (the paper's alternative choice)."""

    def w(x):
        z = (np.asarray(x, dtype=np.float64) - mean) / std
        return np.exp(-0.5 * z * z) / (std * np.sqrt(2.0 * np.pi))

    return w


def _cell_integrals(g: Callable, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """∫_lo^hi g for arrays of cells, 8-point Gauss-Legendre per cell."""
    half = 0.5 * (hi - lo)
    mid = 0.5 * (hi + lo)
    x = mid[..., None] + half[..., None] * _GL_X
    return (g(x) * _GL_W).sum(-1) * half


class _Problem:
    """Derivative, weight and their cumulative integrals on a uniform grid."""

    def __init__(self, derivative, weight, a: float, b: float, grid: int, symmetric: bool):
        self.a, self.b, self.n = float(a), float(b), int(grid)
        d = derivative
        if symmetric:
            wfull = weight
            self.w = lambda x: wfull(x) + wfull(-x)
        else:
            self.w = weight
        self.d = lambda x: np.asarray(d(np.asarray(x, dtype=np.float64)), dtype=np.float64)
        self.t = np.linspace(self.a, self.b, self.n + 1)
        lo, hi = self.t[:-1], self.t[1:]
        w_c = _cell_integrals(self.w, lo, hi)
        fw_c = _cell_integrals(lambda x: self.d(x) * self.w(x), lo, hi)
        f2_c = _cell_integrals(lambda x: self.d(x) ** 2 * self.w(x), lo, hi)
        z = np.zeros(1)
        self.W = np.concatenate([z, np.cumsum(w_c)])
        self.FW = np.concatenate([z, np.cumsum(fw_c)])
        self.F2 = np.concatenate([z, np.cumsum(f2_c)])

    def cumulative(self, s: np.ndarray):
        """(W, FW, F2) from A to each point of ``s`` (exact up to quadrature)."""
        s = np.clip(np.asarray(s, dtype=np.float64), self.a, self.b)
        h = (self.b - self.a) / self.n
        i = np.clip(np.floor((s - self.a) / h).astype(np.int64), 0, self.n - 1)
        lo = self.t[i]
        dw = _cell_integrals(self.w, lo, s)
        dfw = _cell_integrals(lambda x: self.d(x) * self.w(x), lo, s)
        df2 = _cell_integrals(lambda x: self.d(x) ** 2 * self.w(x), lo, s)
        return self.W[i] + dw, self.FW[i] + dfw, self.F2[i] + df2

    def levels_and_error(self, borders: np.ndarray):
        """Optimal levels (eq. 4) and error (eq. 3) for given interior borders."""
        pts = np.concatenate([[self.a], np.sort(borders), [self.b]])
        W, FW, F2 = self.cumulative(pts)
        dW, dFW, dF2 = np.diff(W), np.diff(FW), np.diff(F2)
        safe = np.where(dW > 0, dW, 1.0)
        # Empty (zero-weight) bins take the derivative at their midpoint.
        mids = 0.5 * (pts[:-1] + pts[1:])
        levels = np.where(dW > 0, dFW / safe, self.d(mids))
        err = float(np.sum(np.where(dW > 0, dF2 - dFW**2 / safe, 0.0)))
        return levels, max(err, 0.0)


#: the DP keeps its segment costs between levels up to this many entries (float64: 256 MiB;
#: the default grid of 4096 needs 4097**2, 128 MiB); a larger grid recomputes them per level
_DP_COST_CACHE_ENTRIES = 1 << 25


def _segment_costs(prob: _Problem, i: np.ndarray) -> np.ndarray:
    """``cost[r, j]``: the weighted squared error of one level on ``[t_j, t_i[r]]`` (eq. 3 of
    the cell, from the cumulative integrals); ``inf`` where ``j >= i[r]``."""
    W, FW, F2 = prob.W, prob.FW, prob.F2
    dW = W[i][:, None] - W[None, :]
    dFW = FW[i][:, None] - FW[None, :]
    dF2 = F2[i][:, None] - F2[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = dF2 - np.where(dW > 0, dFW**2 / np.where(dW > 0, dW, 1.0), 0.0)
    cost = np.maximum(cost, 0.0)
    cost[np.arange(prob.n + 1)[None, :] >= i[:, None]] = np.inf  # j < i only
    return cost


def _dp(prob: _Problem, k: int) -> np.ndarray:
    """Grid-restricted optimal interior borders via the DP of eqs. 6-7 (returns k-1 points):
    ``DP(m, i) = min_{j < i} DP(m - 1, j) + cost(j, i)``, ``DP(0, 0) = 0``."""
    n = prob.n
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    arg = np.zeros((k + 1, n + 1), dtype=np.int32)
    idx = np.arange(n + 1)
    chunk = max(1, (1 << 22) // (n + 1))
    starts = range(0, n + 1, chunk)
    keep = (n + 1) ** 2 <= _DP_COST_CACHE_ENTRIES
    costs: dict[int, np.ndarray] = {}
    for m in range(1, k + 1):
        cur = np.full(n + 1, np.inf)
        for i0 in starts:
            i = idx[i0 : i0 + chunk]
            if i[-1] < m:   # only i >= m is reachable with m non-empty bins
                continue
            cost = costs.get(i0)
            if cost is None:
                cost = _segment_costs(prob, i)
                if keep:
                    costs[i0] = cost
            tot = prev[None, :] + cost
            j = np.argmin(tot, axis=1)
            ok = i >= m
            arg[m, i[ok]] = j[ok]
            cur[i[ok]] = tot[np.arange(len(i)), j][ok]
        prev = cur
    # backtrack from (n, k)
    pts = []
    i = n
    for m in range(k, 0, -1):
        i = int(arg[m, i])
        pts.append(i)
    pts = pts[::-1][1:]  # drop t_0 = A
    return prob.t[np.array(pts, dtype=np.int64)]


def _refine(prob: _Problem, borders: np.ndarray) -> np.ndarray:
    """L-BFGS-B on the interior borders with the analytic gradient of eq. 5."""
    from scipy.optimize import minimize

    def fun(s):
        order = np.argsort(s, kind="stable")
        ss = s[order]
        levels, err = prob.levels_and_error(ss)
        wd = prob.w(ss) if ss.size else ss
        g_sorted = (2.0 * prob.d(ss) - levels[:-1] - levels[1:]) * (levels[1:] - levels[:-1]) * wd
        g = np.empty_like(s)
        g[order] = g_sorted
        return err, g

    scale = prob.b - prob.a
    res = minimize(
        fun,
        borders.copy(),
        jac=True,
        method="L-BFGS-B",
        bounds=[(prob.a, prob.b)] * len(borders),
        options={"maxiter": 500, "ftol": 1e-15, "gtol": 1e-12 * scale},
    )
    s = np.sort(res.x)
    e, g = fun(s)
    # L-BFGS-B stalls where f' jumps (a border sitting on the jump has a one-sided gradient):
    # continue with plain gradient descent + Armijo backtracking, which only ever descends.
    def freeze_jumps(s, g):
        # a border on a jump of f' is a kink of L: its (one-sided) gradient is unusable
        jump = np.abs(prob.d(s + 1e-7 * scale) - prob.d(s - 1e-7 * scale)) > 1e-5
        return np.where(jump, 0.0, g)

    g = freeze_jumps(s, g)
    step = 1.0
    for _ in range(400):
        gn = float(g @ g)
        if gn == 0.0:
            break
        while step > 1e-12:
            cand = np.clip(s - step * g, prob.a, prob.b)
            if np.all(np.diff(cand) > 0):
                ec, gc = fun(cand)
                if ec <= e - 1e-4 * step * gn:
                    break
            step *= 0.5
        else:
            break
        gc = freeze_jumps(cand, gc)
        if e - ec < 1e-15:
            s, e, g = cand, ec, gc
            break
        s, e, g = cand, ec, gc
        step *= 2.0
    return s


def check_finite_derivative(derivative, interval, *, points: int = 4097,
                            what: str = "the derivative") -> None:
    """Raise ``ValueError`` unless ``derivative`` is finite on ``points`` points spanning the
    closed ``interval``; the message names the sub-ranges where it is NaN/inf and a finite
    sub-interval to pass as ``interval`` instead."""
    a, b = map(float, interval)
    xs = np.linspace(a, b, int(points))
    with np.errstate(all="ignore"):
        ok = np.isfinite(np.asarray(derivative(xs), dtype=np.float64))
    if ok.all():
        return
    bad = (~ok).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], bad, [0]])))
    runs = [(xs[i], xs[j - 1]) for i, j in zip(edges[::2], edges[1::2])]
    shown = ", ".join(f"[{u:.6g}, {v:.6g}]" for u, v in runs[:4]) + (" ..." if len(runs) > 4 else "")
    good = np.flatnonzero(np.diff(np.concatenate([[0], ok.astype(np.int8), [0]])))
    hint = ""
    if good.size:
        lens = good[1::2] - good[::2]
        k = int(np.argmax(lens))
        i, j = int(good[2 * k]), int(good[2 * k + 1]) - 1
        if j - i >= 2:  # keep one probe step away from the non-finite points
            lo = xs[i + 1] if i > 0 else xs[i]
            hi = xs[j - 1] if j < len(xs) - 1 else xs[j]
            hint = f", e.g. interval=({lo:.6g}, {hi:.6g})"
    raise ValueError(
        f"{what} is NaN or inf on {shown} (of interval=({a:.6g}, {b:.6g})): the table is "
        f"fitted on the whole interval, so f' must be finite there. Pass interval=(A, B) "
        f"inside the domain where the function is differentiable{hint}"
    )


def approximation_error(derivative, borders, levels, *, interval=(-10.0, 10.0), weight=None,
                        symmetric=False, grid: int = 4096) -> float:
    """Full-line weighted L2 error (eq. 3) of a given table against ``derivative``."""
    a, b = map(float, interval)
    wfun = weight if weight is not None else uniform_weight(a, b)
    borders = np.asarray(borders, dtype=np.float64)
    levels = np.asarray(levels, dtype=np.float64)

    def g(x):
        code = ((np.abs(x) if symmetric else x)[..., None] >= borders).sum(-1)
        return (np.asarray(derivative(x), dtype=np.float64) - levels[code]) ** 2 * wfun(x)

    # split the grid at the borders so the integrand is smooth on every cell
    pts = np.linspace(a, b, grid + 1)
    extra = np.concatenate([borders, -borders]) if symmetric else borders
    pts = np.unique(np.concatenate([pts, extra[(extra > a) & (extra < b)]]))
    return float(_cell_integrals(g, pts[:-1], pts[1:]).sum())


def fit(
    derivative: Callable[[np.ndarray], np.ndarray],
    bits: int,
    *,
    interval: tuple[float, float] = (-10.0, 10.0),
    weight: Callable[[np.ndarray], np.ndarray] | str | None = None,
    grid: int = 4096,
    symmetric: bool = False,
    refine: bool = True,
) -> Fit:
    """Fit the optimal ``2**bits``-level piecewise-constant approximation of ``derivative``.

    Args:
      derivative: vectorised numpy callable ``f'``, float64 in and out.
      bits: 1, 2, 3 or 4 (``2**bits`` levels).
      interval: ``(A, B)``, the support of the weight and the DP domain.
      weight: ``None`` or ``"uniform"`` (``1`` on ``[A, B]``), ``"gaussian"`` (standard normal
        density, restricted to ``[A, B]``) or a vectorised numpy callable ``w(x) >= 0``
        (restricted to ``[A, B]``).
      grid: number of DP cells ``n`` on ``[A, B]``.
      symmetric: fit ``q(|x|)`` (for even derivatives; requires ``A = -B``).
      refine: polish the DP borders with the gradient of eq. 5.

    Returns:
      :class:`Fit` with ``borders``, ``levels`` and ``error``.
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 4:
        raise ValueError(f"bits must be an integer in 1..4, got {bits!r}")
    if not callable(derivative):
        raise TypeError(f"derivative must be a callable, got {type(derivative).__name__}")
    a, b = map(float, interval)
    if not (np.isfinite(a) and np.isfinite(b) and a < b):
        raise ValueError(f"interval must be finite (A, B) with A < B, got {interval!r}")
    if not isinstance(grid, (int, np.integer)) or grid < 16:
        raise ValueError(f"grid must be an integer >= 16, got {grid!r}")
    check_finite_derivative(derivative, (a, b), points=2 * int(grid) + 1)
    box = uniform_weight(a, b)
    if weight is None or (isinstance(weight, str) and weight == "uniform"):
        inner = None
    elif isinstance(weight, str) and weight == "gaussian":
        inner = gaussian_weight()
    elif callable(weight):
        inner = weight
    else:
        raise ValueError(
            f"weight must be None, 'uniform', 'gaussian' or a callable, got {weight!r}"
        )

    def base(x):
        if inner is None:
            return box(x)
        return np.asarray(inner(x), dtype=np.float64) * box(x)

    if symmetric:
        if not np.isclose(a, -b):
            raise ValueError(f"symmetric=True needs a symmetric interval (-B, B), got {interval!r}")
        prob = _Problem(derivative, base, 0.0, b, grid, symmetric=True)
    else:
        prob = _Problem(derivative, base, a, b, grid, symmetric=False)
    k = 2**int(bits)
    borders = _dp(prob, k)
    levels, err = prob.levels_and_error(borders)
    if refine and k > 1:
        cand = _refine(prob, borders)
        l2, e2 = prob.levels_and_error(cand)
        if e2 < err and np.all(np.diff(cand) > 0):
            borders, levels, err = cand, l2, e2
    # the folded weight already integrates both halves, so err is the full-line error
    return Fit(
        borders=np.asarray(borders, dtype=np.float64),
        levels=np.asarray(levels, dtype=np.float64),
        error=float(err),
        bits=int(bits),
        interval=(a, b),
        symmetric=bool(symmetric),
    )
