"""The headline metric for layer-wise techniques: **bytes per added layer**.

``slope(measure, depth) = (measure(2 * depth) - measure(depth)) / depth``

``measure(L)`` is any deterministic memory figure of a model with ``L`` repeated layers
(residual bytes, compiled temp bytes, ...). Fixed costs (input, head, loss, code) cancel, so
the slope shows what one more layer costs; comparing the slope with and without a technique
shows whether XLA kept the saving (fusion can silently undo a residual trick).
"""
from __future__ import annotations

import numbers
from collections.abc import Callable

__all__ = ["slope"]


def slope(measure: Callable[[int], float], depth: int) -> float:
    """Bytes per added layer from depths ``depth`` and ``2 * depth``.

    Args:
      measure: ``depth -> bytes`` (int or float); called exactly twice.
      depth: positive int, the smaller depth.

    Raises:
      TypeError: ``measure`` not callable, ``depth`` not an int, or ``measure`` returned a
        non-number.
      ValueError: ``depth < 1``.
    """
    if not callable(measure):
        raise TypeError(f"slope: `measure` must be callable (depth -> bytes), got "
                        f"{type(measure).__name__}")
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral):
        raise TypeError(f"slope: `depth` must be a positive int, got {depth!r}")
    if depth < 1:
        raise ValueError(f"slope: `depth` must be >= 1, got {depth}")
    lo = measure(int(depth))
    hi = measure(2 * int(depth))
    for d, v in ((depth, lo), (2 * depth, hi)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"slope: measure({d}) returned {type(v).__name__} {v!r}; it must "
                            "return a number of bytes")
    return (float(hi) - float(lo)) / int(depth)
