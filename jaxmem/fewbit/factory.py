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
from .fit import Fit, fit
from .ops import fewbit_op
from .pack import _check_bits

__all__ = ["check_elementwise", "fit_function", "make_activation"]


def check_elementwise(fn: Callable, *, name: str = "fn") -> None:
    """Raise ``ValueError`` unless ``fn`` maps arrays to same-shape arrays elementwise.

    Checked on probe vectors: the output shape must equal the input shape, the Jacobian must
    be diagonal, and applying ``fn`` to a permuted input must permute the output.
    """
    if not callable(fn):
        raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
    probe = jnp.asarray(np.linspace(-3.7, 4.1, 7), dtype=jnp.float32)
    try:
        out = jax.eval_shape(fn, probe)
    except Exception as e:
        raise ValueError(f"{name} could not be applied to a float32 vector: {e}") from e
    if not hasattr(out, "shape") or out.shape != probe.shape:
        raise ValueError(
            f"{name} is not elementwise: maps shape {probe.shape} to "
            f"{getattr(out, 'shape', type(out).__name__)}"
        )
    jac = np.asarray(jax.jit(jax.jacfwd(fn))(probe))
    off = jac - np.diag(np.diag(jac))
    if not np.all(np.isfinite(jac)) or np.max(np.abs(off)) > 0:
        raise ValueError(f"{name} is not elementwise: its Jacobian has off-diagonal entries")
    perm = np.array([3, 0, 6, 1, 5, 2, 4])
    fj = jax.jit(fn)
    a = np.asarray(fj(probe))[perm]
    b = np.asarray(fj(probe[perm]))
    if not np.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=True):
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
      bits: 1..4.
      interval, weight, grid: passed to :func:`jaxmem.fewbit.fit`.
      symmetric: ``None`` = detect an even derivative automatically.
      name: label used in errors and the op's ``__name__``.

    Returns:
      ``op(x)``: ``fn(x)`` forward, ``dy * q(x)`` backward; ``op.fit`` holds the table.
    """
    bits = _check_bits(bits)
    label = name or getattr(fn, "__name__", "fn")
    check_elementwise(fn, name=label)
    f = fit_function(fn, bits, tuple(map(float, interval)), weight, int(grid), symmetric)
    op = fewbit_op(fn, f.borders, f.levels, bits, symmetric=f.symmetric, name=label)
    op.fit = f
    return op
