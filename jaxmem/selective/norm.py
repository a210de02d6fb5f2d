"""Differentiability-aware normalisation layers: batch, layer, group and RMS norm.

All four are one primitive, ``_normalize``: with statistics over ``axes``

    mu    = mean(x)                     (0 for RMS norm)
    var   = mean(x^2) - mu^2            (mean(x^2) for RMS norm; clipped at 0)
    rstd  = 1 / sqrt(var + eps)
    xhat  = (x - mu) * rstd
    y     = (x - mu) * (rstd * scale) + bias

(the forward arithmetic of ``flax.linen``'s normalisation layers). With ``gs = g * scale``
and ``<.>`` the mean over ``axes``, the exact vector-Jacobian products are

    dL/dx     = rstd * (gs - <gs> - xhat * <gs * xhat>)      (RMS: no ``<gs>`` term)
                + g_mu / N + g_var * 2 (x - mu) / N            (cotangents of mu, var)
    dL/dscale = sum(g * xhat)          dL/dbias = sum(g)       (over non-parameter axes)

``inv_mode`` picks the forward's spelling (the gradients are the same):
``'rsqrt'`` (above), ``'recip_sqrt'`` (``rstd = 1/sqrt(var + eps)``), and the dividing ones
``'divide'``: ``y = (x - mu) / sqrt(var + eps) * scale + bias``, ``'scale_divide'``:
``y = (x - mu) * scale / sqrt(var + eps) + bias`` and ``'scale_over_sd'``:
``y = (x - mu) * (scale / sqrt(var + eps)) + bias`` (a hand-written GPT block's), and
``'rsqrt_then_scale'`` /
``'recip_sqrt_then_scale'``: ``y = ((x - mu) * rstd) * scale + bias`` (Equinox's
``LayerNorm`` / ``RMSNorm``: ``rstd`` applied to the centred input first, then the scale),
each rounding as that expression does.

Residuals: ``x`` (tagged ``jaxmem.selective.norm.input``) plus the per-group ``mu`` and
``rstd`` (or, same size, ``sqrt(var + eps)`` or ``var``, so that the forward rounds as JAX's
program of that spelling does: see ``_inv_std_kept``) iff ``x`` or ``scale`` is
differentiated; ``xhat`` is recomputed from them in the
backward pass. That is one input-sized tensor (4 B/element in f32) where JAX's autodiff keeps
8-12 B/element, and nothing input-sized when only ``bias`` is trained. Storing ``x`` rather
than ``xhat`` lets XLA share the buffer with any other residual that is the same array.
The recomputation is tied to ``g`` (``jaxmem._prims.ties.tie``: exact, local to each shard)
so XLA cannot hoist it into the forward pass (measured: otherwise XLA keeps ``x`` and
``xhat``, 8 B/element).

Evaluation-mode batch norm (``_affine``) normalises with given running statistics and is
affine in ``x``: ``dL/dx = g * rstd * scale`` needs only per-channel numbers; ``x`` is
stored only when ``scale`` (or the running variance) is differentiated.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxmem._prims.grad_layout import active, input_after
from jaxmem._prims.recipes import depth, extend, kept, recipe
from jaxmem._prims.ties import laid_out_like as _laid_out_like
from jaxmem._prims.ties import tie, tie_on_cpu, vary_like
from jaxmem.selective._core import (
    as_int,
    check_eps,
    check_float,
    is_zero,
    perturbed,
    recomputed,
    remember,
    tag,
    value,
)

__all__ = ["batch_norm", "group_norm", "layer_norm", "normalize", "rms_norm"]


def _stat_dtype(x):
    return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _stats(x, axes, subtract_mean, fast_variance):
    xs = x.astype(_stat_dtype(x))
    if not subtract_mean:
        var = jnp.mean(xs * xs, axes, keepdims=True)
        return jnp.zeros_like(var), var
    mu = jnp.mean(xs, axes, keepdims=True)
    if fast_variance:
        var = jnp.maximum(0.0, jnp.mean(xs * xs, axes, keepdims=True) - mu * mu)
    else:
        var = jnp.mean(jnp.square(xs - mu), axes, keepdims=True)
    return mu, var


#: ``inv_mode`` values; the dividing ones divide by ``sqrt(var + eps)``; the ``_then_scale``
#: ones multiply ``x - mu`` by ``rstd`` (as their base mode computes it), then by ``scale``
_INV_MODES = ("rsqrt", "recip_sqrt", "divide", "scale_divide", "scale_over_sd",
              "rsqrt_then_scale", "recip_sqrt_then_scale")
_DIVIDING = ("divide", "scale_divide", "scale_over_sd")
#: dividing modes whose division involves the scale: ``sqrt(var + eps)`` is kept when the
#: scale alone is differentiated too
_SCALE_DIVIDING = ("scale_divide", "scale_over_sd")
_THEN_SCALE = "_then_scale"


def _base_mode(inv_mode):
    """How ``rstd`` is computed: ``'rsqrt_then_scale'`` as ``'rsqrt'``, etc."""
    return inv_mode.removesuffix(_THEN_SCALE)


def _inv_std(var, eps, inv_mode):
    """The forward's factor: ``1/sqrt(var+eps)`` as ``lax.rsqrt`` (flax) or ``1/sqrt``
    (torch-exact twins); ``sqrt(var+eps)`` for the dividing modes (see :func:`_affine_out`)."""
    inv_mode = _base_mode(inv_mode)
    if inv_mode == "rsqrt":
        return lax.rsqrt(var + eps)
    if inv_mode in _DIVIDING:
        return jnp.sqrt(var + eps)
    return jnp.reciprocal(jnp.sqrt(var + eps))


def _inv_std_kept(var, eps, inv_mode, differentiated):
    """``(r, kept, how)``: the forward's factor ``r`` (:func:`_inv_std`) and what the
    backward keeps to have ``rstd = 1/sqrt(var+eps)`` again (same size): ``how`` is
    ``'rstd'`` (``r`` itself), ``'sqrt'`` (``sqrt(var+eps)``) or ``'var'`` (``var``).

    XLA rewrites ``1/sqrt`` to ``rsqrt`` (and ``a / broadcast(b)`` to
    ``a * broadcast(1/b)``) where the ``sqrt`` has no other use; ``rsqrt`` differs from
    ``1/sqrt`` in the last bit (XLA:CPU). JAX's autodiff of the ``1/sqrt`` and dividing
    spellings keeps ``sqrt(var+eps)`` for its backward exactly when ``differentiated`` (for
    ``1/sqrt``: ``var`` has a tangent; dividing: the numerator or the denominator has one),
    so XLA keeps JAX's forward a division. Keeping ``sqrt(var+eps)`` then, and otherwise
    ``rstd`` or ``var`` (from which the backward takes the ``sqrt`` again), gives the
    ``sqrt`` as many uses as in JAX's program and the forward JAX's rounding, bit for bit.
    One ulp matters: a ReLU mask downstream flips where its input is that close to 0, and
    the gradient with it (a converted ResNet-50's gradients were 3e-2 off JAX's)."""
    inv_mode = _base_mode(inv_mode)
    if inv_mode in _DIVIDING:
        sd = jnp.sqrt(var + eps)
        return (sd, sd, "sqrt") if differentiated else (sd, var, "var")
    if inv_mode == "rsqrt" or not differentiated:
        return (rstd := _inv_std(var, eps, inv_mode)), rstd, "rstd"
    sd = jnp.sqrt(var + eps)
    return jnp.reciprocal(sd), sd, "sqrt"


def _rstd_from_kept(kept, how, eps, dep):
    """The backward's ``rstd = 1/sqrt(var+eps)`` from :func:`_inv_std_kept`'s ``kept``
    (tied to ``dep``: XLA must not merge it with the forward's ``sqrt``, which would leave
    that one use again)."""
    if kept is None or how == "rstd":
        return kept
    if dep is not None:
        kept = tie(kept, dep)
    if how == "var":
        return lax.rsqrt(kept + eps)
    return jnp.reciprocal(kept)


def _affine_out(x, mu, r, scale, bias, out_dtype, inv_mode="rsqrt"):
    """``y`` in the spelling's order of operations, ``r`` from :func:`_inv_std`:
    ``(x - mu) * (r * scale) + bias`` (``r = 1/sqrt(var+eps)``); ``'divide'``:
    ``(x - mu) / r * scale + bias``; ``'scale_divide'``: ``(x - mu) * scale / r + bias``;
    ``'scale_over_sd'``: ``(x - mu) * (scale / r) + bias`` (``r = sqrt(var+eps)``);
    ``'*_then_scale'``: ``((x - mu) * r) * scale + bias``."""
    if inv_mode == "divide":
        y = (x - mu) / r
        if scale is not None:
            y = y * scale
    elif inv_mode == "scale_divide":
        y = x - mu
        if scale is not None:
            y = y * scale
        y = y / r
    elif inv_mode == "scale_over_sd":
        y = (x - mu) * (scale / r)
    elif inv_mode.endswith(_THEN_SCALE):
        y = (x - mu) * r
        if scale is not None:
            y = y * scale
    else:
        y = (x - mu) * (r if scale is None else r * scale)
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype)


def _sum_to(a, shape):
    """Sum ``a`` over the axes where ``shape`` has size 1 (keepdims), giving ``shape``."""
    axes = tuple(i for i, (s, t) in enumerate(zip(a.shape, shape)) if t == 1 and s != 1)
    return jnp.sum(a, axes, keepdims=True).reshape(shape)


# ------------------------------------------------------------------ training statistics
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _normalize(axes, eps, subtract_mean, fast_variance, out_dtype, x, scale, bias):
    eps, inv_mode = eps
    mu, var = _stats(x, axes, subtract_mean, fast_variance)
    r = _inv_std(var, eps, inv_mode)
    return _affine_out(x, mu, r, scale, bias, out_dtype, inv_mode), mu, var


def _normalize_fwd(axes, eps, subtract_mean, fast_variance, out_dtype, x, scale, bias):
    eps, inv_mode = eps
    xv, sv, bv = value(x), value(scale), value(bias)
    mu, var = _stats(xv, axes, subtract_mean, fast_variance)
    need_x = perturbed(x) or perturbed(scale)
    # ``var`` (and ``x - mu``) is differentiated exactly when ``x`` is; the scale-dividing
    # spellings' division (``(x - mu) * scale / sd``, ``scale / sd``) when ``scale`` is too
    r, kept, how = _inv_std_kept(var, eps, inv_mode, perturbed(x) or (
        inv_mode in _SCALE_DIVIDING and perturbed(scale)))
    y = _affine_out(xv, mu, r, sv, bv, out_dtype, inv_mode)
    res = (
        # ``x`` arrives tagged ``norm.input`` (see ``normalize``); stored as is, it is the
        # same residual as the one a following bilinear layer keeps (``_core.recipe``).
        xv if need_x else None,
        mu if need_x else None,
        kept if need_x else None,
        sv if perturbed(x) else None,
        jax.ShapeDtypeStruct(xv.shape, xv.dtype),
        None if sv is None else jax.ShapeDtypeStruct(sv.shape, sv.dtype),
        None if bv is None else jax.ShapeDtypeStruct(bv.shape, bv.dtype),
        perturbed(x), perturbed(scale), perturbed(bias), how,
    )
    # ShapeDtypeStructs / bools are not valid residuals; move them to a static closure.
    statics = res[4:]
    return (y, mu, var), (res[:4], _Static(statics))


class _Static:
    """Hashable wrapper so static metadata can ride along in the residual pytree."""

    def __init__(self, v):
        self.v = v


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.v), lambda v, _: _Static(v))


def _normalize_bwd(axes, eps, subtract_mean, fast_variance, out_dtype, res, cts):
    (xv, mu, kept, sv), static = res
    x_s, s_s, b_s, px, ps, pb, how = static.v
    g, g_mu, g_var = cts
    n = math.prod(x_s.shape[a] for a in axes)
    dx = dscale = dbias = None
    g_zero = is_zero(g)
    gf = None if g_zero else g.astype(_stat_dtype(x_s.dtype))
    if pb and not g_zero:
        dbias = _sum_to(gf, b_s.shape).astype(b_s.dtype)
    if px or ps:
        dep = next((c for c in cts if not is_zero(c)), None)
        rstd = _rstd_from_kept(kept, how, eps[0], dep)
        xl = xv.astype(mu.dtype)
        if dep is not None:  # mu tied on CPU only (``tie_on_cpu``: XLA:GPU fuses it)
            xl, mu = tie(xl, dep), tie_on_cpu(mu, dep)
        xhat = (xl - mu) * rstd
        if ps and not g_zero:
            dscale = _sum_to(gf * xhat, s_s.shape).astype(s_s.dtype)
        if px:
            acc = jnp.zeros(x_s.shape, xhat.dtype)
            if not g_zero:
                gs = gf if sv is None else gf * sv
                inner = gs - xhat * jnp.mean(gs * xhat, axes, keepdims=True)
                if subtract_mean:
                    inner = inner - jnp.mean(gs, axes, keepdims=True)
                acc = acc + rstd * inner
            if not is_zero(g_mu) and subtract_mean:
                acc = acc + g_mu / n
            if not is_zero(g_var):
                acc = acc + g_var * (2.0 / n) * (xhat / rstd)
            dx = acc.astype(x_s.dtype)
    if active():  # a sharded train step: reduce dscale, dbias here and dx after them
        dx, (dscale, dbias) = input_after(dx, (dscale, dbias))
    return dx, dscale, dbias


_normalize.defvjp(_normalize_fwd, _normalize_bwd, symbolic_zeros=True)


# ------------------------------------- input recomputed from a pointwise convolution's recipe
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _normalize_rec(axes, eps, subtract_mean, fast_variance, out_dtype, rec_fn, kept_if,
                   x, scale, bias, rec):
    del rec_fn, kept_if, rec
    return _normalize(axes, eps, subtract_mean, fast_variance, out_dtype, x, scale, bias)


def _normalize_rec_fwd(axes, eps, subtract_mean, fast_variance, out_dtype, rec_fn, kept_if,
                       x, scale, bias, rec):
    """As ``_normalize_fwd``, but ``x == rec_fn(*rec)`` (a pointwise convolution of a
    normalisation's output: :func:`jaxmem._prims.recipes.extend`) and the producers keep
    ``rec`` anyway when one of ``rec[i]``, ``i in kept_if``, is differentiated: then ``rec``
    is kept -- the same residuals, stored once -- instead of ``x``."""
    out, ((xv, *small), static) = _normalize_fwd(axes, eps, subtract_mean, fast_variance,
                                                 out_dtype, x, scale, bias)
    shared = xv is not None and kept(rec, kept_if, perturbed)
    res_rec = tuple(value(p) for p in rec) if shared else None
    return out, ((None if shared else xv, *small), static, res_rec)


def _normalize_rec_bwd(axes, eps, subtract_mean, fast_variance, out_dtype, rec_fn, kept_if,
                       res, cts):
    (xv, *small), static, res_rec = res
    if res_rec is not None:
        dep = next((c for c in cts if not is_zero(c)), None)
        if dep is None:
            return None, None, None, None
        xv = recomputed(rec_fn, res_rec, kept_if, dep).astype(static.v[0].dtype)
    dx, dscale, dbias = _normalize_bwd(axes, eps, subtract_mean, fast_variance, out_dtype,
                                       ((xv, *small), static), cts)
    return dx, dscale, dbias, None


_normalize_rec.defvjp(_normalize_rec_fwd, _normalize_rec_bwd, symbolic_zeros=True)


# ------------------------------------------------------------ given (running) statistics
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _affine(eps, out_dtype, x, mean, var, scale, bias):
    r = _inv_std(var, *eps)
    return _affine_out(x, mean, r, scale, bias, out_dtype, eps[1])


def _affine_fwd(eps, out_dtype, x, mean, var, scale, bias):
    xv, mv, vv, sv, bv = map(value, (x, mean, var, scale, bias))
    # JAX's autodiff of a dividing spelling keeps ``sqrt(var + eps)`` when its numerator
    # (``x - mean``; the scale's division for the scale-dividing ones) has a tangent too
    # (_inv_std_kept)
    num = perturbed(x) or perturbed(mean) or (eps[1] in _SCALE_DIVIDING and perturbed(scale))
    r, kept, how = _inv_std_kept(vv, *eps, perturbed(var) or (eps[1] in _DIVIDING and num))
    y = _affine_out(xv, mv, r, sv, bv, out_dtype, eps[1])
    need_x = perturbed(scale) or perturbed(var)
    res = (
        # ``x`` arrives tagged ``norm.input`` (see ``batch_norm``); stored as is, it is the
        # same residual as the one the cross-replica moments (``_moments``) keep.
        xv if need_x else None,
        mv if need_x else None,
        kept if (need_x or perturbed(x) or perturbed(mean)) else None,
        sv if (perturbed(x) or perturbed(mean) or perturbed(var)) else None,
    )
    structs = tuple(None if v is None else jax.ShapeDtypeStruct(v.shape, v.dtype)
                    for v in (xv, mv, vv, sv, bv))
    flags = tuple(perturbed(p) for p in (x, mean, var, scale, bias))
    return y, (res, _Static((structs, flags, how)))


def _affine_bwd(eps, out_dtype, res, g):
    (xv, mv, kept, sv), static = res
    structs, (px, pm, pv, ps, pb), how = static.v
    x_s, m_s, v_s, s_s, b_s = structs
    if is_zero(g):
        return None, None, None, None, None
    gf = g.astype(_stat_dtype(x_s.dtype))
    # the per-channel residuals tied to ``g``: untied, XLA shares their input-sized
    # broadcasts (``rstd * scale``) with the forward pass and keeps those until here
    # (measured: 3 input-sized f32 arrays per batch norm under ``vmap(axis_name=...)``)
    mv, kept, sv = tie((mv, kept, sv), g)
    rstd = _rstd_from_kept(kept, how, eps[0], None)
    dx = dm = dv = ds = db = None
    mul = None
    if px or pm or pv:
        mul = rstd if sv is None else rstd * sv
    if px:
        dx = (gf * mul).astype(x_s.dtype)
    if pm:
        dm = _sum_to(-gf * mul, m_s.shape).astype(m_s.dtype)
    if pb:
        db = _sum_to(gf, b_s.shape).astype(b_s.dtype)
    if ps or pv:
        # in the wider of x's and the statistics' dtypes (float64 x with float32 running
        # statistics: float64, as the forward's ``x - mean``)
        xhat = (tie(xv.astype(jnp.promote_types(xv.dtype, rstd.dtype)), g) - mv) * rstd
    if ps:
        ds = _sum_to(gf * xhat, s_s.shape).astype(s_s.dtype)
    if pv:
        dv = _sum_to(gf * xhat * (-0.5) * mul * rstd, v_s.shape).astype(v_s.dtype)
    return dx, dm, dv, ds, db


_affine.defvjp(_affine_fwd, _affine_bwd, symbolic_zeros=True)


# ------------------------------------------------- local moments for cross-replica stats
def _struct(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moments(red, x):
    """``(mean(x), mean(x^2))`` over ``red`` (kept dims, statistics dtype).

    VJP: ``dx = (g1 + 2 x g2) / n``; the only residual is ``x`` itself (stored as it
    arrives: the same array the normalisation keeps)."""
    return _moments_of(red, x)


def _moments_of(red, x):
    xs = x.astype(_stat_dtype(x))
    return jnp.mean(xs, red, keepdims=True), jnp.mean(xs * xs, red, keepdims=True)


def _moments_fwd(red, x):
    xv = value(x)
    out = _moments_of(red, xv)
    return out, (xv if perturbed(x) else None, _Static(_struct(xv)))


def _moments_bwd(red, res, cts):
    xv, static = res
    x_s = static.v
    g1, g2 = cts
    if xv is None:
        return (None,)
    n = math.prod(x_s.shape[a] for a in red)
    sdt = _stat_dtype(x_s.dtype)
    acc = jnp.zeros(x_s.shape, sdt)
    if not is_zero(g1):
        acc = acc + g1 / n
    if not is_zero(g2):
        acc = acc + (2.0 / n) * g2 * xv.astype(sdt)
    return (acc.astype(x_s.dtype),)


_moments.defvjp(_moments_fwd, _moments_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _centered_sq(red, x, mu):
    """``mean((x - mu)^2)`` over ``red`` (kept dims, statistics dtype).

    VJP: ``dx = 2 (x - mu) g / n``, ``dmu = -sum(dx)``; residuals ``x`` (as it arrives) and
    the per-channel ``mu``."""
    return _centered_sq_of(red, x, mu)


def _centered_sq_of(red, x, mu):
    return jnp.mean(jnp.square(x.astype(_stat_dtype(x)) - mu), red, keepdims=True)


def _centered_sq_fwd(red, x, mu):
    xv, mv = value(x), value(mu)
    keep = perturbed(x) or perturbed(mu)
    res = (xv if keep else None, mv if keep else None)
    static = _Static((_struct(xv), _struct(mv), perturbed(x), perturbed(mu)))
    return _centered_sq_of(red, xv, mv), (res, static)


def _centered_sq_bwd(red, res, g):
    (xv, mv), static = res
    x_s, m_s, px, pm = static.v
    if xv is None or is_zero(g):
        return None, None
    n = math.prod(x_s.shape[a] for a in red)
    d = (tie(xv, g).astype(mv.dtype) - mv) * ((2.0 / n) * g)
    dx = d.astype(x_s.dtype) if px else None
    dmu = -jnp.sum(d, red, keepdims=True).astype(m_s.dtype) if pm else None
    return dx, dmu


_centered_sq.defvjp(_centered_sq_fwd, _centered_sq_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------- public API
def _canon_axes(ndim, axes, what):
    if isinstance(axes, int):
        axes = (axes,)
    out = []
    for a in axes:
        if not isinstance(a, int) or not -ndim <= a < ndim:
            raise ValueError(f"{what} must be ints in [-{ndim}, {ndim}), got {axes!r}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} has repeated axes: {axes!r}")
    return tuple(sorted(out))


def _param(p, shape, name, what):
    if p is None:
        return None
    check_float(f"{what}: {name}", p)
    p = jnp.asarray(p)
    if math.prod(p.shape) != math.prod(shape):
        raise ValueError(f"{what}: {name} must have {math.prod(shape)} elements to broadcast "
                         f"as {shape}, got shape {p.shape}")
    return p.reshape(shape)


def _out_dtype(x, scale, bias, dtype):
    if dtype is not None:
        return jnp.dtype(dtype)
    args = [a for a in (x, scale, bias) if a is not None]
    # flax: result dtype of the input and the (f32-promoted) parameters
    return jnp.result_type(*args)


def normalize(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None, *,
              axes: Sequence[int], feature_axes: Sequence[int], eps: float = 1e-6,
              subtract_mean: bool = True, fast_variance: bool = True, dtype: Any = None,
              inv_mode: str = "rsqrt", axis_name: Any = None,
              axis_index_groups: Any = None) -> jax.Array:
    """Normalise ``x`` over ``axes`` and apply ``scale``/``bias`` along ``feature_axes``.

    ``axis_name`` (with optional ``axis_index_groups``): statistics pooled over the replicas
    of a named axis (``pmap`` / ``shard_map`` / ``vmap(axis_name=...)``), Flax's formula for
    every norm with an ``axis_name``: ``mu = pmean(mean(x))``, ``var = max(0,
    pmean(mean(x^2)) - mu^2)`` (``fast_variance=False``: ``pmean(mean((x - mu)^2))``; without
    the mean: ``var = pmean(mean(x^2))``); the residuals are those of :func:`batch_norm`'s
    cross-replica path (``x`` and the statistics).

    ``inv_mode``: the forward's spelling, rounding as it does: ``'rsqrt'`` (flax:
    ``(x - mu) * (rsqrt(var + eps) * scale) + bias``), ``'recip_sqrt'`` (``1/sqrt``,
    torch-exact twins), ``'divide'`` (``(x - mu) / sqrt(var + eps) * scale + bias``),
    ``'scale_divide'`` (``(x - mu) * scale / sqrt(var + eps) + bias``), ``'scale_over_sd'``
    (``(x - mu) * (scale / sqrt(var + eps)) + bias``; needs ``scale``) or
    ``'rsqrt_then_scale'`` / ``'recip_sqrt_then_scale'`` (``((x - mu) * rstd) * scale +
    bias``, Equinox's order; ``rstd`` as in ``'rsqrt'`` / ``'recip_sqrt'``).
    Returns ``(y, mean, var)``; ``mean``/``var`` keep the reduced axes (size 1) and are
    differentiable outputs too. See the module docstring for the math and residuals.
    """
    check_float("normalize: x", x)
    x = jnp.asarray(x)
    axes = _canon_axes(x.ndim, axes, "axes")
    feature_axes = _canon_axes(x.ndim, feature_axes, "feature_axes")
    pshape = tuple(x.shape[i] if i in feature_axes else 1 for i in range(x.ndim))
    scale = _param(scale, pshape, "scale", "normalize")
    bias = _param(bias, pshape, "bias", "normalize")
    eps = check_eps("normalize", eps)
    _check_inv_mode(inv_mode)
    if inv_mode == "scale_over_sd" and scale is None:
        raise ValueError("normalize: inv_mode='scale_over_sd' divides the scale by "
                         "sqrt(var + eps); it needs a scale")
    out_dtype = _out_dtype(x, scale, bias, dtype)
    x_in = x
    r = recipe(x) if axis_name is None and depth(x) == 1 else None
    x = tag(x, "norm.input")
    if axis_name is not None:
        return _pooled(x, scale, bias, axes, (eps, inv_mode), bool(subtract_mean),
                       bool(fast_variance), out_dtype, axis_name,
                       _freeze_groups(axis_index_groups))
    # one copy of scale and bias in ``x``'s layout, shared by every use (see _laid_out_like);
    # under shard_map, replicated parameters vary like ``x`` inside the primitive (the
    # cotangent types must match; the cast's transpose sums over devices)
    scale, bias = _laid_out_like(scale, x), _laid_out_like(bias, x)
    scale, bias = vary_like(scale, x), vary_like(bias, x)
    statics = (axes, (eps, inv_mode), bool(subtract_mean), bool(fast_variance), out_dtype)
    out_fn = functools.partial(_recompute_out, (eps, inv_mode), out_dtype)
    if r is not None and len(r[2]) == 1:
        # ``x`` is a pointwise convolution of another norm's output: keep that norm's
        # residuals (and the kernel) instead of ``x``; ``y`` is recomputable from them too
        rec_fn, rec, kept_if = r
        y, mu, var = _normalize_rec(*statics, rec_fn, kept_if, x, scale, bias, rec)
        extend(y, out_fn, x_in, (mu, var, scale, bias), elementwise=True)
        return y, mu, var
    y, mu, var = _normalize(*statics, x, scale, bias)
    # ``y`` is recomputable from what this norm's backward keeps anyway: a bilinear layer
    # applied to ``y`` keeps those instead of ``y`` (one input-sized residual, not two).
    remember(y, out_fn, (x, mu, var, scale, bias))
    return y, mu, var


def _recompute_out(eps, out_dtype, x, mu, var, scale, bias):
    """The forward output of ``_normalize`` / ``_affine`` from its input and statistics, bit
    for bit: ``(x - mu) * (rsqrt(var + eps) * scale) + bias`` or the other ``inv_mode``'s
    spelling (:func:`_affine_out`).

    ``1/sqrt`` and the dividing modes: as the forward computes them when ``x`` is
    differentiated (a division by the kept ``sqrt``, see :func:`_inv_std_kept`); the
    ``sqrt`` is tied (to ``mu``, exact) so that XLA does not rewrite it to ``rsqrt`` here,
    where it has one use. (With only ``scale`` differentiated the forward's factor may
    differ from this in the last bit: f32 rounding of ``dW``.)"""
    e, inv_mode = eps
    base = _base_mode(inv_mode)
    if base == "rsqrt":
        r = _inv_std(var, e, base)
    else:
        r = tie(jnp.sqrt(var + e), mu)
        if base not in _DIVIDING:
            r = jnp.reciprocal(r)
    return _affine_out(x, mu, r, scale, bias, out_dtype, inv_mode)


def _check_inv_mode(inv_mode):
    if inv_mode not in _INV_MODES:
        raise ValueError(f"inv_mode must be one of {', '.join(map(repr, _INV_MODES))}, "
                         f"got {inv_mode!r}")


def layer_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None,
               *, axis: int | Sequence[int] = -1, eps: float = 1e-6, dtype: Any = None,
               fast_variance: bool = True) -> jax.Array:
    """Layer norm over ``axis`` (default the last); ``scale``/``bias`` have that axis' shape.

    ``y = (x - mean) / sqrt(var + eps) * scale + bias``, statistics over ``axis``."""
    check_float("layer_norm: x", x)
    check_eps("layer_norm", eps)
    x = jnp.asarray(x)
    axes = _canon_axes(x.ndim, axis, "layer_norm: axis")
    return normalize(x, scale, bias, axes=axes, feature_axes=axes, eps=eps, dtype=dtype,
                     fast_variance=fast_variance)[0]


def rms_norm(x: ArrayLike, scale: ArrayLike | None = None, *, axis: int | Sequence[int] = -1,
             eps: float = 1e-6, dtype: Any = None) -> jax.Array:
    """RMS norm ``x / sqrt(mean(x^2) + eps) * scale`` over ``axis``."""
    check_float("rms_norm: x", x)
    check_eps("rms_norm", eps)
    x = jnp.asarray(x)
    axes = _canon_axes(x.ndim, axis, "rms_norm: axis")
    return normalize(x, scale, None, axes=axes, feature_axes=axes, eps=eps,
                     subtract_mean=False, dtype=dtype)[0]


def group_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None,
               *, num_groups: int, eps: float = 1e-6, dtype: Any = None,
               fast_variance: bool = True, inv_mode: str = "rsqrt", axis_name: Any = None,
               axis_index_groups: Any = None) -> jax.Array:
    """Group norm of channel-last ``x`` ``(N, *spatial, C)``: statistics per sample over the
    spatial axes and ``C // num_groups`` channels of each group; ``scale``/``bias`` ``(C,)``.
    ``inv_mode``: the forward's spelling, as for :func:`normalize`; ``axis_name`` /
    ``axis_index_groups``: statistics pooled over a named axis, as for :func:`normalize`.
    """
    check_float("group_norm: x", x)
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"group_norm: x must be (N, ..., C), got shape {x.shape}")
    check_eps("group_norm", eps)
    c = x.shape[-1]
    groups = as_int(num_groups)
    if groups is None or groups < 1 or c % groups:
        raise ValueError(f"group_norm: num_groups must be a positive divisor of the channel "
                         f"count {c}, got {num_groups!r}")
    xg = x.reshape(x.shape[:-1] + (groups, c // groups))
    axes = tuple(range(1, xg.ndim - 2)) + (xg.ndim - 1,)
    out_dtype = _out_dtype(x, scale, bias, dtype)
    y = normalize(xg, None if scale is None else jnp.asarray(scale).reshape(-1),
                  None if bias is None else jnp.asarray(bias).reshape(-1),
                  axes=axes, feature_axes=(xg.ndim - 2, xg.ndim - 1), eps=eps,
                  dtype=out_dtype, fast_variance=fast_variance, inv_mode=inv_mode,
                  axis_name=axis_name, axis_index_groups=axis_index_groups)[0]
    return y.reshape(x.shape)


def _pooled(x, scale, bias, red, eps, subtract_mean, fast_variance, out_dtype, axis_name,
            groups):
    """``(y, mu, var)`` with statistics pooled over ``axis_name``: the local moments (a
    primitive keeping ``x``), their ``pmean`` by plain autodiff (JAX transposes the
    collectives), then the affine primitive with the pooled statistics (``x`` again -- the
    same tagged array -- and the statistics as residuals); kept dims."""
    mu, var = _pmean_stats(x, red, fast_variance, axis_name, groups, subtract_mean)
    mu_, var_, s_, b_ = (vary_like(a, x) for a in (mu, var, scale, bias))
    y = _affine(eps, out_dtype, x, mu_, var_, s_, b_)
    # a bilinear layer fed ``y`` recomputes it from what this norm keeps (see normalize)
    remember(y, functools.partial(_recompute_out, eps, out_dtype), (x, mu_, var_, s_, b_))
    return y, mu, var


def _pmean_stats(x, red, fast_variance, axis_name, groups, subtract_mean=True):
    """Flax's cross-replica statistics: ``pmean`` of the per-device ``mean(x)`` and
    ``mean(x^2)`` (fast variance: ``var = max(0, E[x^2] - E[x]^2)``) or of ``mean(x)`` then
    ``mean((x - mu)^2)``; without the mean (RMS) ``var = pmean(mean(x^2))``, ``mu = 0``;
    kept dims."""
    m1, m2 = _moments(red, x)
    if not subtract_mean:
        var = lax.pmean(m2, axis_name, axis_index_groups=groups)
        return jnp.zeros_like(var), var
    if fast_variance:
        mus = lax.pmean(jnp.stack([m1, m2]), axis_name, axis_index_groups=groups)
        return mus[0], jnp.maximum(0.0, mus[1] - mus[0] * mus[0])
    mu = lax.pmean(m1, axis_name, axis_index_groups=groups)
    # ``mu`` varies like ``x`` inside the primitive (its cotangent is per device; the
    # transpose of the cast sums it over the axis)
    var = lax.pmean(_centered_sq(red, x, vary_like(mu, x)), axis_name,
                    axis_index_groups=groups)
    return mu, var


def _freeze_groups(groups):
    if groups is None:
        return None
    try:
        return tuple(tuple(int(i) for i in grp) for grp in groups)
    except TypeError:
        raise TypeError("axis_index_groups must be None or a sequence of "
                        f"sequences of ints, got {groups!r}") from None


def batch_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None,
               running_mean: ArrayLike | None = None, running_var: ArrayLike | None = None,
               *, train: bool, momentum: float = 0.99, eps: float = 1e-5, axis: int = -1,
               dtype: Any = None, fast_variance: bool = True, inv_mode: str = "rsqrt",
               unbiased_running_var: bool = False, axis_name: Any = None,
               axis_index_groups: Any = None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Batch norm over all axes but ``axis`` (the channel axis).

    ``axis_name`` (with optional ``axis_index_groups``): cross-replica statistics under
    ``pmap`` / ``shard_map`` / ``vmap(axis_name=...)``, Flax's formula: ``mu = pmean(mean(x))``,
    ``var = max(0, pmean(mean(x^2)) - mu^2)`` (``fast_variance=False``:
    ``var = pmean(mean((x - mu)^2))``); every device's batch must have the same size. The
    local moments (``mean(x)``, ``mean(x^2)``: VJP ``(g1 + 2 x g2) / n``) and the
    normalisation with the pooled statistics (affine in ``x``) are primitives that keep the
    same tagged ``x`` plus per-channel numbers; the collectives between them are
    differentiated by JAX (it transposes ``pmean``). Residuals: 4 B/element in f32, as for
    single-device statistics (Flax keeps 8).

    ``train=True``: normalise with the batch statistics; returns
    ``(y, new_running_mean, new_running_var)`` with
    ``new = momentum * running + (1 - momentum) * batch_stat`` (Flax convention; pass
    ``running_*=None`` to skip the update, then the batch statistics are returned).
    ``train=False``: normalise with ``running_mean``/``running_var`` and return them
    unchanged: ``(y, running_mean, running_var)``. ``unbiased_running_var=True`` updates the
    running variance with ``var * n / (n - 1)`` (torch's rule).
    """
    check_float("batch_norm: x", x)
    x = jnp.asarray(x)
    if not isinstance(train, bool):
        raise TypeError(f"batch_norm: train must be a Python bool, got {train!r}")
    (ax,) = _canon_axes(x.ndim, axis, "axis")
    c = x.shape[ax]
    red = tuple(i for i in range(x.ndim) if i != ax)
    pshape = tuple(c if i == ax else 1 for i in range(x.ndim))
    if train and axis_name is not None:
        groups = _freeze_groups(axis_index_groups)
        y, mu, var = normalize(x, scale, bias, axes=red, feature_axes=(ax,), eps=eps,
                               dtype=dtype, fast_variance=fast_variance, inv_mode=inv_mode,
                               axis_name=axis_name, axis_index_groups=groups)
        mu, var = mu.reshape(c), var.reshape(c)
        if running_mean is None or running_var is None:
            return y, mu, var
        n = (x.size // c) * (len(groups[0]) if groups else lax.psum(1, axis_name))
    elif train:
        y, mu, var = normalize(x, scale, bias, axes=red, feature_axes=(ax,), eps=eps,
                               dtype=dtype, fast_variance=fast_variance, inv_mode=inv_mode)
        mu, var = mu.reshape(c), var.reshape(c)
        if running_mean is None or running_var is None:
            return y, mu, var
        n = x.size // c
    if train:
        if unbiased_running_var:
            if isinstance(n, int) and n <= 1:
                raise ValueError("batch_norm: unbiased_running_var needs more than one value "
                                 f"per channel, input shape {x.shape}")
            var = var * (n / (n - 1))
        new_m = (momentum * running_mean + (1 - momentum) * mu).astype(
            jnp.result_type(running_mean))
        new_v = (momentum * running_var + (1 - momentum) * var).astype(
            jnp.result_type(running_var))
        return y, new_m, new_v
    if running_mean is None or running_var is None:
        raise ValueError("batch_norm: train=False needs running_mean and running_var")
    mshape = _param(running_mean, pshape, "running_mean", "batch_norm")
    vshape = _param(running_var, pshape, "running_var", "batch_norm")
    s = _param(scale, pshape, "scale", "batch_norm")
    b = _param(bias, pshape, "bias", "batch_norm")
    out_dtype = _out_dtype(x, s, b, dtype) if dtype is not None else jnp.result_type(
        *[a for a in (x, mshape, s, b) if a is not None])
    _check_inv_mode(inv_mode)
    # under shard_map the replicated statistics / parameters vary like ``x`` inside the
    # primitive (the cotangent types must match; the cast's transpose sums over devices)
    mshape, vshape, s, b = (vary_like(a, x) for a in (mshape, vshape, s, b))
    y = _affine((float(eps), inv_mode), out_dtype, tag(x, "norm.input"), mshape, vshape, s, b)
    return y, running_mean, running_var
