"""The result of a matcher: a set of equations re-emitted as one memory-lean op."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jaxmem.transform.report import Row

__all__ = ["Match", "aval_str", "is_float"]


@dataclasses.dataclass
class Match:
    """Equations ``eqns`` (indices into the flat jaxpr) replaced by ``emit``.

    ``emit(*values of inputs)`` returns the values of ``outputs`` (jaxpr variables); it runs
    where the equation ``anchor`` (the last of ``eqns``, the one producing ``outputs``) was,
    so every input is available and every consumer of an output comes later.  Equations in
    ``eqns`` other than the anchor are dropped: their values are used by ``eqns`` only.
    ``fn``: for an exact smooth activation, the elementwise function it computes (so a
    product reading its output can be re-emitted with it, :mod:`.match_fused`)."""

    eqns: frozenset[int]
    anchor: int
    inputs: list
    outputs: list
    emit: Callable[..., list[Any]]
    row: Row
    fn: Callable | None = None


def aval_str(v) -> str:
    a = v.aval
    shape = ",".join(str(d) for d in getattr(a, "shape", ()))
    return f"{getattr(a, 'dtype', '?')}[{shape}]".replace("float", "f").replace("bfloat", "bf")


def is_float(v) -> bool:
    """``v`` is a floating-point (or complex) array: f16, bf16, f32, f64 (``np.inexact``
    alone misses bfloat16)."""
    return bool(jnp.issubdtype(v.aval.dtype, jnp.inexact))
