"""Tree comparisons shared by the test suite.

``assert_tree_close(got, want, rtol=, atol=)`` compares two pytrees leaf by leaf with
``numpy.testing.assert_allclose`` semantics (``|got - want| <= atol + rtol * |want|``) and,
when a leaf is off, names the leaf's path and its largest absolute and relative errors.
``atol`` may be a number or a function of the wanted leaf (see :func:`scaled_atol`), for
tolerances taken relative to a leaf's magnitude. ``assert_tree_norm_close`` is the per-leaf
norm comparison ``||got - want|| <= tol * ||want|| + atol * sqrt(size)``.

Import it from a test module as ``from _assert import assert_tree_close`` (the suite's
directory is on ``sys.path`` via ``conftest.py``).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Atol = float | Callable[[np.ndarray], float]


def max_abs(x, *, finite_only: bool = False) -> float:
    """Largest ``|x|`` (0.0 for an empty array); ``finite_only`` skips inf and NaN entries."""
    a = np.abs(np.asarray(x, np.float64))
    if finite_only:
        a = a[np.isfinite(a)]
    return float(np.max(a)) if a.size else 0.0


def scaled_atol(tol: float, *, floor: float = 0.0, plus: float = 0.0,
                finite_only: bool = False) -> Callable[[np.ndarray], float]:
    """``atol`` for a leaf ``w``: ``tol * max(floor, plus + max|w|)``.

    ``scaled_atol(t, plus=1.0)`` is ``t * (1 + max|w|)``; ``scaled_atol(t, floor=1.0)`` is
    ``t * max(1, max|w|)``; ``finite_only`` takes the maximum over finite entries only.
    """
    def atol(w):
        return tol * max(floor, plus + max_abs(w, finite_only=finite_only))
    return atol


def _array(x) -> np.ndarray:
    """A leaf as a NumPy array: PRNG keys as their key data, floats as float64."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    if jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(np.float64)
    return a


def _leaves(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat]


def _errors(g: np.ndarray, w: np.ndarray) -> str:
    """Largest absolute and relative error over the entries where both are finite, and how
    many entries are finite on one side only."""
    if g.dtype == bool or w.dtype == bool:
        g, w = g.astype(np.int64), w.astype(np.int64)
    fg, fw = np.isfinite(g), np.isfinite(w)
    both = fg & fw
    d = np.abs(g[both].astype(np.float64) - w[both].astype(np.float64))
    ref = np.abs(w[both].astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(ref > 0, d / ref, np.where(d > 0, np.inf, 0.0))
    text = (f"max abs err {float(d.max(initial=0.0)):.3g}, "
            f"max rel err {float(rel.max(initial=0.0)):.3g}")
    one_side = int(np.sum(fg != fw))
    return text + (f", {one_side} entries finite on one side only" if one_side else "")


def assert_tree_close(got, want, *, rtol: float = 0.0, atol: Atol = 0.0,
                      equal_nan: bool = True, same_dtype: bool = False,
                      err_msg: str = "") -> None:
    """``got`` and ``want`` have as many leaves, of equal shapes, each within
    ``atol + rtol * |want|`` (``atol`` a number or a function of the wanted leaf).

    ``same_dtype`` also asserts equal dtypes. As in NumPy, NaN and inf entries must sit at
    the same places on both sides (``equal_nan=False``: no NaN at all).
    """
    lg, lw = _leaves(got), _leaves(want)
    prefix = f"{err_msg}: " if err_msg else ""
    assert len(lg) == len(lw), (
        f"{prefix}{len(lg)} leaves, wanted {len(lw)}: {[p for p, _ in lg]} vs "
        f"{[p for p, _ in lw]}")
    for (path, u), (_, v) in zip(lg, lw):
        if same_dtype:
            du, dv = getattr(u, "dtype", type(u)), getattr(v, "dtype", type(v))
            assert du == dv, f"{prefix}leaf {path}: dtype {du}, wanted {dv}"
        g, w = _array(u), _array(v)
        assert g.shape == w.shape, f"{prefix}leaf {path}: shape {g.shape}, wanted {w.shape}"
        tol = float(atol(w)) if callable(atol) else float(atol)
        try:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=tol, equal_nan=equal_nan)
        except AssertionError as e:
            raise AssertionError(
                f"{prefix}leaf {path} (shape {g.shape}): {_errors(g, w)} "
                f"(rtol={rtol:.3g}, atol={tol:.3g})\n{e}") from None


def assert_tree_norm_close(got, want, *, tol: float, atol: float = 0.0,
                           err_msg: str = "") -> None:
    """Per leaf ``||got - want|| <= tol * ||want|| + atol * sqrt(size)`` (2-norms over all
    entries, in float64), as many leaves on both sides, equal shapes."""
    lg, lw = _leaves(got), _leaves(want)
    prefix = f"{err_msg}: " if err_msg else ""
    assert len(lg) == len(lw), f"{prefix}{len(lg)} leaves, wanted {len(lw)}"
    for (path, u), (_, v) in zip(lg, lw):
        g, w = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert g.shape == w.shape, f"{prefix}leaf {path}: shape {g.shape}, wanted {w.shape}"
        err, ref = float(np.linalg.norm(g - w)), float(np.linalg.norm(w))
        bound = tol * ref + atol * np.sqrt(w.size)
        assert err <= bound, (
            f"{prefix}leaf {path} (shape {g.shape}): ||got - want|| = {err:.3g} > {bound:.3g} "
            f"(relative {err / ref if ref else np.inf:.3g}, tol={tol:.3g}, atol={atol:.3g}); "
            f"max abs err {float(np.max(np.abs(g - w), initial=0.0)):.3g}")
