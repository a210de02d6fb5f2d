"""Shared helpers for the selective primitives (not public)."""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxmem._prims.checks import as_int, int_tuple, positive_int  # noqa: F401 (re-exported)
from jaxmem._prims.recipes import kept, recipe, remember  # noqa: F401 (re-exported)
from jaxmem._prims.ties import tie, tie_elementwise

#: Prefix of every ``checkpoint_name`` tag a selective primitive puts on a residual, so remat
#: policies such as ``jax.checkpoint_policies.save_only_these_names`` can select them.
NAME_PREFIX = "jaxmem.selective."


def tag(x, what: str):
    """Tag residual ``x`` with ``checkpoint_name(x, "jaxmem.selective.<what>")``."""
    if x is None:
        return None
    return checkpoint_name(x, NAME_PREFIX + what)


# Values that a backward rule may recompute instead of storing (``remember`` / ``recipe``,
# :mod:`jaxmem._prims.recipes`): a normalisation registers its output ``y`` with the tensors
# its backward keeps (``x``, statistics, parameters: kept if ``x`` or ``scale`` is
# differentiated), an exact smooth activation (``jaxmem.selective.smooth_activation``) its
# output with its input, a 1-bit mask activation or a max pool applied to such a ``y`` its
# own output, ``recipes.combine`` an elementwise op of several such values (a residual add);
# a bilinear layer fed that very value then keeps those same tensors (one residual shared by
# the rules) instead of a second input-sized array. Under ``lax.scan`` the residuals are
# stacked per layer as JAX chose them, so both would be kept; unrolled, XLA:GPU keeps the
# ReLU output that a convolution reads beside the norm's input (ResNet on the H100 plan).


def recomputed(rec_fn, args, groups, dep, *, elementwise: bool = False):
    """``rec_fn(*args)`` -- a value a backward rule reads from its producers' residuals
    instead of keeping it (:mod:`jaxmem._prims.recipes`) -- tied to the cotangent ``dep`` so
    that XLA runs it in the backward pass, not in the forward one where it would keep the
    very value. One producer (a norm, and a pointwise convolution of its output): its first
    argument (the norm's ``x``) is tied. Several (``groups`` of :func:`recipes.combine`, a
    ResNet block output): every argument is, or XLA computes the untied parts in the forward
    pass and keeps them. Measured on ResNet-50 "All", H100 plan, adds recorded (with a
    max-pool recipe since left out): 11.94 MiB so; 14.46 tying the first argument only, 12.73
    tying each producer's ``x`` only; tying all arguments of a one-producer recipe too costs
    0.16 MiB without adds recorded. ``elementwise``: ``rec_fn`` runs elementwise ops only (a
    recipe of depth 0), so the arguments are tied with :func:`ties.tie_elementwise` (off CPU
    no copy of an argument that is a slice of a merged GEMM's output)."""
    tie_ = tie_elementwise if elementwise else tie
    if len(groups) > 1:
        return rec_fn(*tie_(tuple(args), dep))
    first, *rest = args
    return rec_fn(tie_(first, dep), *rest)


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
