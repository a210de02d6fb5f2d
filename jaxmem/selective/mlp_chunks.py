"""A two-layer perceptron whose passes run ``rows`` rows at a time.

``z = f(x W1 + b1) W2`` with ``x`` of shape ``(..., D)``, ``f`` elementwise, ``W1``, ``W2``
matrices. The forward pass computes each chunk of rows' outputs with the same equations (no
``R x F`` array formed there either, e.g. where a recomputed block runs it again). Kept for the
backward pass: ``x``, ``W1``, ``b1``, ``W2`` (the inputs: ``R x D`` values for ``R`` rows,
where the plain composition keeps ``x W1 + b1`` or ``f`` of it, ``R x F``). The backward
pass, over the rows ``r`` of one chunk at a time (a ``lax.scan`` over the whole chunks, then
the remainder):

    h_r = x_r W1 + b1,   a_r = f(h_r)                      (recomputed)
    dW2 += a_r^T dz_r,   dh_r = f'(h_r) * (dz_r W2^T)
    dW1 += x_r^T dh_r,   db1 += sum_r dh_r,   dx_r = dh_r W1^T

so its working set is ``rows x F`` arrays instead of ``R x F`` ones. The chunk's gradients are
JAX's own rules (``jax.vjp`` of ``f(x_r W1 + b1)``, the transposes of the second product); the
weight gradients are summed over the chunks in
float32 at least (their order of summation differs from one ``R``-long contraction: float
rounding level). It recomputes ``x W1`` (one of the MLP's six products) in the backward pass:
free where the block is recomputed anyway (``jax.checkpoint``), one product more where it is
stored. Nothing is chunked where ``R <= rows``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem._prims.ties import tie, zeros_created_after
from jaxmem.selective.attention_chunks import _acc_dtype, _over_chunks

__all__ = ["chunked_mlp"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    """``f`` (elementwise), ``first(a, w1)`` / ``second(a, w2)`` (products of a row block
    ``(n, D)`` with a matrix), ``rows`` per chunk."""

    f: Callable
    first: Callable
    second: Callable
    rows: int


def _mlp(spec: _Spec, x, w1, bias: tuple, w2):
    h = spec.first(x, w1)
    if bias:
        h = h + bias[0]
    return spec.second(spec.f(h), w2)


def _forward_in_chunks(spec: _Spec, x, w1, bias, w2):
    """``_mlp`` over ``spec.rows`` rows at a time (each row's output is its own products':
    no ``R x F`` array is formed)."""
    n_rows = math.prod(x.shape[:-1])
    x2 = x.reshape(n_rows, x.shape[-1])
    out = jax.eval_shape(lambda a: _mlp(spec, a, w1, bias, w2),
                         jax.ShapeDtypeStruct((1, x.shape[-1]), x.dtype))
    buf = zeros_created_after((n_rows, out.shape[-1]), out.dtype, x2)

    def one(lo, size, carry):
        return carry, _mlp(spec, lax.dynamic_slice_in_dim(x2, lo, size, 0), w1, bias, w2)

    _, z = _over_rows(one, n_rows, spec.rows, None, buf)
    return z.reshape(*x.shape[:-1], out.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(spec: _Spec, x, w1, bias, w2):
    return _forward_in_chunks(spec, x, w1, bias, w2)


def _fwd(spec: _Spec, x, w1, bias, w2):
    vals = (x.value, w1.value, tuple(b.value for b in bias), w2.value)
    wanted = (x.perturbed, w1.perturbed, tuple(b.perturbed for b in bias), w2.perturbed)
    return _forward_in_chunks(spec, *vals), (vals, wanted)


def _zero(ct) -> bool:
    from jax.custom_derivatives import SymbolicZero
    return ct is None or isinstance(ct, SymbolicZero)


def _over_rows(one, n_rows: int, c: int, carry, out):
    """``one(lo, size, carry) -> (carry, rows)`` over the whole chunks (a scan) and the
    remainder, ``rows`` written into ``out`` (``None``: no rows) at ``lo``."""
    def one_(lo, size, carry):
        carry, part = one(lo, size, carry)
        return carry, (part,)

    carry, (out,) = _over_chunks(one_, n_rows, c, carry, (out,), (0,))
    return carry, out


def _bwd(spec: _Spec, res, g):
    (x, w1, bias, w2), (dx_on, dw1_on, db_on, dw2_on) = res
    db_on = bool(db_on and db_on[0])
    if _zero(g):
        return None, None, tuple(None for _ in bias), None
    n_rows = math.prod(x.shape[:-1])
    x2 = x.reshape(n_rows, x.shape[-1])
    g2 = g.reshape(n_rows, g.shape[-1])
    weights = (w1, bias[0] if bias else None, w2)
    on = (dw1_on, db_on, dw2_on)
    acc = tuple(zeros_created_after(w.shape, _acc_dtype(w.dtype), g) if o else None
                for w, o in zip(weights, on))
    out = zeros_created_after(x2.shape, x.dtype, g) if dx_on else None

    def one(lo, size, carry):
        xc = lax.dynamic_slice_in_dim(x2, lo, size, 0)
        gc = lax.dynamic_slice_in_dim(g2, lo, size, 0)

        def hidden(xc, w1, b):
            h = spec.first(xc, w1)
            return spec.f(h if b is None else h + b)

        # f(h) and its linearisation from one recomputed h; the second product's two
        # transposes by hand (its forward is not needed again)
        a, vjp = jax.vjp(hidden, tie(xc, gc), w1, weights[1])
        (dw2,) = jax.linear_transpose(lambda w: spec.second(a, w), w2)(gc)
        (da,) = jax.linear_transpose(lambda h: spec.second(h, w2), a)(gc)
        dxc, dw1, db = vjp(da)
        carry = tuple(None if acc is None else acc + d.astype(acc.dtype)
                      for acc, d in zip(carry, (dw1, db, dw2)))
        return carry, (dxc if dx_on else None)

    (aw1, ab, aw2), dx = _over_rows(one, n_rows, spec.rows, acc, out)
    cast = lambda a, w: None if a is None else a.astype(w.dtype)
    return (None if dx is None else dx.reshape(x.shape), cast(aw1, w1),
            tuple(cast(ab, b) for b in bias), cast(aw2, w2))


_chunked.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _product(axis: int, params: dict | None):
    """``a (n, D) @ w`` contracting ``w``'s axis ``axis`` (0 or 1), with ``dot_general``'s
    other parameters (precision, preferred element type) from ``params``."""
    extra = {k: v for k, v in (params or {}).items() if k in ("precision",
                                                              "preferred_element_type")}

    def product(a, w):
        return lax.dot_general(a, w, (((a.ndim - 1,), (axis,)), ((), ())), **extra)

    return product


def chunked_mlp(x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array,
                activation: Callable, rows: int, *, w1_axis: int = 0,
                w2_axis: int = 0, w1_params: dict | None = None,
                w2_params: dict | None = None) -> jax.Array:
    """``activation(x @ W1 + b1) @ W2`` with both passes ``rows`` rows at a time (see the
    module docstring): keeps the inputs alone and recomputes ``x W1`` in the backward pass.

    x: ``(..., D)``; w1: a matrix whose axis ``w1_axis`` (0 or 1) has ``D`` entries (``(D,
    F)`` by default); b1: ``None`` or ``(F,)``; w2: a matrix contracted over its axis
    ``w2_axis`` with ``F`` entries; activation: elementwise; rows: an int >= 1 (rows of
    ``x``'s leading axes flattened). ``w*_params``: ``precision`` /
    ``preferred_element_type`` of the two products (``lax.dot_general``'s)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"chunked_mlp: rows must be an int >= 1, got {rows!r}")
    for name, w, axis in (("w1", w1, w1_axis), ("w2", w2, w2_axis)):
        if jnp.ndim(w) != 2 or axis not in (0, 1):
            raise ValueError(f"chunked_mlp: {name} must be a matrix contracted over axis 0 "
                             f"or 1, got shape {jnp.shape(w)} and axis {axis!r}")
    if jnp.ndim(x) < 1 or x.shape[-1] != w1.shape[w1_axis]:
        raise ValueError(f"chunked_mlp: x's last axis must match w1's axis {w1_axis}, got "
                         f"x {jnp.shape(x)} and w1 {w1.shape}")
    width = w1.shape[1 - w1_axis]
    if w2.shape[w2_axis] != width or (b1 is not None and jnp.shape(b1) != (width,)):
        raise ValueError(f"chunked_mlp: b1 must be None or ({width},) and w2's axis "
                         f"{w2_axis} must have {width} entries, got b1 "
                         f"{None if b1 is None else jnp.shape(b1)} and w2 {w2.shape}")
    spec = _Spec(activation, _product(w1_axis, w1_params), _product(w2_axis, w2_params),
                 rows)
    bias = () if b1 is None else (b1,)
    if math.prod(x.shape[:-1]) <= rows:
        return _mlp(spec, x, w1, bias, w2)
    return _chunked(spec, x, w1, bias, w2)
