"""Few-bit activation from any elementwise JAX function.

``make_activation(fn, bits)`` checks that ``fn`` is elementwise, obtains ``f'`` by autodiff
(float64), fits the optimal ``2**bits``-level table with :func:`jaxmem.fewbit.fit` once, caches
it per ``(fn, bits, interval, weight, grid, symmetric)``, and returns the few-bit op.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .activations import numpy_derivative
from .fit import Fit, check_finite_derivative, fit
from .ops import fewbit_op
from jaxmem._prims.checks import check_bits as _check_bits

__all__ = ["check_elementwise", "fit_function", "make_activation"]


def check_elementwise(fn: Callable, *, name: str = "fn", interval=(-3.7, 4.1),
                      shape=(7,)) -> None:
    """Raise ``ValueError`` unless ``fn`` maps arrays to same-shape arrays elementwise.

    Checked on a float32 probe of ``shape`` whose values spread over ``interval``: the output
    shape must equal the input shape, the Jacobian (reverse mode, so ``custom_vjp`` ops are
    checked too) must be diagonal among the probe points where ``fn`` and ``f'`` are finite,
    and applying ``fn`` to a permuted input must permute the output.  Works inside a traced
    function (the probe is evaluated eagerly).
    """
    if not callable(fn):
        raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
    a, b = map(float, interval)
    if not (np.isfinite(a) and np.isfinite(b) and a < b):
        raise ValueError(f"interval must be finite (A, B) with A < B, got {interval!r}")
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape, dtype=np.int64))
    if n < 2:
        raise ValueError(f"shape must hold at least 2 elements, got {shape}")
    vals = np.linspace(a, b, n, dtype=np.float64)
    vals = vals[np.random.default_rng(0).permutation(n)].reshape(shape)
    with jax.ensure_compile_time_eval():
        probe = jnp.asarray(vals, dtype=jnp.float32)
        try:
            out = jax.eval_shape(fn, probe)
        except Exception as e:
            raise ValueError(
                f"{name} could not be applied to a float32 array of shape {shape}: {e}") from e
        if not hasattr(out, "shape") or out.shape != probe.shape:
            raise ValueError(
                f"{name} is not elementwise: maps shape {probe.shape} to "
                f"{getattr(out, 'shape', type(out).__name__)}"
            )
        try:
            jac = np.asarray(jax.jit(jax.jacrev(fn))(probe), dtype=np.float64)
        except Exception:
            try:
                jac = np.asarray(jax.jit(jax.jacfwd(fn))(probe), dtype=np.float64)
            except Exception as e:
                raise ValueError(f"{name} could not be differentiated on a float32 probe: "
                                 f"{e}") from e
        jac = jac.reshape(n, n)
        fj = jax.jit(fn)
        y = np.asarray(fj(probe), dtype=np.float64).reshape(-1)
        diag = np.diag(jac)
        ok = np.isfinite(diag) & np.isfinite(y)
        if ok.sum() < 2:
            raise ValueError(
                f"{name} or its derivative is NaN/inf at {n - int(ok.sum())} of {n} probe points "
                f"in [{a:.6g}, {b:.6g}], so elementwise-ness cannot be checked: pass "
                "interval=(A, B) inside the domain where it is finite and differentiable"
            )
        sub = jac[np.ix_(ok, ok)]
        off = sub - np.diag(np.diag(sub))
        if not np.all(np.isfinite(off)) or np.max(np.abs(off)) > 0:
            raise ValueError(f"{name} is not elementwise: its Jacobian has off-diagonal entries "
                             "(an output element depends on other input elements)")
        perm = np.random.default_rng(1).permutation(n)
        flat = probe.reshape(-1)
        pa = y[perm]
        pb = np.asarray(fj(flat[perm].reshape(shape)), dtype=np.float64).reshape(-1)
    if not np.allclose(pa, pb, rtol=1e-6, atol=1e-6, equal_nan=True):
        raise ValueError(f"{name} is not elementwise: output depends on element positions")


def _is_even(d: Callable, interval) -> bool:
    a, b = interval
    x = np.linspace(0.0, max(abs(a), abs(b)), 257)[1:]
    y1, y2 = d(x), d(-x)
    return bool(np.allclose(y1, y2, rtol=1e-9, atol=1e-12))


@functools.lru_cache(maxsize=256)
def fit_function(fn: Callable, bits: int, interval=(-10.0, 10.0), weight=None, grid: int = 2048,
                 symmetric: bool | None = None) -> Fit:
    """Fitted table of ``fn``'s derivative (cached)."""
    d = numpy_derivative(fn)
    if symmetric is None:
        symmetric = np.isclose(interval[0], -interval[1]) and _is_even(d, interval)
    return fit(d, bits, interval=interval, weight=weight, grid=grid, symmetric=symmetric)


def make_activation(fn: Callable, bits: int = 3, *, interval=(-10.0, 10.0), weight=None,
                    grid: int = 2048, symmetric: bool | None = None,
                    name: str | None = None) -> Callable:
    """Few-bit activation from an elementwise JAX function ``fn``.

    Args:
      fn: elementwise ``jnp`` function (checked; non-elementwise functions raise ValueError).
        Its derivative must be finite on the whole ``interval`` (e.g. ``jnp.sqrt`` needs
        ``interval=(eps, B)``); otherwise ValueError names where it is NaN/inf.
      bits: 1..4.
      interval, weight, grid: passed to :func:`jaxmem.fewbit.fit`.
      symmetric: ``None`` = detect an even derivative automatically.
      name: label used in errors and the op's ``__name__``.

    Returns:
      ``op(x)``: ``fn(x)`` forward, ``dy * q(x)`` backward; ``op.fit`` holds the table.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.fewbit import make_activation
      >>> gelu3 = make_activation(jax.nn.gelu, bits=3, grid=256)
      >>> x = jnp.linspace(-3.0, 3.0, 7)
      >>> bool(jnp.allclose(gelu3(x), jax.nn.gelu(x)))
      True
      >>> jax.grad(lambda v: gelu3(v).sum())(x).shape
      (7,)
    """
    bits = _check_bits(bits)
    label = name or getattr(fn, "__name__", "fn")
    a, b = map(float, interval)
    check_elementwise(fn, name=label, interval=(a, b))
    check_finite_derivative(numpy_derivative(fn), (a, b), points=2 * int(grid) + 1,
                            what=f"the derivative of {label}")
    f = fit_function(fn, bits, tuple(map(float, interval)), weight, int(grid), symmetric)
    op = fewbit_op(fn, f.borders, f.levels, bits, symmetric=f.symmetric, name=label)
    op.fit = f
    return op
