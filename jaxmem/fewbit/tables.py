"""Shipped few-bit tables (package data ``jaxmem/fewbit/tables/<name>.json``).

Each JSON file holds, for one activation, the fit settings and for ``bits`` in 1..4 the
``borders`` (``2**bits - 1``), ``levels`` (``2**bits``) and ``error`` of
:func:`jaxmem.fewbit.fit`.  Regenerate with ``python scripts/make_fewbit_tables.py``.

This module imports neither jax nor torch, so ``torch_ref.fewbit`` loads the very same
numbers.  At run time the tables are used in float32: a code is
``#{i : float32(x) >= float32(borders[i])}`` (of ``|x|`` for symmetric tables) and the
gradient is ``float32(dy) * float32(levels[code])``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

import numpy as np

from jaxmem._prims.checks import check_bits

__all__ = ["Table", "load_table", "table_document", "table_names"]


@dataclasses.dataclass(frozen=True)
class Table:
    """Borders/levels of one activation at one bit width (float64 as stored)."""

    name: str
    bits: int
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    error: float
    symmetric: bool
    interval: tuple[float, float]

    @property
    def borders_f32(self) -> np.ndarray:
        return np.asarray(self.borders, dtype=np.float32)

    @property
    def levels_f32(self) -> np.ndarray:
        return np.asarray(self.levels, dtype=np.float32)


def table_names() -> list[str]:
    """Names of the shipped tables."""
    root = resources.files("jaxmem.fewbit") / "tables"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


@functools.cache
def table_document(name: str) -> dict:
    """The parsed JSON document of one activation (all bit widths + settings)."""
    root = resources.files("jaxmem.fewbit") / "tables"
    path = root / f"{name}.json"
    if not isinstance(name, str) or not path.is_file():
        raise ValueError(f"no few-bit table for activation {name!r}; shipped: {table_names()}")
    return json.loads(path.read_text())


@functools.cache
def load_table(name: str, bits: int) -> Table:
    """The shipped table of ``name`` at ``bits`` bits per element."""
    bits = check_bits(bits)
    doc = table_document(name)
    entry = doc["bits"][str(bits)]
    return Table(
        name=name,
        bits=bits,
        borders=tuple(float(v) for v in entry["borders"]),
        levels=tuple(float(v) for v in entry["levels"]),
        error=float(entry["error"]),
        symmetric=bool(doc["symmetric"]),
        interval=tuple(doc["interval"]),
    )
