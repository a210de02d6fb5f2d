"""Argument checks shared by the parts (no jax import: ``torch_ref`` loads it too).

Each check returns the value in canonical form (a Python ``int`` or a tuple of them) or
raises an error that names the argument, the value received and what is allowed.
Booleans are never integers here (``True`` is refused where an int is expected).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["as_int", "check_bits", "int_tuple", "positive_int"]


def as_int(v) -> int | None:
    """``v`` as a Python int if it is an integer (Python or NumPy, not a bool), else ``None``."""
    if isinstance(v, (bool, np.bool_)):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def check_bits(bits, allowed: Sequence[int] = (1, 2, 3, 4), name: str = "bits") -> int:
    """``bits`` as a Python int drawn from ``allowed``, else ``ValueError``.

    The message reads ``"<name> must be an integer in 1..4, got 5"`` when ``allowed`` is a
    contiguous range and ``"<name> must be one of (1, 2, 4, 8), got 3"`` otherwise.
    """
    allowed = tuple(int(a) for a in allowed)
    b = as_int(bits)
    if b is None or b not in allowed:
        lo, hi = min(allowed), max(allowed)
        if allowed == tuple(range(lo, hi + 1)):
            what = f"an integer in {lo}..{hi}"
        else:
            what = f"one of {allowed}"
        raise ValueError(f"{name} must be {what}, got {bits!r}")
    return b


def positive_int(fn: str, arg: str, v) -> int:
    """``v`` as a Python int ``>= 1``, else a ``ValueError`` naming ``fn`` and ``arg``."""
    i = as_int(v)
    if i is None or i < 1:
        raise ValueError(f"{fn}: {arg} must be a positive int, got {v!r}")
    return i


def int_tuple(fn: str, arg: str, v, n: int, minimum: int = 1) -> tuple[int, ...]:
    """``v`` (an int, or a sequence of ``n`` ints) as a tuple of ``n`` ints ``>= minimum``.

    Raises ``ValueError`` naming ``fn``, ``arg``, the value and what is allowed.
    """
    allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    msg = f"{fn}: {arg} must be {allowed} or a sequence of {n} such ints, got {v!r}"
    i = as_int(v)
    if i is not None:
        if i < minimum:
            raise ValueError(msg)
        return (i,) * n
    try:
        items = tuple(v)
    except TypeError:
        raise ValueError(msg) from None
    out = tuple(as_int(e) for e in items)
    if len(out) != n or any(e is None or e < minimum for e in out):
        raise ValueError(msg)
    return out
