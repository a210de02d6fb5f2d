"""Shared helpers for the selective primitives (not public)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
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


def check_float(name: str, x) -> None:
    dt = jnp.result_type(x)
    if not jnp.issubdtype(dt, jnp.inexact):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dt}")


def after(res, g):
    """Return ``(res, g)`` behind an ``optimization_barrier``.

    Recomputation from residuals in a backward rule (``xhat = (x - mu) * rstd``, unpacking a
    mask) depends only on forward values, so XLA's scheduler is free to hoist it into the
    forward pass and keep its full-size result alive until the backward pass -- undoing the
    saving. Tying the residuals to the incoming cotangent ``g`` makes everything computed
    from them wait for ``g``, i.e. stay in the backward pass.
    """
    if is_zero(g):
        return res, g
    return jax.lax.optimization_barrier((res, g))
