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
    first = jax.lax.reshape(g, (g.size,))[:1] if g.ndim else g.reshape(1)
    # ``(g0 != g0)`` is a bool, 0 or 1 even when ``g0`` is inf/NaN, so the product is an
    # exact 0 that cannot turn a non-finite cotangent entry into a NaN elsewhere.
    return (first[0] != first[0]).astype(dtype) * jnp.zeros((), dtype)
