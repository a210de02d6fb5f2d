"""An exact smooth activation and the product that reads it, as one op.

``z = P(f(x), w)`` where ``f`` is a smooth elementwise subgraph re-emitted as an exact op
(:func:`jaxmem.selective.smooth_activation`: keeps ``x``, recomputes ``f'``) and ``P`` the
``dot_general`` / convolution that is the only reader of ``f(x)``.  Separately, the two rules
each recompute from ``x`` in the backward pass: the product ``f(x)`` (for its weight
gradient), the activation ``f'(x)`` (for its input gradient), each from its own copy of
``x`` tied to its own cotangent (``dz`` and ``dz w^T``).  XLA:GPU cannot fuse the two
recomputations (their operands differ), and schedules the weight gradient's one late: the
pre-activation ``x`` then stays alive through the rest of the layer's backward pass (a
Linen LM block under ``nn.scan(nn.remat(...))``: one ``B x T x 4d`` array more at the peak
of XLA:GPU's H100 plan than when ``f`` is left to JAX, 2.16 vs 2.04 MiB).

:func:`activation_product` keeps what the pair keeps (``x`` if ``x`` or ``w`` is
differentiated, ``w`` if ``x`` is) and recomputes ``f(x)`` and ``f'(x)`` once, from one
``x`` tied to ``dz``: ``f(x)`` feeds the weight gradient, ``vjp(f, x)`` the input gradient,
so XLA computes both in one fusion next to their uses.  The forward is the very same
equations (``P(f(x), w)``); the gradients are JAX's own rules (``jax.vjp`` of ``f``, the
product's transposes), equal to autodiff up to how XLA fuses them.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxmem._prims.ties import tie, vary_like

__all__ = ["activation_product"]

#: the tag of the kept ``x`` (as :func:`jaxmem.selective.smooth_activation` tags it, so a
#: scan body's recompute policy treats it alike)
_PREFIX = "jaxmem.selective."


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    """``f`` (elementwise), ``product(a, w)`` (bilinear) and the avals of ``f(x)`` and
    ``w``; ``late``: tie ``w`` to the activation / cotangent it meets (convolutions, as
    :mod:`jaxmem.selective` does: XLA:CPU builds their re-laid-out weights early)."""

    f: Callable
    product: Callable
    fx: Any
    w: Any
    late: bool


def _zero(ct) -> bool:
    from jax.custom_derivatives import SymbolicZero
    return ct is None or isinstance(ct, SymbolicZero)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec: _Spec, x, w):
    return spec.product(spec.f(x), w)


def _fused_fwd(spec: _Spec, x, w):
    fx = spec.f(x.value)
    y = spec.product(fx, tie(w.value, fx) if spec.late else w.value)
    res_x = x.value if (x.perturbed or w.perturbed) else None
    res_w = w.value if x.perturbed else None
    return y, (res_x, res_w)


def _apart(spec: _Spec, x, w, g):
    """The two rules' backward passes in one (XLA:CPU): ``f(x)`` from ``x`` tied to ``g``
    for the weight gradient, then ``f'`` from ``x`` tied to the product's input gradient."""
    fx = spec.f(tie(x, g))
    wl = tie(w, g) if spec.late else w
    (dfx,) = jax.linear_transpose(lambda a: spec.product(a, wl), fx)(g)
    (dw,) = jax.linear_transpose(lambda b: spec.product(fx, b), w)(g)
    (dx,) = jax.vjp(spec.f, tie(x, dfx))[1](dfx)
    return dx, dw


def _together(spec: _Spec, x, w, g):
    """``f(x)`` and ``f'`` from one ``x`` tied to ``g`` (XLA:GPU fuses them into one
    kernel next to the weight gradient)."""
    fx, vjp_f = jax.vjp(spec.f, tie(x, g))
    (dw,) = jax.linear_transpose(lambda b: spec.product(fx, b), w)(g)
    wl = tie(w, g) if spec.late else w
    (dfx,) = jax.linear_transpose(lambda a: spec.product(a, wl), fx)(g)
    (dx,) = vjp_f(dfx)
    return dx, dw


def _w_like(spec: _Spec, g):
    """A stand-in for the weight (only its type is read: a transpose's primal), varying over
    the mesh axes the cotangent varies over inside ``shard_map``."""
    return vary_like(jnp.zeros(spec.w.shape, spec.w.dtype), g)


def _fused_bwd(spec: _Spec, res, g):
    x, w = res
    if x is None or _zero(g):
        return None, None
    if w is None:  # x is not differentiated: the weight gradient alone
        fx = spec.f(tie(x, g))
        (dw,) = jax.linear_transpose(lambda b: spec.product(fx, b), _w_like(spec, g))(g)
        return None, dw
    # per platform, chosen when the program is lowered (as ``ties.tie`` is): XLA:CPU keeps
    # what is computed early, so the linearisation of f waits for the input gradient there
    dx, dw = lax.platform_dependent(x, w, g, cpu=functools.partial(_apart, spec),
                                    default=functools.partial(_together, spec))
    return dx, dw


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def activation_product(f: Callable, product: Callable, x, w, *, name: str = "smooth",
                       late: bool = False) -> jax.Array:
    """``product(f(x), w)``, keeping ``x`` (and ``w`` when ``x`` is differentiated) and
    recomputing ``f(x)`` and ``f'(x)`` together in the backward pass (see the module
    docstring).  ``f``: elementwise; ``product``: bilinear in its two arguments."""
    fx = jax.eval_shape(f, x)
    spec = _Spec(f, product, jax.ShapeDtypeStruct(fx.shape, fx.dtype),
                 jax.ShapeDtypeStruct(w.shape, w.dtype), bool(late))
    x = checkpoint_name(x, _PREFIX + str(name) + ".input")
    return _fused(spec, x, w)
