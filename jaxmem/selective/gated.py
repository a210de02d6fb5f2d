"""Elementwise products of recomputable values: a gated linear unit keeps its gates' inputs.

For ``y = a * b`` (same shape) reverse mode needs

    dL/da = g * b,        dL/db = g * a,        g = dL/dy,

so autodiff keeps ``a`` and ``b``.  In a gated linear unit ``y = act(x W) * (x V)``
(SwiGLU, GeGLU: Llama, Mistral, Gemma, T5 v1.1) ``a = act(z)`` is the output of an exact
activation (:func:`jaxmem.selective.smooth_activation`) that keeps ``z`` for its own
backward, and the down projection ``y U`` keeps ``y`` for ``dL/dU``: four hidden-width
arrays per unit (``z``, ``a``, ``b``, ``y``).  :func:`gated_product` keeps the residuals of
``a``'s producer -- the very ``z``, stored once -- instead of ``a`` and recomputes
``a = act(z)`` in the backward pass (the forward's arithmetic: bit for bit), and records
``y`` as recomputable from ``z`` and ``b`` (:mod:`jaxmem._prims.recipes`), so a selective
product reading ``y`` keeps nothing more: two arrays per unit (``z``, ``b``).  Either factor
may be such a value (``x * sigmoid(x)`` keeps ``x`` once); a factor without a recipe is kept
as it is.  The gradients are autodiff's (``g * b``, ``g * a``, the same products).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxmem._prims.recipes import MAX_ARGS, depth, kept, recipe, remember
from jaxmem.selective._core import is_zero, perturbed, recomputed, value

__all__ = ["gated_product", "recomputable_factor"]


def _factor_recipe(x: Any):
    """``x``'s recipe ``(fn, args, groups)`` when :func:`gated_product` keeps ``x`` by its
    producer's residuals (see :func:`recomputable_factor`), else ``None``."""
    r = recipe(x) if depth(x) == 0 else None
    return r if r is not None and all(isinstance(a, jax.Array) for a in r[1]) else None


def recomputable_factor(x: Any) -> bool:
    """Whether ``x`` is a value :func:`gated_product` keeps by its producer's residuals: an
    array output of a normalisation, an exact smooth activation or a mask activation of one
    (a recipe of depth 0 whose arguments are all arrays)."""
    return _factor_recipe(x) is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gated(fa, ka, fb, kb, a, b, ra, rb):
    del fa, ka, fb, kb, ra, rb
    return a * b


def _side(x, fn, groups, rec):
    """What a factor's backward needs of ``x``: its producer's residuals where that producer
    keeps them anyway (``(None, rec)``), else ``x`` itself (``(x, None)``)."""
    if fn is not None and kept(rec, groups, perturbed):
        return None, tuple(value(p) for p in rec)
    return value(x), None


def _gated_fwd(fa, ka, fb, kb, a, b, ra, rb):
    y = a.value * b.value
    keep_a = _side(a, fa, ka, ra) if b.perturbed else (None, None)   # dL/db = g a
    keep_b = _side(b, fb, kb, rb) if a.perturbed else (None, None)   # dL/da = g b
    return y, (keep_a, keep_b)


def _gated_bwd(fa, ka, fb, kb, res, g):
    (a, ra), (b, rb) = res
    if is_zero(g):
        return None, None, None, None
    if ra is not None:
        a = recomputed(fa, ra, ka, g, elementwise=True)
    if rb is not None:
        b = recomputed(fb, rb, kb, g, elementwise=True)
    da = None if b is None else g * b
    db = None if a is None else g * a
    return da, db, None, None


_gated.defvjp(_gated_fwd, _gated_bwd, symbolic_zeros=True)


def _product(fa, na, fb, *args):
    a = fa(*args[:na]) if fa is not None else args[0]
    b = fb(*args[na:]) if fb is not None else args[na]
    return a * b


def gated_product(a: ArrayLike, b: ArrayLike) -> jax.Array:
    """``a * b`` for two floating-point arrays of one shape and dtype, keeping for the
    backward the residuals that ``a``'s / ``b``'s producers keep anyway (see the module
    docstring) instead of the factors; plain ``a * b`` when neither factor is such a value.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.selective import smooth_activation
      >>> from jaxmem.selective.gated import gated_product
      >>> z, u = jnp.linspace(-2.0, 2.0, 5), jnp.arange(5.0)
      >>> f = lambda z, u: jnp.sum(gated_product(smooth_activation(jax.nn.silu, z), u))
      >>> g = jax.grad(f, (0, 1))(z, u)
      >>> want = jax.grad(lambda z, u: jnp.sum(jax.nn.silu(z) * u), (0, 1))(z, u)
      >>> all(bool(jnp.allclose(x, y)) for x, y in zip(g, want))
      True
    """
    if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
        raise ValueError(f"gated_product: factors of one shape and dtype, got "
                         f"{jnp.shape(a)} {jnp.result_type(a)} and {jnp.shape(b)} "
                         f"{jnp.result_type(b)}")
    if not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
        raise TypeError(f"gated_product: floating-point factors, got {jnp.result_type(a)}")
    sides = [_factor_recipe(x) for x in (a, b)]
    if sides == [None, None]:
        return a * b
    (fa, ra, ka), (fb, rb, kb) = (s if s is not None else (None, (), ((),)) for s in sides)
    y = _gated(fa, ka, fb, kb, a, b, ra, rb)
    # ``y`` recomputable from both sides' residuals (a factor without a recipe: itself),
    # kept when each side's producer keeps its own and each factor is differentiated
    args_a = ra if fa is not None else (a,)
    args_b = rb if fb is not None else (b,)
    groups_a = ka if fa is not None else ((0,),)
    n = len(args_a)
    groups_b = tuple(tuple(n + i for i in grp) for grp in (kb if fb is not None else ((0,),)))
    if n + len(args_b) <= MAX_ARGS:
        remember(y, functools.partial(_product, fa, n, fb), tuple(args_a) + tuple(args_b),
                 tuple(groups_a) + groups_b, 0)
    return y
