"""Shared helpers for the selective primitives (not public)."""
from __future__ import annotations

import math
import numbers
import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

#: Prefix of every ``checkpoint_name`` tag a selective primitive puts on a residual, so remat
#: policies such as ``jax.checkpoint_policies.save_only_these_names`` can select them.
NAME_PREFIX = "jaxmem.selective."


def tag(x, what: str):
    """Tag residual ``x`` with ``checkpoint_name(x, "jaxmem.selective.<what>")``."""
    if x is None:
        return None
    return checkpoint_name(x, NAME_PREFIX + what)


# Values that a backward rule may recompute instead of storing: ``id(y) -> (ref, fn, args)``
# with ``y == fn(*args)`` exactly. A normalisation registers its output ``y`` with the tensors
# its own backward keeps (``x``, statistics, parameters); a bilinear layer fed that very ``y``
# then keeps those same tensors (one residual shared by both rules) instead of a second
# input-sized ``y``. XLA recomputes such a ``y`` by fusion in an unrolled network, but under
# ``lax.scan`` the residuals are stacked per layer as JAX chose them, so both would be kept.
_recipes: dict = {}


def remember(y, fn, args) -> None:
    """Record that ``y`` equals ``fn(*args)`` bit for bit (until ``y`` is garbage)."""
    key = id(y)

    def _drop(_, key=key):
        _recipes.pop(key, None)

    try:
        ref = weakref.ref(y, _drop)
    except TypeError:  # not weak-referenceable (plain numbers): nothing to record
        return
    _recipes[key] = (ref, fn, args)


def recipe(x):
    """``(fn, args)`` recorded by :func:`remember` for this very object ``x``, else ``None``."""
    entry = _recipes.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2]


def value(p):
    """The primal value of a ``CustomVJPPrimal`` (or ``None``)."""
    return None if p is None else p.value


def perturbed(p) -> bool:
    """Whether a ``CustomVJPPrimal`` leaf is differentiated (``None`` counts as not)."""
    return p is not None and bool(p.perturbed)


def is_zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def as_int(v):
    """``v`` as a Python int if it is an integer (not a bool), else ``None``."""
    if isinstance(v, (bool, np.bool_)):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def int_tuple(fn: str, arg: str, v, n: int, minimum: int = 1) -> tuple:
    """``v`` (an int, or a sequence of ``n`` ints) as a tuple of ``n`` ints ``>= minimum``.

    Raises ``ValueError`` naming ``fn``, ``arg``, the value and what is allowed."""
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


def positive_int(fn: str, arg: str, v) -> int:
    """``v`` as a Python int ``>= 1``, else a ``ValueError`` naming ``fn`` and ``arg``."""
    i = as_int(v)
    if i is None or i < 1:
        raise ValueError(f"{fn}: {arg} must be a positive int, got {v!r}")
    return i


def check_eps(fn: str, eps) -> float:
    """``eps`` as a finite float ``>= 0``, else a ``ValueError``."""
    ok = isinstance(eps, numbers.Real) and not isinstance(eps, (bool, np.bool_))
    if not ok or not math.isfinite(float(eps)) or float(eps) < 0:
        raise ValueError(f"{fn}: eps must be a finite float >= 0, got {eps!r}")
    return float(eps)


def check_float(name: str, x) -> None:
    dt = jnp.result_type(x)
    if not jnp.issubdtype(dt, jnp.inexact):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dt}")



def zero_after(g, dtype):
    """A scalar ``0`` of ``dtype`` that data-depends on the cotangent ``g``.

    Backward rules that recompute something input-sized from residuals (``xhat`` from the
    stored ``x``) add this zero to it. Without the dependency XLA may schedule that
    recomputation in the forward pass and keep its full-size result alive until the backward
    pass next to the residual it came from -- measured on CPU for batch norm after a conv:
    8 B/element instead of 4. ``lax.optimization_barrier`` does not survive the CPU pipeline;
    a float product with zero does (XLA does not fold ``0 * x`` for floats). The zero is
    ``float(g0 != g0) * 0`` -- ``0 * g0`` would be NaN for an infinite ``g0`` and spread it
    over a whole gradient. Adding ``+0.0`` is exact. The selective convolutions use the same
    tie for their weight (see ``linear._after``).
    """
    if g.size == 0:  # nothing to depend on (and nothing to recompute): a constant zero
        return jnp.zeros((), dtype)
    first = jax.lax.reshape(g, (g.size,))[:1] if g.ndim else g.reshape(1)
    # ``(g0 != g0)`` is a bool, 0 or 1 even when ``g0`` is inf/NaN, so the product is an
    # exact 0 that cannot turn a non-finite cotangent entry into a NaN elsewhere.
    return (first[0] != first[0]).astype(dtype) * jnp.zeros((), dtype)
