"""Collectives in a compiled XLA program: how many, of which kind, and how many bytes.

Every technique in jaxmem must add no communication over plain JAX for the same sharding.
The compiled HLO text (``jax.jit(f).lower(*args).compile().as_text()``) lists each collective
as one instruction; this module counts them by opcode and sums their result bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

#: The collective opcodes counted (async forms ``-start`` are counted once, ``-done`` never).
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")


@dataclass(frozen=True)
class Collectives:
    """Counts and result bytes of each collective kind in one compiled program."""

    counts: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.counts.values())

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def __le__(self, other: Collectives) -> bool:
        """Kind by kind: no more collectives than ``other``."""
        return all(self.counts.get(k, 0) <= other.counts.get(k, 0) for k in KINDS)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def _top_level(type_text: str) -> list[str]:
    """The elements of a tuple type ``(a, b, ...)`` (``[type_text]`` when not a tuple)."""
    t = re.sub(r"/\*.*?\*/", "", type_text).strip()
    if not t.startswith("("):
        return [t]
    parts, depth, cur = [], 0, ""
    for ch in t[1:-1]:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _result_bytes(result_type: str, kind: str, start: bool) -> int:
    """Bytes of a collective's results. An async ``*-start`` of all-gather, reduce-scatter,
    collective-permute or all-to-all has the type ``(operands, results, ...)``: only the
    second element counts (all of it when XLA combined several collectives into one tuple);
    an ``all-reduce-start`` has its results' type."""
    if start and kind != "all-reduce":
        parts = _top_level(result_type)
        if len(parts) >= 2:
            return _shape_bytes(parts[1])
    return _shape_bytes(result_type)


def collectives(hlo_text: str) -> Collectives:
    """Count the collectives in compiled HLO text.

    Args:
      hlo_text: ``compiled.as_text()`` of a ``jax.jit(...).lower(...).compile()`` result.

    Returns:
      A :class:`Collectives` with, for each kind in :data:`KINDS`, the number of
      instructions and the bytes of their results (the per-device buffers each produces;
      a combined collective, one instruction over a tuple, counts once with all its
      results' bytes).
    """
    if not isinstance(hlo_text, str):
        raise TypeError(f"collectives: hlo_text must be the compiled HLO text (str), got "
                        f"{type(hlo_text).__name__}; use jax.jit(f).lower(*args).compile().as_text()")
    counts = {k: 0 for k in KINDS}
    nbytes = {k: 0 for k in KINDS}
    for line in hlo_text.splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        kind = m.group(2)
        counts[kind] += 1
        nbytes[kind] += _result_bytes(m.group(1), kind, bool(m.group(3)))
    return Collectives(counts, nbytes)


def compiled_collectives(fn, *args, **kwargs) -> Collectives:
    """:func:`collectives` of ``jax.jit(fn)`` compiled for ``args`` (shardings as given)."""
    import jax

    compiled = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs).compile()
    return collectives(compiled.as_text())
