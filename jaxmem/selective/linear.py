"""Differentiability-aware linear layers: dense, convolution, transposed convolution.

A layer ``z = f(x, W)`` that is bilinear in its input ``x`` and weight ``W`` has

    dL/dx = f(., W)^T g        (needs W only)
    dL/dW = f(x, .)^T g        (needs x only)

so the input ``x`` only has to be kept for the backward pass when ``W`` is differentiated,
and ``W`` only when ``x`` is. The primitives here are ``jax.custom_vjp`` functions with
``symbolic_zeros=True``: the forward rule sees which of ``x``/``W`` are perturbed (part of
the differentiation) and stores exactly the tensors the requested gradients need. Both
transposes are computed with ``jax.linear_transpose`` of the very same lax call, so the
gradients are those of JAX's own autodiff (bit-identical), with one exception: the input
gradient of a strided channel-last convolution is computed per output phase
(``_phase_input_grad``: the same products, no zero-interleaved cotangent, summed in another
order -- equal up to f32 rounding) because XLA (CPU) otherwise runs it with a runtime scratch
buffer ~10x the size of the result. A bias is added outside the custom rule: its gradient
``sum(g)`` needs nothing stored.

Convolution weights are tied to the layer's input (forward) and cotangent (backward) with
``jaxmem._prims.ties.tie`` (exact, no communication under sharding) so that XLA makes its
flipped / re-laid-out kernel copies next to their use instead of all at the start of the
step (measured on CPU: ResNet-18 Input case 6.19 -> 2.57 MiB compiled). Dense layers are not
tied: there the tie would add a weight-sized copy that XLA does not otherwise make.

``dot_general`` and ``conv_general_dilated`` have the exact signatures of their ``lax``
namesakes, so they can be handed to ``flax.linen.Dense(dot_general=...)`` /
``flax.linen.Conv(conv_general_dilated=...)``.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxmem._prims.grad_layout import (
    bilinear_gradients,
    gathered,
    regathered_product,
    regathering_recomputes,
    stored,
    unplaced,
    used,
    weights_local,
    weights_whole,
)
from jaxmem._prims.recipes import PROJECTED, depth, extend, project, weight_recipe
from jaxmem._prims.ties import tie, typed_struct, vary_like, varying_axes
from jaxmem.selective._core import (
    as_int,
    check_float,
    int_tuple,
    is_zero,
    kept,
    perturbed,
    positive_int,
    recipe,
    recomputed,
    tag,
    value,
)

__all__ = [
    "bilinear",
    "conv",
    "conv_general_dilated",
    "conv_transpose",
    "dense",
    "dot_general",
]


# ----------------------------------------------------------------------------- core
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _bilinear(fn, name, x_struct, w_struct, dx_fn, w_fn, x, w, w_args):
    del name, x_struct, w_struct, dx_fn, w_fn, w_args
    return fn(x, w)


#: Layer kinds whose weight is made data-dependent on the layer input in the forward pass
#: and on the cotangent in the backward pass (see ``_late``).
#: Layer kinds that are convolutions: their backward's two gradients are not joined
#: (``bilinear_gradients``).
_CONVOLUTIONS = {"conv", "conv_transpose"}
_LATE_FWD = {"conv"}
_LATE_BWD = _CONVOLUTIONS


def _late(w, dep, on: bool):
    """``w``, made available only once ``dep`` is (``ties.tie``; exact, no communication).

    XLA (CPU) builds the re-laid-out / flipped weight copies that a convolution uses as soon
    as the weight is available, i.e. at the start of the step, and keeps all of them alive
    through the forward pass. Tying the weight to the activation that the layer consumes
    moves each copy next to its use, where it lives only while that layer runs."""
    return tie(w, dep) if on else w


def _bilinear_fwd(fn, name, x_struct, w_struct, dx_fn, w_fn, x, w, w_args):
    del x_struct, w_struct, dx_fn
    y = fn(x.value, used(w.value, x.value, name in _LATE_FWD))
    # keep x only if dL/dW is requested, W only if dL/dx is requested.
    res_x = tag(x.value, name + ".input") if w.perturbed else None
    y, res_w = _kept_weight(w, y, x.perturbed, w_fn, w_args)
    return y, (res_x, res_w)


def _kept_weight(w, y, x_perturbed: bool, w_fn, w_args):
    """``(y, what the input gradient needs of w)``: nothing when ``x`` is not differentiated;
    ``(None, args)`` when ``w == w_fn(*args)`` is computed from the step's inputs
    (:func:`jaxmem._prims.recipes.weight_recipe`: keeping them costs nothing); else
    ``(w, None)`` (laid out as the step in context stores weights, :func:`stored`)."""
    if not x_perturbed:
        return y, None
    if w_fn is not None:
        return y, (None, tuple(value(a) for a in w_args))
    y, kept_w = stored(w.value, y)
    return y, (kept_w, None)


def _weight_back(res_w, w_fn, g):
    """The weight for the input gradient: recomputed from its recipe's arguments tied to
    ``g`` (so XLA cannot merge it with the forward's and keep that), or the kept one."""
    w, args = res_w
    if args is not None:
        return w_fn(*tie(args, g))
    return gathered(w, g)  # a sharded step's stored shard, gathered back here


def _bilinear_bwd(fn, name, x_struct, w_struct, dx_fn, w_fn, res, g):
    dx, dw = _bilinear_grads(fn, name, x_struct, w_struct, dx_fn, w_fn, res, g)
    return dx, dw, None


def _bilinear_grads(fn, name, x_struct, w_struct, dx_fn, w_fn, res, g):
    res_x, res_w = res
    if is_zero(g):
        return None, None
    dx = dw = None
    if res_w is not None:
        res_w = _weight_back(res_w, w_fn, g)
        # tied to ``g``: the flipped / transposed copy of the weight that the input-gradient
        # convolution uses can then only be made in the backward pass. Without
        # it XLA (CPU) builds every layer's copy at the start of the step and keeps them all
        # alive through the forward pass (measured: ResNet-18 Input case 6.19 -> 4.11 MiB).
        w_late = _late(res_w, g, name in _LATE_BWD)
        if dx_fn is not None:
            dx = dx_fn(g, w_late).astype(x_struct.dtype)
        else:
            (dx,) = jax.linear_transpose(lambda x_: fn(x_, w_late), x_struct)(g)
    if res_x is not None:
        (dw,) = jax.linear_transpose(lambda w_: fn(res_x, w_), w_struct)(g)
    if dx is not None and dw is not None:
        # XLA:GPU orders the two. Sharded steps (a gradient layout in context) and shard_map:
        # ``dx`` flows on only once ``dW`` exists; left free, XLA:GPU puts every layer's
        # weight gradient at the end of a multi-device backward (next to its all-reduce) and
        # keeps each layer's cotangent alive until then (measured: Dense -> cross-replica
        # BatchNorm under shard_map on 2 / 8 H100s of the plan, 8.3 B/element per layer
        # untied, 4.3 with it). One device: both from one barrier, so a donated weight's
        # in-place update follows the product that reads it and XLA does not copy the weight
        # (HF GPT-2's adamw step on the H100 plan: 4 weight copies, 53.0 -> 52.0 MiB temp).
        # Nothing on XLA:CPU.
        dx, dw = bilinear_gradients(dx, dw, name not in _CONVOLUTIONS)
    return dx, dw


_bilinear.defvjp(_bilinear_fwd, _bilinear_bwd, symbolic_zeros=True)


# ------------------------------------- input recomputed from its producer's (norm's) residuals
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 7, 8))
def _bilinear_rec(fn, name, x_struct, w_struct, dx_fn, rec_fn, kept_if, rec_elementwise, w_fn,
                  x, w, rec, w_args):
    del name, x_struct, w_struct, dx_fn, rec_fn, kept_if, rec_elementwise, w_fn, rec, w_args
    return fn(x, w)


def _bilinear_rec_fwd(fn, name, x_struct, w_struct, dx_fn, rec_fn, kept_if, rec_elementwise,
                      w_fn, x, w, rec, w_args):
    """As ``_bilinear_fwd``, but ``x == rec_fn(*rec)`` and the producer of ``x`` (a
    normalisation, an exact smooth activation) keeps ``rec`` for its own backward: when it
    does (one of ``rec[i]``, ``i in kept_if``, is differentiated), keep ``rec`` -- the very
    same residuals, stored once -- instead of ``x``. ``rec_elementwise``: ``rec_fn`` runs
    elementwise ops only (a recipe of depth 0), see :func:`jaxmem.selective._core.recomputed`."""
    del x_struct, w_struct, dx_fn, rec_fn, rec_elementwise
    y = fn(x.value, used(w.value, x.value, name in _LATE_FWD))
    shared = w.perturbed and kept(rec, kept_if, perturbed)
    res_x = tag(x.value, name + ".input") if w.perturbed and not shared else None
    res_rec = tuple(value(p) for p in rec) if shared else None
    y, res_w = _kept_weight(w, y, x.perturbed, w_fn, w_args)
    return y, (res_x, res_rec, res_w)


def _bilinear_rec_bwd(fn, name, x_struct, w_struct, dx_fn, rec_fn, kept_if, rec_elementwise,
                      w_fn, res, g):
    res_x, res_rec, res_w = res
    if is_zero(g):
        return None, None, None, None
    if res_rec is not None:
        res_x = recomputed(rec_fn, res_rec, kept_if, g, elementwise=rec_elementwise)
    dx, dw = _bilinear_grads(fn, name, x_struct, w_struct, dx_fn, w_fn, (res_x, res_w), g)
    return dx, dw, None, None


_bilinear_rec.defvjp(_bilinear_rec_fwd, _bilinear_rec_bwd, symbolic_zeros=True)


def bilinear(fn: Callable[[Any, Any], Any], x: ArrayLike, w: ArrayLike, *,
             name: str = "bilinear", _dx_fn: Callable | None = None,
             _pointwise: bool = False, _project: bool = False) -> jax.Array:
    """Apply ``fn(x, w)``, bilinear in ``(x, w)``, storing only what requested grads need.

    ``fn`` must be linear in each argument separately (dense, convolution, einsum, ...).
    Residuals: ``x`` (tagged ``jaxmem.selective.<name>.input``) iff ``w`` is
    differentiated; ``w`` iff ``x`` is differentiated; nothing if neither. When ``x`` is the
    output of a selective normalisation (``jaxmem.selective.normalize`` and the norms built on
    it) or of an exact smooth activation (``jaxmem.selective.smooth_activation``) whose
    backward keeps its input, or a 1-bit mask activation (``relu`` & co.) of such an output,
    or an elementwise op of several such values recorded with
    ``jaxmem._prims.recipes.combine`` (a ResNet block output), and every producer keeps its
    residuals, ``x`` is recomputed from those residuals in the backward pass
    instead of being kept a second time (``dL/dW`` is unchanged: the same
    ``x``, bit for bit). Under ``lax.scan`` this keeps one input-sized tensor per norm and
    layer stacked instead of two.

    ``_pointwise`` (a 1x1, stride-1 convolution: as many multiply-adds per output element as
    input channels): when ``x`` is such a normalisation output (or an elementwise function
    of one), the output is recorded as recomputable from that norm's residuals and ``w``
    (:func:`jaxmem._prims.recipes.extend`), so a normalisation applied to it keeps those
    instead of its own input (a ResNet bottleneck's 4x-wide expansion ``c3``) and recomputes
    the convolution in its backward pass.

    ``_project`` (a dense product, ``jaxmem.transform(..., projections=True)``): when ``x``
    is such a normalisation or activation output, the output is recorded as recomputable
    from its producer's residuals and ``w`` (:func:`jaxmem._prims.recipes.project`), for the
    attention core only (queries, keys and values recomputed in its backward pass); only
    where each device can recompute its part without a collective
    (``grad_layout.weights_local``: no SPMD mesh, a data parallel step, or a tensor
    parallel step splitting output features). A bilinear layer fed
    a value recorded so ignores the recipe and keeps its input.

    A weight recorded with :func:`jaxmem._prims.recipes.remember_weight` (computed from the
    step's inputs: a merged LoRA weight, a cast; ``jaxmem.transform(...,
    computed_weights=True)``) is not kept for the input gradient: its recipe's arguments
    are, and the weight is recomputed from them in the backward pass (where every device
    holds the whole weight, outside ``shard_map``).
    """
    x_in = x
    w_fn, w_args = _weight_recipe(w, x)
    w = unplaced(w)   # a sharded step's parameter shard, gathered in the forward rule
    r = recipe(x) if depth(x) < PROJECTED else None
    # under ``shard_map``: give ``x`` and ``w`` the same varying axes (a replicated weight
    # with a per-device batch), so the rule's cotangents have its arguments' types; the
    # cast's transpose sums ``dW`` over those axes, as autodiff of ``fn`` itself does.
    x, w = vary_like(x, w), vary_like(w, x)
    xs, ws = typed_struct(x), typed_struct(w)
    if r is not None:
        rec_fn, rec, kept_if = r
        # a dense product's input recomputed by elementwise ops alone: tied without a copy of
        # a factor that XLA:GPU slices out of a merged GEMM (a convolution's recomputed input
        # is a buffer of its own either way: measured, ResNet-50 keeps as much or more so)
        elementwise = depth(x_in) == 0 and name not in _CONVOLUTIONS
        y = _bilinear_rec(fn, name, xs, ws, _dx_fn, rec_fn, kept_if, elementwise, w_fn, x, w,
                          rec, w_args)
        if _pointwise:
            extend(y, fn, x_in, (w,))
        elif _project and weights_local():
            # not where recomputing the product needs a collective (FSDP's stored shard, a
            # layout this step did not set); a tensor parallel step splits the weight's
            # output features, each device recomputes its own slice (a later split of that
            # slice is not recorded there: ``jaxmem.transform``'s relayouts)
            project(y, fn, x_in, (w,))
        elif _project and regathering_recomputes():
            # a fully sharded step that allows repeated collectives: the recomputation
            # gathers the kept shard once more
            project(y, regathered_product(fn), x_in, (w,))
        return y
    return _bilinear(fn, name, xs, ws, _dx_fn, w_fn, x, w, w_args)


def _weight_recipe(w, x) -> tuple:
    """``(fn, args)`` of a weight computed from the step's inputs
    (:func:`jaxmem._prims.recipes.weight_recipe`), else ``(None, ())``. Only where every
    device holds the whole weight and outside ``shard_map`` (elsewhere the kept weight's
    layout is the step's: :func:`stored`)."""
    r = weight_recipe(w)
    if r is None or not weights_whole() or varying_axes(x) or varying_axes(w):
        return None, ()
    return r


# ----------------------------------------------------------------------- lax-compatible
def dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any, precision: Any = None,
                preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """Drop-in for ``lax.dot_general`` with differentiability-aware residuals."""
    return dot_with_recipe(lhs, rhs, False, dimension_numbers, precision,
                           preferred_element_type, **kwargs)


def dot_with_recipe(lhs, rhs, project_output: bool, dimension_numbers, precision=None,
                    preferred_element_type=None, **kwargs) -> jax.Array:
    """:func:`dot_general`; ``project_output=True`` records the output of a product of a
    normalisation's (or exact smooth activation's) output as recomputable for the attention
    core (:func:`bilinear`'s ``_project``; ``jaxmem.transform(..., projections=True)``)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    fn = functools.partial(
        _dot_general_fn,
        dimension_numbers=_freeze(dimension_numbers),
        precision=precision,
        preferred_element_type=preferred_element_type,
        kwargs=tuple(sorted(kwargs.items())),
    )
    return bilinear(fn, lhs, rhs, name="dense", _project=project_output)


def _dot_general_fn(x, w, *, dimension_numbers, precision, preferred_element_type, kwargs):
    return lax.dot_general(x, w, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **dict(kwargs))


def conv_general_dilated(lhs: ArrayLike, rhs: ArrayLike, window_strides: Sequence[int],
                         padding: Any, lhs_dilation: Sequence[int] | None = None,
                         rhs_dilation: Sequence[int] | None = None,
                         dimension_numbers: Any = None, feature_group_count: int = 1,
                         batch_group_count: int = 1, precision: Any = None,
                         preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """Drop-in for ``lax.conv_general_dilated`` with differentiability-aware residuals.

    Extra keyword arguments (e.g. ``out_sharding``) are passed through to lax; ``None``
    values are dropped. A 1x1, stride-1 convolution of a selective normalisation's output
    is recorded as recomputable (see :func:`bilinear`'s ``_pointwise``)."""
    return conv_with_recipe(lhs, rhs, True, window_strides, padding, lhs_dilation,
                            rhs_dilation, dimension_numbers, feature_group_count,
                            batch_group_count, precision, preferred_element_type, **kwargs)


def conv_with_recipe(lhs, rhs, recompute: bool, window_strides, padding, lhs_dilation=None,
                     rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                     batch_group_count=1, precision=None, preferred_element_type=None,
                     **kwargs) -> jax.Array:
    """:func:`conv_general_dilated`; ``recompute=False`` records no recipe for a pointwise
    convolution's output (``jaxmem.transform(..., conv_recompute=False)``)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    name = "conv_general_dilated"
    ndim_sp = jnp.ndim(lhs) - 2
    if ndim_sp < 1 or jnp.ndim(rhs) != jnp.ndim(lhs):
        raise ValueError(f"{name}: lhs and rhs must have the same rank >= 3, got shapes "
                         f"{jnp.shape(lhs)} and {jnp.shape(rhs)}")
    padding = _check_padding(padding, ndim_sp, name)
    window_strides = int_tuple(name, "window_strides", window_strides, ndim_sp)
    if lhs_dilation is not None:
        lhs_dilation = int_tuple(name, "lhs_dilation", lhs_dilation, ndim_sp)
    if rhs_dilation is not None:
        rhs_dilation = int_tuple(name, "rhs_dilation", rhs_dilation, ndim_sp)
    feature_group_count = positive_int(name, "feature_group_count", feature_group_count)
    batch_group_count = positive_int(name, "batch_group_count", batch_group_count)
    fn = functools.partial(
        lax.conv_general_dilated,
        window_strides=window_strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )
    dx_fn = None
    if not kwargs and preferred_element_type is None:
        dx_fn = _phase_dx_fn(jnp.shape(lhs), jnp.shape(rhs), window_strides, padding,
                             lhs_dilation, rhs_dilation, dimension_numbers,
                             feature_group_count, batch_group_count, precision)
    kernel = _kernel_spatial(jnp.shape(rhs), dimension_numbers)
    pointwise = (recompute and all(d == 1 for d in kernel)
                 and all(s == 1 for s in window_strides) and not kwargs
                 and lhs_dilation in (None, (1,) * ndim_sp)
                 and feature_group_count == 1 and batch_group_count == 1)
    return bilinear(fn, lhs, rhs, name="conv", _dx_fn=dx_fn, _pointwise=pointwise)


def _kernel_spatial(rhs_shape, dimension_numbers):
    """The kernel's spatial sizes (``lax``'s default layout ``OIHW`` when none is given)."""
    nd = len(rhs_shape)
    if dimension_numbers is None:
        return tuple(rhs_shape[2:])
    try:
        dn = lax.conv_dimension_numbers((1,) * nd, rhs_shape, dimension_numbers)
    except (TypeError, ValueError):
        return (0,)
    return tuple(rhs_shape[i] for i in dn.rhs_spec[2:])


# ------------------------------------------------- strided conv: input gradient by phases
def _phase_dx_fn(lhs_shape, rhs_shape, strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count, precision):
    """The input gradient of a strided, channel-last convolution as one stride-1
    convolution per output phase (``None`` where that does not apply).

    ``dL/dx`` of ``y = conv(x, w, stride s)`` is a convolution of the zero-interleaved
    cotangent. XLA (CPU) runs it with a large runtime scratch buffer outside its memory plan
    (ResNet stem, 7x7/2, batch 32: 18 MiB measured for a 1.5 MiB result). Splitting ``dx`` by
    ``i mod s`` per spatial axis gives ``s^d`` stride-1 convolutions of ``g`` with the kernel
    taps of that phase -- the same products without the zeros -- interleaved afterwards.
    Exact in math; float sums may be ordered differently than XLA's (rounding level).
    Applies to NHWC-style layouts (``N, *spatial, C`` / ``*kernel, I, O``), no dilations,
    one group, some stride > 1.
    """
    nd = len(lhs_shape)
    nsp = nd - 2
    if not 1 <= nsp <= 3 or len(rhs_shape) != nd or not any(s > 1 for s in strides):
        return None
    if feature_group_count != 1 or batch_group_count != 1:
        return None
    for dil in (lhs_dilation, rhs_dilation):
        if dil is not None and any(d != 1 for d in dil):
            return None
    if dimension_numbers is None:
        return None
    try:
        dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    except (TypeError, ValueError):
        return None
    spatial = tuple(range(1, nd - 1))
    if (tuple(dn.lhs_spec) != (0, nd - 1) + spatial or tuple(dn.out_spec) != tuple(dn.lhs_spec)
            or tuple(dn.rhs_spec) != (nd - 1, nd - 2) + tuple(range(nsp))):
        return None
    in_sp = tuple(lhs_shape[1:-1])
    k_sp = tuple(rhs_shape[:-2])
    if isinstance(padding, str):
        pads = tuple(tuple(p) for p in lax.padtype_to_pads(in_sp, k_sp, strides, padding))
    else:
        pads = tuple(tuple(p) for p in padding)
    return functools.partial(_phase_input_grad, in_spatial=in_sp, strides=tuple(strides),
                             pads=pads, precision=precision)


def _phase_input_grad(g, w, *, in_spatial, strides, pads, precision):
    nsp = len(strides)
    n, cin = g.shape[0], w.shape[-2]
    out_sp = g.shape[1:1 + nsp]
    # per axis and phase c: output rows i = s*q + c get the taps k = c + pl (mod s), i.e.
    # dx_c[q] = sum_j g[q - m_j] w[k_j] with m_j = (k_j - c - pl) / s  (a stride-1 conv)
    per_axis = []
    for d in range(nsp):
        s, kn, pl, size, osz = strides[d], w.shape[d], pads[d][0], in_spatial[d], out_sp[d]
        phases = []
        for c in range(s):
            q = -(-(size - c) // s) if size > c else 0
            taps = [k for k in range(kn) if (k - c - pl) % s == 0]
            if not taps or q == 0:
                phases.append((q, None, None))
                continue
            lo = (taps[-1] - c - pl) // s
            phases.append((q, taps[::-1], (lo, q - osz - lo + len(taps) - 1)))
        per_axis.append(phases)
    qmax = tuple(max(1, -(-size // s)) for size, s in zip(in_spatial, strides))
    wt = jnp.swapaxes(w, -1, -2)  # (*kernel, Cout, Cin): g's channels in, x's out
    dn = _conv_dn(nsp)
    blocks = []
    for combo in itertools.product(*per_axis):
        qs = tuple(p[0] for p in combo)
        if any(p[1] is None for p in combo):
            out = jnp.zeros((n, *qs, cin), g.dtype)
        else:
            sub = wt
            for d, p in enumerate(combo):  # taps p[1] descend in steps of strides[d]
                sub = lax.rev(lax.slice_in_dim(sub, p[1][-1], p[1][0] + 1, strides[d], d),
                              (d,))
            out = lax.conv_general_dilated(g, sub, (1,) * nsp, [p[2] for p in combo],
                                           dimension_numbers=dn, precision=precision)
        blocks.append(jnp.pad(out, [(0, 0)] + [(0, a - b) for a, b in zip(qmax, qs)]
                              + [(0, 0)]))
    st = jnp.stack(blocks, 0).reshape(tuple(strides) + (n, *qmax, cin))
    perm = [nsp] + [a for d in range(nsp) for a in (nsp + 1 + d, d)] + [2 * nsp + 1]
    full = st.transpose(perm).reshape((n,) + tuple(q * s for q, s in zip(qmax, strides))
                                      + (cin,))
    return full[(slice(None),) + tuple(slice(0, size) for size in in_spatial)]


def _freeze(dn):
    (lc, rc), (lb, rb) = dn
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


_PAD_STRINGS = ("SAME", "VALID", "SAME_LOWER")


def _check_padding(padding, ndim_sp: int, fn: str = "conv"):
    """``padding`` as an upper-case string or a tuple of ``ndim_sp`` (lo, hi) int pairs.

    Ints may be negative (a crop), as in ``lax``."""
    if isinstance(padding, str):
        if padding.upper() not in _PAD_STRINGS:
            raise ValueError(
                f"{fn}: padding must be one of {_PAD_STRINGS}, an int, or a sequence of "
                f"{ndim_sp} (low, high) pairs; got {padding!r}"
            )
        return padding.upper()
    i = as_int(padding)
    if i is not None:
        return tuple((i, i) for _ in range(ndim_sp))
    try:
        pads = list(padding)
    except TypeError:
        raise ValueError(f"{fn}: padding must be a string, an int or a sequence, got "
                         f"{padding!r}") from None
    if len(pads) != ndim_sp:
        raise ValueError(
            f"{fn}: padding needs one entry per spatial dimension ({ndim_sp}), got {padding!r}"
        )
    out = []
    for p in pads:
        i = as_int(p)
        if i is not None:
            out.append((i, i))
            continue
        try:
            lo, hi = p
        except (TypeError, ValueError):
            lo = hi = None
        lo, hi = as_int(lo), as_int(hi)
        if lo is None or hi is None:
            raise ValueError(
                f"{fn}: each padding entry must be an int or a (low, high) pair of ints, got "
                f"{p!r} in {padding!r}")
        out.append((lo, hi))
    return tuple(out)


# ----------------------------------------------------------------------- friendly API
def _promote(x, w, b, name):
    check_float(f"{name}: x", x)
    check_float(f"{name}: w", w)
    if b is not None:
        check_float(f"{name}: b", b)
    dt = jnp.result_type(x, w) if b is None else jnp.result_type(x, w, b)
    x = jnp.asarray(x, dt)
    w = jnp.asarray(w, dt)
    b = None if b is None else jnp.asarray(b, dt)
    return x, w, b


def dense(x: ArrayLike, w: ArrayLike, b: ArrayLike | None = None, *,
          precision: Any = None) -> jax.Array:
    """``y = x @ w + b`` over the last axis of ``x``; ``w`` has shape ``(in, out)``.

    Stores ``x`` only if ``w`` is differentiated and ``w`` only if ``x`` is; ``b`` needs
    nothing.
    """
    x, w, b = _promote(x, w, b, "dense")
    if jnp.ndim(w) != 2:
        raise ValueError(f"dense: w must be 2-D (in, out), got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(
            f"dense: last axis of x {jnp.shape(x)} must equal w.shape[0] {jnp.shape(w)}")
    if b is not None and jnp.shape(b) != (jnp.shape(w)[1],):
        raise ValueError(f"dense: b must have shape ({jnp.shape(w)[1]},), got {jnp.shape(b)}")
    y = dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    if b is not None:
        y = y + b
    return y


def _conv_dn(nsp: int):
    sp = "DHW"[-nsp:] if nsp <= 3 else None
    if sp is None:
        raise ValueError(f"conv supports 1, 2 or 3 spatial dimensions, got {nsp}")
    return lax.conv_dimension_numbers(
        (1,) * (nsp + 2), (1,) * (nsp + 2), ("N" + sp + "C", sp + "IO", "N" + sp + "C"))


def conv(x: ArrayLike, w: ArrayLike, b: ArrayLike | None = None, *,
         strides: int | Sequence[int] = 1, padding: Any = "SAME",
         dilation: int | Sequence[int] = 1, input_dilation: int | Sequence[int] = 1,
         feature_group_count: int = 1, precision: Any = None) -> jax.Array:
    """N-D convolution (1/2/3 spatial dims) in Flax layout: ``x`` is ``(N, *spatial, Cin)``,
    ``w`` is ``(*kernel, Cin // groups, Cout)``, ``b`` is ``(Cout,)``.

    ``padding``: ``'SAME'``, ``'VALID'``, ``'SAME_LOWER'``, an int, or one int / ``(lo, hi)``
    pair per spatial dimension. Stores ``x`` only if ``w`` is differentiated and ``w`` only
    if ``x`` is.
    """
    x, w, b = _promote(x, w, b, "conv")
    nsp = jnp.ndim(x) - 2
    if nsp not in (1, 2, 3):
        raise ValueError(f"conv: x must be (N, *spatial, C) with 1-3 spatial dims, got shape "
                         f"{jnp.shape(x)}")
    if jnp.ndim(w) != nsp + 2:
        raise ValueError(f"conv: w must have {nsp + 2} dims (*kernel, Cin/groups, Cout), got "
                         f"{jnp.shape(w)}")
    groups = positive_int("conv", "feature_group_count", feature_group_count)
    if jnp.shape(x)[-1] != jnp.shape(w)[-2] * groups:
        raise ValueError(
            f"conv: x has {jnp.shape(x)[-1]} channels but w expects "
            f"{jnp.shape(w)[-2]} x feature_group_count={feature_group_count}")
    if jnp.shape(w)[-1] % groups:
        raise ValueError(f"conv: feature_group_count={feature_group_count} must divide the "
                         f"output channels w.shape[-1]={jnp.shape(w)[-1]}")
    y = conv_general_dilated(
        x, w, int_tuple("conv", "strides", strides, nsp), _check_padding(padding, nsp),
        lhs_dilation=int_tuple("conv", "input_dilation", input_dilation, nsp),
        rhs_dilation=int_tuple("conv", "dilation", dilation, nsp),
        dimension_numbers=_conv_dn(nsp), feature_group_count=groups,
        precision=precision)
    if b is not None:
        y = y + b
    return y


def conv_transpose(x: ArrayLike, w: ArrayLike, b: ArrayLike | None = None, *,
                   strides: int | Sequence[int] = 1, padding: Any = "SAME",
                   dilation: int | Sequence[int] = 1, transpose_kernel: bool = False,
                   precision: Any = None) -> jax.Array:
    """Transposed convolution with the semantics of ``lax.conv_transpose`` (Flax layout).

    ``x`` is ``(N, *spatial, Cin)``, ``w`` is ``(*kernel, Cin, Cout)`` (or ``Cout, Cin`` when
    ``transpose_kernel``). Stores ``x`` only if ``w`` is differentiated, ``w`` only if ``x`` is.
    """
    x, w, b = _promote(x, w, b, "conv_transpose")
    nsp = jnp.ndim(x) - 2
    if nsp not in (1, 2, 3) or jnp.ndim(w) != nsp + 2:
        raise ValueError(f"conv_transpose: x must be (N, *spatial, C) with 1-3 spatial dims "
                         f"and w (*kernel, Cin, Cout); got {jnp.shape(x)} and {jnp.shape(w)}")
    padding = _check_padding(padding, nsp, "conv_transpose")
    if padding == "SAME_LOWER":
        raise ValueError("conv_transpose: padding must be 'SAME', 'VALID' or explicit pairs")
    cin = jnp.shape(w)[-1] if transpose_kernel else jnp.shape(w)[-2]
    if jnp.shape(x)[-1] != cin:
        raise ValueError(f"conv_transpose: x has {jnp.shape(x)[-1]} channels, w expects {cin}")
    fn = functools.partial(
        lax.conv_transpose,
        strides=int_tuple("conv_transpose", "strides", strides, nsp),
        padding=padding,
        rhs_dilation=int_tuple("conv_transpose", "dilation", dilation, nsp),
        dimension_numbers=_conv_dn(nsp),
        transpose_kernel=transpose_kernel,
        precision=precision,
    )
    y = bilinear(fn, x, w, name="conv_transpose")
    if b is not None:
        y = y + b
    return y
