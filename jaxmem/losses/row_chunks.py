"""A row-wise function of ``N`` rows, computed ``chunk_size`` rows at a time.

For ``fn`` mapping row-aligned arrays ``(C, ...)`` (and shared arrays, whole) to row-aligned
outputs ``(C, ...)``, where output row ``i`` depends on input row ``i`` only,
:func:`map_row_chunks` returns ``fn`` over all ``N`` rows: full chunks inside a ``lax.scan``,
the remainder after it, each chunk under ``jax.checkpoint``. Whatever ``fn`` forms inside a
chunk (a ``C x V`` block of logits) exists one chunk at a time, in the forward pass and again
in the backward pass, which runs ``fn`` a second time chunk by chunk. The values are ``fn``'s
on every row; gradients w.r.t. the shared arrays are sums over chunks (another summation
order than one call of ``fn`` on all rows). Shared arrays in a float type narrower than
float32 (bf16, f16) enter the chunks as float32 copies cast back inside (the same values), so
that their gradients are summed over chunks in float32 and rounded once, as one product over
all rows rounds them, instead of once per chunk.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["map_row_chunks"]


def _narrow_float(x):
    """The dtype of a float array narrower than float32 (``None`` for anything else)."""
    dt = getattr(x, "dtype", None)
    if dt is not None and jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits < 32:
        return dt
    return None


def map_row_chunks(fn: Callable[[tuple, Any], tuple], rows: Sequence[Any], shared: Any,
                   chunk_size: int) -> tuple:
    """``fn(rows, shared)`` computed ``chunk_size`` rows at a time (module docstring).

    Args:
      fn: ``fn(row_chunk, shared) -> tuple of arrays``; ``row_chunk`` is a tuple of arrays
        with ``C`` leading rows, each output has ``C`` leading rows.
      rows: arrays with the same leading size ``N >= 1``.
      shared: a pytree passed whole to every chunk (weights; ``None`` leaves allowed).
      chunk_size: rows per chunk (``>= 1``; clipped to ``N``).

    Returns:
      The tuple of ``fn``'s outputs on all ``N`` rows.
    """
    rows = tuple(rows)
    n = rows[0].shape[0]
    chunk = min(int(chunk_size), n)
    whole, rest = divmod(n, chunk)
    narrow = jax.tree_util.tree_map(_narrow_float, shared)
    wide = jax.tree_util.tree_map(
        lambda x, dt: x if dt is None else x.astype(jnp.float32), shared, narrow)

    def fn_wide(row_chunk, wide_shared):
        return fn(row_chunk, jax.tree_util.tree_map(
            lambda x, dt: x if dt is None else x.astype(dt), wide_shared, narrow))

    # inside the scan without CSE barriers, which a scan body does not need; the remainder
    # chunk outside it with them, so that XLA cannot merge its recomputation back
    piece = jax.checkpoint(fn_wide, prevent_cse=False)
    body = tuple(r[:whole * chunk].reshape(whole, chunk, *r.shape[1:]) for r in rows)

    def step(carry, xs):
        return carry, tuple(piece(xs, wide))

    _, outs = lax.scan(step, None, body)
    outs = tuple(o.reshape(whole * chunk, *o.shape[2:]) for o in outs)
    if rest:
        last = jax.checkpoint(fn_wide)(tuple(r[whole * chunk:] for r in rows), wide)
        outs = tuple(jnp.concatenate([o, t]) for o, t in zip(outs, last))
    return outs
