"""Bias add whose bias gradient is formed as soon as the cotangent arrives.

``y = a + B(b)``, ``B`` a broadcast of the bias ``b`` over the batch / sequence / spatial
axes (Dense and convolution biases):
``dL/da = g`` and ``dL/db = Bᵀ(g)``, the sum of ``g`` over the broadcast axes -- what JAX's
autodiff computes too, bit for bit. Nothing is kept for the backward pass.

The difference is the order. ``dL/db`` is read only by the optimizer update, so XLA:GPU
schedules every bias gradient at the end of the backward pass and keeps each layer's
output cotangent ``g`` alive until then: one layer-output-sized array per biased layer, all
at once (measured on the H100 plan: a Linen LM's MLP keeps its hidden cotangent through the
whole backward pass). Here ``g`` flows on to the layers before only once ``Bᵀ(g)`` exists
(:func:`jaxmem._prims.ties.after`: an ``optimization_barrier`` on XLA:GPU, nothing on
XLA:CPU, whose scheduler already reduces it where ``g`` is made), so ``g`` dies in its
layer.

A projection recorded as recomputable for the attention core
(:func:`jaxmem._prims.recipes.project`) stays recorded through its bias: ``y`` is recorded as
``recomputed(a) + B(b)``, the same ``add``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.typing import ArrayLike

from jaxmem._prims.grad_layout import input_after
from jaxmem._prims.recipes import PROJECTED, depth, extend
from jaxmem._prims.ties import typed_struct, vary_like
from jaxmem.selective._core import check_float, is_zero

__all__ = ["bias_add"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _bias_add(broadcast, b_struct, a, b):
    del b_struct
    return a + broadcast(b)


def _bias_add_fwd(broadcast, b_struct, a, b):
    del b_struct
    # which cotangents are asked for, as the residuals' structure (no arrays kept)
    return a.value + broadcast(b.value), (() if a.perturbed else None,
                                          () if b.perturbed else None)


def _bias_add_bwd(broadcast, b_struct, res, g):
    a_perturbed, b_perturbed = (r is not None for r in res)
    if is_zero(g):
        return None, None
    db = None
    if b_perturbed:
        (db,) = jax.linear_transpose(broadcast, b_struct)(g)
    ga = None
    if a_perturbed:
        ga, db = input_after(g, db, everywhere=True)
    return ga, db


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd, symbolic_zeros=True)


def bias_add(a: ArrayLike, b: ArrayLike,
             broadcast: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """``a + broadcast(b)``, with ``dL/db`` formed before ``dL/da`` flows on (XLA:GPU).

    Args:
      a: the layer output, a floating-point array.
      b: the bias (of ``a``'s dtype unless ``broadcast`` casts it).
      broadcast: a linear map of ``b`` to an array of ``a``'s shape and dtype (broadcasts,
        reshapes, a cast; default: NumPy broadcasting of ``b`` against ``a``, i.e. ``b``
        aligned with ``a``'s trailing axes).

    Returns:
      ``a + broadcast(b)``; the same values and gradients as the plain expression.
    """
    check_float("bias_add: a", a)
    check_float("bias_add: b", b)
    a, b = jax.numpy.asarray(a), jax.numpy.asarray(b)
    if broadcast is None:
        if a.dtype != b.dtype:
            raise TypeError(f"bias_add: a and b must have one dtype, got {a.dtype} and "
                            f"{b.dtype}")
        shape = a.shape
        try:
            ok = jax.numpy.broadcast_shapes(a.shape, b.shape) == a.shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"bias_add: b of shape {b.shape} does not broadcast to a's "
                             f"shape {a.shape}")
        broadcast = functools.partial(jax.numpy.broadcast_to, shape=shape)
    b = vary_like(b, a)
    out = jax.eval_shape(broadcast, b)
    if out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(f"bias_add: broadcast(b) is {out.dtype}{list(out.shape)}, a is "
                         f"{a.dtype}{list(a.shape)}")
    y = _bias_add(broadcast, typed_struct(b), a, b)
    if depth(a) == PROJECTED:
        extend(y, functools.partial(_plus, broadcast), a, (b,), elementwise=True)
    return y


def _plus(broadcast, a, b):
    return a + broadcast(b)
