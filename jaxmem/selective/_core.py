"""Shared helpers for the selective primitives (not public)."""
from __future__ import annotations

import math
import numbers
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxmem._prims.checks import as_int, int_tuple, positive_int  # noqa: F401 (re-exported)

#: Prefix of every ``checkpoint_name`` tag a selective primitive puts on a residual, so remat
#: policies such as ``jax.checkpoint_policies.save_only_these_names`` can select them.
NAME_PREFIX = "jaxmem.selective."


def tag(x, what: str):
    """Tag residual ``x`` with ``checkpoint_name(x, "jaxmem.selective.<what>")``."""
    if x is None:
        return None
    return checkpoint_name(x, NAME_PREFIX + what)


# Values that a backward rule may recompute instead of storing:
# ``id(y) -> (ref, fn, args, kept_if)`` with ``y == fn(*args)`` exactly, where the producer's
# own backward keeps ``args`` whenever one of ``args[i]``, ``i in kept_if``, is differentiated.
# A normalisation registers its output ``y`` with the tensors its backward keeps (``x``,
# statistics, parameters: kept if ``x`` or ``scale`` is differentiated), an exact smooth
# activation (``jaxmem.selective.smooth_activation``) its output with its input; a bilinear
# layer fed that very ``y`` then keeps those same tensors (one residual shared by both rules)
# instead of a second input-sized ``y``. XLA recomputes such a ``y`` by fusion in an unrolled
# network, but under ``lax.scan`` the residuals are stacked per layer as JAX chose them, so
# both would be kept.
_recipes: dict = {}


def remember(y, fn, args, kept_if=(0, 3)) -> None:
    """Record that ``y`` equals ``fn(*args)`` bit for bit (until ``y`` is garbage), and that
    the producer of ``y`` keeps ``args`` for its backward when any ``args[i]``,
    ``i in kept_if``, is differentiated (the default: a normalisation's ``x`` and ``scale``)."""
    key = id(y)

    def _drop(_, key=key):
        _recipes.pop(key, None)

    try:
        ref = weakref.ref(y, _drop)
    except TypeError:  # not weak-referenceable (plain numbers): nothing to record
        return
    _recipes[key] = (ref, fn, args, tuple(kept_if))


def recipe(x):
    """``(fn, args, kept_if)`` recorded by :func:`remember` for this very object ``x``, else
    ``None``."""
    entry = _recipes.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3]


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
