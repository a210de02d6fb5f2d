"""The exact attention core computed ``query_chunk`` query rows at a time.

:func:`jaxmem.selective.attention_core` keeps no ``T x S`` array between the passes, but each
pass still forms its scores, weights and their cotangents whole: several ``(..., H, T, S)``
arrays at once (at ``T = S = 2000``, 8 x 4 heads, 0.5 GB each). With
``AttentionSpec(query_chunk=c)`` both passes run over ``c`` query rows at a time (a
``lax.scan`` over the whole chunks, then the remainder), so the working set is
``(..., H, c, S)``:

* forward: each row's softmax needs only that row's scores, so a chunk's output rows and row
  statistics ``m, l`` are the whole pass's rows (the same arithmetic per row);
* backward: ``dq`` of a chunk's rows needs only those rows; ``dk = sum_c ds_c^T q_c`` and
  ``dv = sum_c (P_c M_c)^T do_c`` are accumulated over the chunks (in float32 at least: the
  sums' order differs from one ``T``-long contraction, at float rounding level), as is the
  gradient of a bias without a query axis; a bias with one gets its rows per chunk.

Masks and biases are sliced to the chunk's rows where they have a query axis (a causal band is
formed per chunk from its row offset); the dropout multiplier of a chunk is the same rows of
the whole pass's ``bernoulli`` draw (the same bits as unchunked). Nothing is chunked where
``T <= c``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem._prims.ties import zeros_created_after

__all__ = ["chunked", "forward_in_chunks", "grads_in_chunks"]


def chunked(spec, q) -> bool:
    """Whether ``spec`` asks for query chunks smaller than ``q``'s ``T`` rows."""
    return spec.query_chunk is not None and q.shape[-3] > spec.query_chunk


def _rows(a, lo, size: int, t: int):
    """Rows ``lo : lo + size`` of a scores-like array (``(..., T', S)``, ``T'`` its query
    axis) when it has ``T`` of them; otherwise (one row, broadcast) ``a`` itself."""
    if a is None or a.ndim < 2 or a.shape[-2] != t:
        return a
    return lax.dynamic_slice_in_dim(a, lo, size, a.ndim - 2)


def _keep_rows(mask, causal, lo, size: int, t: int, s_len: int):
    """The chunk's boolean ``keep`` (mask rows and causal band), or ``None``."""
    keep = _rows(mask, lo, size, t)
    if causal is not None:
        rows = lo + jnp.arange(size)[:, None]
        band = jnp.arange(s_len)[None, :] <= rows + (s_len - t if causal == "bottom_right"
                                                      else 0)
        keep = band if keep is None else jnp.logical_and(keep, band)
    return keep


def _over_chunks(one, t: int, c: int, carry, rows, axes):
    """Run ``one(lo, size, carry) -> (carry, row_parts)`` over the whole chunks (a scan)
    and the remainder, writing each ``row_parts[i]`` into ``rows[i]`` at ``lo`` along
    ``axes[i]``; returns the final ``carry`` and ``rows``. ``rows`` are buffers made with
    :func:`jaxmem._prims.ties.zeros_created_after` (a plain zeros buffer, or a scan's stacked
    outputs, has no operand: XLA:GPU creates it at the start of the program and keeps every
    layer's until its backward -- measured, 3.5 activation-sized arrays per layer)."""
    n, rem = divmod(t, c)

    def put(rows, parts, lo):
        return tuple(r if p is None else lax.dynamic_update_slice_in_dim(r, p, lo, ax)
                     for r, p, ax in zip(rows, parts, axes))

    def step(state, i):
        carry, rows = state
        carry, parts = one(i * c, c, carry)
        return (carry, put(rows, parts, i * c)), None

    (carry, rows), _ = lax.scan(step, (carry, tuple(rows)), jnp.arange(n))
    if rem:
        carry, parts = one(n * c, rem, carry)
        rows = put(rows, parts, n * c)
    return carry, rows


def _chunk_inputs(spec, q, k, bias, mask, rng):
    """``(sub, wshape, inputs)``: the spec of one chunk (no causal band, no chunking), the
    whole pass's weights shape, and ``inputs(lo, size) -> (q rows, bias rows, keep, dropout
    mask)`` of the chunk of rows ``lo : lo + size`` (the dropout mask the same rows of the
    whole pass's draw; ``None`` without dropout)."""
    from jaxmem.selective.attention import _dropout_keep

    t, s_len = q.shape[-3], k.shape[-3]
    wshape = jnp.broadcast_shapes(q.shape[:-3] + (q.shape[-2], t, s_len),
                                  *(() if a is None else a.shape for a in (bias, mask)))

    def inputs(lo, size):
        drop = (_rows(_dropout_keep(rng, spec, k.ndim, wshape), lo, size, t)
                if spec.dropout_rate > 0.0 else None)
        return (lax.dynamic_slice_in_dim(q, lo, size, q.ndim - 3), _rows(bias, lo, size, t),
                _keep_rows(mask, spec.causal, lo, size, t, s_len), drop)

    return dataclasses.replace(spec, causal=None, query_chunk=None), wshape, inputs


def forward_in_chunks(q, k, v, bias, mask, rng, spec):
    """``(o, (m, l))`` of :func:`jaxmem.selective.attention._forward`, ``spec.query_chunk``
    rows at a time."""
    from jaxmem.selective.attention import _dropout_shape, _forward

    t, s_len = q.shape[-3], k.shape[-3]
    sub, wshape, inputs = _chunk_inputs(spec, q, k, bias, mask, rng)

    def one(lo, size, carry):
        qc, bc, keep, drop = inputs(lo, size)
        o, (m, den) = _forward(qc, k, v, bc, keep, None, sub, drop=drop)
        return carry, (o, m, den)

    # the outputs' shapes and dtypes: the whole pass traced abstractly
    struct = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
    drop_s = (jax.ShapeDtypeStruct(_dropout_shape(spec, k.ndim, wshape), jnp.bool_)
              if spec.dropout_rate > 0.0 else None)
    o_s, (m_s, _) = jax.eval_shape(
        lambda q, k, v, b, mask, drop: _forward(
            q, k, v, b, _keep_rows(mask, spec.causal, 0, t, t, s_len), None, sub, drop=drop),
        struct(q), struct(k), struct(v), struct(bias), struct(mask), drop_s)
    rows = (zeros_created_after(o_s.shape, o_s.dtype, q),
            zeros_created_after(m_s.shape, m_s.dtype, q),
            zeros_created_after(m_s.shape, m_s.dtype, q))
    _, (o, m, den) = _over_chunks(one, t, spec.query_chunk, None, rows,
                                  (o_s.ndim - 3, m_s.ndim - 2, m_s.ndim - 2))
    return o, (m, den)


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def grads_in_chunks(spec, q, k, v, bias, mask, rng, m, den, do):
    """``(dq, dk, dv, dbias, None, None)`` of :func:`jaxmem.selective.attention._core_grads`,
    ``spec.query_chunk`` rows at a time (``dk``, ``dv`` and a row-free bias's gradient
    accumulated over the chunks)."""
    from jaxmem.selective.attention import _raw_grads, _unbroadcast

    t = q.shape[-3]
    sub, _, inputs = _chunk_inputs(spec, q, k, bias, mask, rng)
    float_bias = bias is not None and jnp.issubdtype(bias.dtype, jnp.inexact)
    bias_rows = float_bias and bias.ndim >= 2 and bias.shape[-2] == t
    zeros = lambda a, dtype: zeros_created_after(a.shape, dtype, do)
    carry = (zeros(k, _acc_dtype(k.dtype)), zeros(v, _acc_dtype(v.dtype)),
             zeros(bias, _acc_dtype(bias.dtype)) if float_bias and not bias_rows else None)
    rows = (zeros(q, q.dtype), zeros(bias, bias.dtype) if bias_rows else None)

    def one(lo, size, carry):
        acc_k, acc_v, acc_b = carry
        qc, bc, keep, drop = inputs(lo, size)
        doc = lax.dynamic_slice_in_dim(do, lo, size, do.ndim - 3)
        dq, dk, dv, ds = _raw_grads(sub, qc, k, v, bc, keep, None, _rows(m, lo, size, t),
                                    _rows(den, lo, size, t), doc, drop=drop)
        acc_k = acc_k + _unbroadcast(dk, k.shape, acc_k.dtype)
        acc_v = acc_v + _unbroadcast(dv, v.shape, acc_v.dtype)
        db_rows = None
        if bias_rows:
            db_rows = _unbroadcast(ds, bc.shape, bias.dtype)
        elif float_bias:
            acc_b = acc_b + _unbroadcast(ds, bias.shape, acc_b.dtype)
        return (acc_k, acc_v, acc_b), (_unbroadcast(dq, qc.shape, q.dtype), db_rows)

    axes = (q.ndim - 3, None if bias is None else bias.ndim - 2)
    (acc_k, acc_v, acc_b), (dq, db) = _over_chunks(one, t, spec.query_chunk, carry, rows, axes)
    dbias = None
    if float_bias:
        dbias = db if bias_rows else acc_b.astype(bias.dtype)
    return (dq, acc_k.astype(k.dtype), acc_v.astype(v.dtype), dbias, None, None)
