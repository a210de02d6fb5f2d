"""Budgets: bytes, a size string or a fraction of the untouched step's compiled bytes."""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

__all__ = ["budget_spec", "parse_budget"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
_BUDGET_HELP = ("int bytes (4096), a size string ('512MiB', '1.5GB', '4096') or a fraction in "
                "(0, 1] of the untouched step's compiled bytes (0.5 or '0.5')")


def budget_spec(budget: Any, who: str = "plan") -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)`` of a budget, checked without compiling anything.

    Accepted: an int (bytes, numpy integers too); a float in (0, 1] (numpy floats too: a
    fraction of the untouched step's compiled bytes); a string: digits (bytes, ``"4096"``), a
    decimal number (a fraction, ``"0.5"``) or a number with a unit (``"512MiB"``, ``"1.5GB"``;
    units B, KB, MB, GB, KiB, MiB, GiB). Raises a one-line ``TypeError`` (another type) or
    ``ValueError`` (a value out of range, NaN, infinity, an unknown unit)."""
    if isinstance(budget, (bool, np.bool_)):
        raise TypeError(f"{who}: budget must be {_BUDGET_HELP}; got {budget!r}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"{who}: budget must be > 0 bytes, got {budget}")
        return "bytes", int(budget)
    if isinstance(budget, (float, np.floating)):
        f = float(budget)
        if not (math.isfinite(f) and 0.0 < f <= 1.0):
            raise ValueError(f"{who}: a float budget is a fraction in (0, 1] of the untouched "
                             f"step's compiled bytes, got {budget!r} (give bytes as an int or "
                             f"a size string such as '512MiB')")
        return "fraction", f
    if isinstance(budget, str):
        mt = re.fullmatch(rf"\s*({_NUMBER})\s*([A-Za-z]*)\s*", budget)
        unit = mt.group(2).lower() if mt else ""
        if not mt or (unit and unit not in _UNITS):
            raise ValueError(f"{who}: budget string {budget!r} is not a size like '512MiB', "
                             f"'1.5GB', '4096' or a fraction like '0.5' (units: B, KB, MB, GB, "
                             f"KiB, MiB, GiB)")
        num = mt.group(1)
        if not unit and re.fullmatch(r"[0-9]+", num):
            return budget_spec(int(num), who)
        if not unit:
            if not 0.0 < float(num) <= 1.0:
                raise ValueError(f"{who}: budget string {budget!r} without a unit is a "
                                 f"fraction in (0, 1] of the untouched step's compiled bytes; "
                                 f"give bytes as digits ('4096') or with a unit ('1.5MiB')")
            return "fraction", float(num)
        val = float(num) * _UNITS[unit]
        if not math.isfinite(val) or int(val) <= 0:
            raise ValueError(f"{who}: budget {budget!r} must be a finite size of >= 1 byte")
        return "bytes", int(val)
    raise TypeError(f"{who}: budget must be {_BUDGET_HELP}; got {type(budget).__name__} "
                    f"{budget!r}")


def parse_budget(budget: Any, default_bytes: int | None = None) -> int:
    """Bytes of ``budget`` (see :func:`budget_spec` for what is accepted); a fraction is of
    ``default_bytes``, the untouched step's compiled bytes."""
    kind, value = budget_spec(budget)
    if kind == "bytes":
        return int(value)
    if default_bytes is None:
        raise ValueError(f"plan: the fraction budget {budget!r} needs the untouched step's "
                         f"compiled bytes")
    return max(1, int(value * default_bytes))


