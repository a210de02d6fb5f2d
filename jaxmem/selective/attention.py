"""Exact softmax / attention pieces whose backward keeps only what it needs.

Few-bit activations remove the float copy of an MLP's pre-activation; in a transformer block
the next largest residual is the attention matrix.  JAX's own ``jax.nn.softmax`` (a
``custom_jvp``) and the ``jnp.where`` causal mask in front of it leave several
``(batch, heads, T, T)`` arrays to autodiff (the probabilities, the unnormalised
exponentials, the masked scores and a broadcast boolean mask); XLA keeps part of them.
These functions are **exact** (same forward, same gradient up to float rounding) and only
change what is stored:

* :func:`softmax` -- ``custom_vjp`` that stores the output ``y`` once;
  ``dx = y * (g - sum(g * y, axis))``.  The same ``y`` is the residual of the following
  ``y @ v`` product, so XLA keeps one ``(B, H, T, T)`` array per layer.
* :func:`attention` -- ``softmax(q k^T * scale + bias [masked]) v`` with a flash-style
  backward: it stores ``q, k, v`` (``bias``, ``mask``) and two per-row statistics (max and
  sum), and recomputes the probabilities in the backward pass (``P = exp(s - m) / l``);
  nothing ``T x S`` survives the forward pass.  Costs one extra ``q k^T`` product in the
  backward pass.  A query row whose keys are all masked gets uniform weights ``1 / S`` and
  ``dq = 0`` (what the masked softmax of Flax / ``jax.nn.dot_product_attention`` gives).
* :func:`attention_core` / :class:`AttentionSpec` -- the one core behind :func:`attention`
  and :mod:`jaxmem.fewbit.flax_attention` (Flax's arithmetic, attention dropout whose mask
  is regenerated from its key in the backward pass).

Models use them without edits through ``jaxmem.scope(attention=True)`` /
``jaxmem.linen.convert`` (the default), which also covers Flax's attention and the model
zoo's :class:`jaxmem.models.SelfAttention`.

Recomputations in a backward pass carry a data dependency on the incoming cotangent
(``jaxmem._prims.ties.tie``: exact, local to each shard, so no added communication under
sharding) so XLA cannot hoist them into the forward pass and keep their result alive
(``lax.optimization_barrier`` is dropped by the CPU pipeline -- measured).  Every claim is
checked with the compiled-bytes slope in ``parity_tests/fewbit/test_fewbit_attention.py``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxmem._prims.recipes import PROJECTED, depth, kept, recipe
from jaxmem._prims.ties import tie
from jaxmem.selective._core import perturbed, value
from jaxmem.selective.attention_chunks import chunked, forward_in_chunks, grads_in_chunks

__all__ = ["AttentionSpec", "attention", "attention_core", "softmax"]

_ORIG_SOFTMAX = jax.nn.softmax
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _check_float(x, who: str, arg: str):
    x = jnp.asarray(x)
    if not any(x.dtype == d for d in _FLOATS):
        raise TypeError(f"{who}: {arg} must be float32, bfloat16 or float16 (float64 under "
                        f"x64), got dtype {x.dtype}")
    return x


def _stat_dtype(dtype):
    """float32 for bf16/f16/f32 scores, float64 under x64."""
    return jnp.promote_types(dtype, jnp.float32)


def _axes(axis, ndim: int, who: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        ax = (axis,)
    elif isinstance(axis, (tuple, list)):
        ax = tuple(axis)
    else:
        ax = ()
    if not ax or any(isinstance(a, bool) or not isinstance(a, int) for a in ax):
        raise TypeError(f"{who}: axis must be an int, a tuple of ints or None, got {axis!r}")
    out = []
    for a in ax:
        if not -ndim <= a < ndim:
            raise ValueError(f"{who}: axis {a} out of range for an array of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{who}: repeated axis in {axis!r}")
    return tuple(sorted(out))


# ----------------------------------------------------------------------------- softmax

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x, axes):
    return _ORIG_SOFTMAX(x, axis=axes)


def _softmax_fwd(x, axes):
    y = _ORIG_SOFTMAX(x, axis=axes)
    return y, y


def _softmax_bwd(axes, y, g):
    return (y * (g - jnp.sum(g * y, axis=axes, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax_where(x, where, axes):
    return _ORIG_SOFTMAX(x, axis=axes, where=where)


def _softmax_where_fwd(x, where, axes):
    y = _ORIG_SOFTMAX(x, axis=axes, where=where)
    return y, y


def _softmax_where_bwd(axes, y, g):
    # masked-out outputs are exactly 0, so y * (...) is 0 there: no mask needed.
    return y * (g - jnp.sum(g * y, axis=axes, keepdims=True)), None


_softmax_where.defvjp(_softmax_where_fwd, _softmax_where_bwd)


def softmax(x: ArrayLike, axis: int | Sequence[int] | None = -1,
            where: ArrayLike | None = None) -> jax.Array:
    """``jax.nn.softmax(x, axis, where)`` (same forward) whose backward stores only the output.

    Gradient ``dx = y * (g - sum(g * y, axis))`` -- exact, the derivative of softmax; equal
    to JAX's up to float rounding.  ``where`` (boolean, broadcastable to ``x``) is not
    stored: masked-out outputs are 0, which already zeroes their gradient.
    """
    x = _check_float(x, "softmax", "x")
    axes = _axes(axis, x.ndim, "softmax")
    if where is None:
        return _softmax(x, axes)
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(f"softmax: where must be a boolean array, got dtype {where.dtype}")
    return _softmax_where(x, where, axes)


# --------------------------------------------------------------------------- attention

@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention forward arithmetic (hashable).

    The scores are ``s = q k^T`` (``qk_precision``; accumulated in ``logits_dtype`` when set),
    then ``s * scale`` (when ``scale`` is set), ``s / divisor`` (when ``divisor`` is set: a
    program that divides, whose rounding differs from a product with ``1 / divisor`` in
    bf16), ``+ bias``, and masked entries (``mask`` False
    or outside the ``causal`` band) replaced by ``fill``: ``"min"`` is
    ``finfo(q.dtype).min`` (Flax, the model zoo), ``"large"`` is JAX's
    ``-0.7 * finfo(s.dtype).max`` (capped at the float32 range), a float is that value in
    the scores' dtype (``jnp.where(mask, s, -1e9)``).  The weights are
    ``softmax(s.astype(softmax_dtype)).astype(weights_dtype)`` (no cast where ``None``),
    multiplied by ``keep / (1 - dropout_rate)`` when ``dropout_rate > 0`` (Flax's spelling;
    with ``dropout_select``, ``where(keep, w / (1 - dropout_rate), 0)``: Equinox's), and
    contracted with ``v`` (``pv_precision``).  The mask ``keep`` is ``bernoulli(rng, 1 -
    dropout_rate)`` of the weights' shape, or of ``(1, ..., 1, T, S)`` with
    ``broadcast_dropout``; a batch of keys (``rng`` of shape ``K``) draws one mask per key
    over the weights' leading ``K`` axes.  ``causal``: ``"bottom_right"`` keeps key
    ``j <= i + S - T``, ``"top_left"`` keeps ``j <= i``.  ``query_chunk``: ``None`` or
    query rows per chunk: both passes run that many rows at a time
    (:mod:`jaxmem.selective.attention_chunks`; the working set ``(..., H, c, S)`` instead of
    ``(..., H, T, S)``; ``dk``, ``dv`` summed over the chunks).
    """
    scale: float | None = None
    divisor: float | None = None
    logits_dtype: str | None = None
    fill: str | float = "min"
    causal: str | None = None
    softmax_dtype: str | None = None
    weights_dtype: str | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = True
    dropout_select: bool = False
    qk_precision: object = None
    pv_precision: object = None
    query_chunk: int | None = None


def _fill_value(spec: AttentionSpec, q_dtype, s_dtype):
    if not isinstance(spec.fill, str):
        return jnp.asarray(spec.fill, dtype=s_dtype)
    if spec.fill == "min":
        return jnp.finfo(q_dtype).min
    big = min(float(jnp.finfo(s_dtype).max), float(jnp.finfo(jnp.float32).max))
    return jnp.asarray(-0.7 * big, dtype=s_dtype)


def _valid(mask, causal, t: int, s_len: int):
    """Boolean ``keep`` (broadcastable to the scores) or ``None`` when nothing is masked."""
    keep = mask
    if causal is not None:
        band = jnp.tril(jnp.ones((t, s_len), bool), k=s_len - t if causal == "bottom_right"
                        else 0)
        keep = band if keep is None else jnp.logical_and(keep, band)
    return keep


def _scores(q, k, bias, mask, spec: AttentionSpec):
    """Masked scores ``(..., H, T, S)`` (cast to ``softmax_dtype``), the boolean ``keep``
    (or ``None``) and the scores' dtype before that cast."""
    if spec.logits_dtype is not None:
        kw = {"preferred_element_type": jnp.dtype(spec.logits_dtype)}
        try:
            s = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=spec.qk_precision, **kw)
        except ValueError:  # a dot algorithm the platform lacks: default precision (as JAX)
            s = jnp.einsum("...qhd,...khd->...hqk", q, k, **kw)
    else:
        s = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=spec.qk_precision)
    if spec.scale is not None:
        s = s * jnp.asarray(spec.scale, s.dtype)
    if spec.divisor is not None:
        s = s / jnp.asarray(spec.divisor, s.dtype)
    if bias is not None:
        s = s + bias
        if spec.logits_dtype is not None:
            s = s.astype(jnp.dtype(spec.logits_dtype))
    keep = _valid(mask, spec.causal, q.shape[-3], k.shape[-3])
    if keep is not None:
        s = jnp.where(keep, s, _fill_value(spec, q.dtype, s.dtype))
    pre = s.dtype
    if spec.softmax_dtype is not None:
        s = s.astype(jnp.dtype(spec.softmax_dtype))
    return s, keep, pre


def _dropout_keep(rng, spec: AttentionSpec, key_ndim: int, w_shape):
    """The dropout mask ``bernoulli(rng, 1 - rate, shape)`` (shape ``(1,) * (key.ndim - 2) +
    (T, S)`` when ``broadcast_dropout``, else the weights'); a batch of keys draws one mask
    per key over the leading axes (``jax.vmap``, as a vmapped model draws them)."""
    keep_prob = 1.0 - spec.dropout_rate
    shape = _dropout_shape(spec, key_ndim, w_shape)
    nk = rng.ndim if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng.ndim - 1
    draw = lambda k: jax.random.bernoulli(k, keep_prob, shape[nk:])
    for _ in range(nk):
        draw = jax.vmap(draw)
    return draw(rng)


def _dropout_shape(spec: AttentionSpec, key_ndim: int, w_shape) -> tuple:
    """The shape of the dropout mask of weights of shape ``w_shape``."""
    return ((1,) * (key_ndim - 2) + tuple(w_shape[-2:]) if spec.broadcast_dropout
            else tuple(w_shape))


def _drop(w, keep, spec: AttentionSpec, dtype):
    """The dropout of ``w`` (weights, or their cotangent: the same linear map): Flax's
    ``w * (keep / keep_prob)`` with the multiplier in ``dtype`` (the inputs'), or, with
    ``dropout_select``, ``where(keep, w / keep_prob, 0)`` in ``w``'s dtype."""
    if spec.dropout_select:
        kp = jnp.asarray(1.0 - spec.dropout_rate, dtype=w.dtype)
        return jnp.where(keep, w / kp, jnp.zeros((), w.dtype))
    return w * (keep.astype(dtype) / jnp.asarray(1.0 - spec.dropout_rate, dtype=dtype))


def _unbroadcast(g, shape, dtype):
    """Sum ``g`` down to ``shape`` (the transpose of broadcasting), cast to ``dtype``."""
    shape = tuple(shape)
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and g.shape[lead + i] != 1)
    if axes:
        g = jnp.sum(g, axis=axes, keepdims=True)
    return jnp.reshape(g, shape).astype(dtype)


def _forward(q, k, v, bias, mask, rng, spec: AttentionSpec, drop=None):
    """``(o, (m, l))``: the output and the softmax's row statistics; ``drop`` the dropout
    mask when given (a chunk's rows of the whole draw), else drawn from ``rng``."""
    if chunked(spec, q):
        return forward_in_chunks(q, k, v, bias, mask, rng, spec)
    s, _, _ = _scores(q, k, bias, mask, spec)
    w = _ORIG_SOFTMAX(s, axis=-1)
    if spec.weights_dtype is not None:
        w = w.astype(jnp.dtype(spec.weights_dtype))
    if spec.dropout_rate > 0.0:
        if drop is None:
            drop = _dropout_keep(rng, spec, k.ndim, w.shape)
        w = _drop(w, drop, spec, q.dtype)
    o = jnp.einsum("...hqk,...khd->...qhd", w, v, precision=spec.pv_precision)
    # row statistics of the softmax, float32 (float64 for float64 scores)
    sf = s.astype(_stat_dtype(s.dtype))
    m = jnp.max(sf, axis=-1, keepdims=True, initial=-jnp.inf)
    den = jnp.sum(jnp.exp(sf - m), axis=-1, keepdims=True)
    return o, (m, den)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _core(q, k, v, bias, mask, rng, spec):
    return _forward(q, k, v, bias, mask, rng, spec)[0]


def _core_fwd(q, k, v, bias, mask, rng, spec):
    o, (m, den) = _forward(q, k, v, bias, mask, rng, spec)
    return o, (q, k, v, bias, mask, rng, m, den)


def _bwd_precision(p):
    return p if p is None or isinstance(p, (jax.lax.Precision, str, tuple)) else None


def _core_bwd(spec, res, do):
    # every residual (the dropout key too: its mask is regenerated here) is tied to ``do``,
    # so nothing in the backward pass is scheduled into the forward pass
    return _core_grads(spec, *tie(res, do), do)


def _core_grads(spec, q, k, v, bias, mask, rng, m, den, do):
    """``(dq, dk, dv, dbias, None, None)`` (whole, or query chunk by query chunk)."""
    if chunked(spec, q):
        return grads_in_chunks(spec, q, k, v, bias, mask, rng, m, den, do)
    dq, dk, dv, ds = _raw_grads(spec, q, k, v, bias, mask, rng, m, den, do)
    dbias = None if ds is None else _unbroadcast(ds, bias.shape, bias.dtype)
    return (_unbroadcast(dq, q.shape, q.dtype), _unbroadcast(dk, k.shape, k.dtype),
            _unbroadcast(dv, v.shape, v.dtype), dbias, None, None)


def _raw_grads(spec, q, k, v, bias, mask, rng, m, den, do, drop=None):
    """``dq, dk, dv`` in the scores' broadcast shape and the bias's cotangent ``ds`` (before
    the scale; ``None`` without a float bias); ``drop`` the dropout mask when given."""
    # ``P = exp(s - m) / den`` from the stored row max and row sum: a fully masked row (all
    # scores equal to the fill value) gets ``1 / S`` like the forward's softmax.
    s, keep, pre = _scores(q, k, bias, mask, spec)
    p = jnp.exp(s.astype(m.dtype) - m) / den                        # recomputed softmax
    wd = jnp.dtype(spec.weights_dtype) if spec.weights_dtype is not None else s.dtype
    w = p.astype(wd)
    keep_d = None
    if spec.dropout_rate > 0.0:
        keep_d = drop if drop is not None else _dropout_keep(rng, spec, k.ndim, s.shape)
        w = _drop(w, keep_d, spec, q.dtype)
    prec = _bwd_precision(spec.pv_precision)
    dv = jnp.einsum("...hqk,...qhd->...khd", w, do.astype(jnp.result_type(w, v)),
                    precision=prec)
    dw = jnp.einsum("...qhd,...khd->...hqk", do, v.astype(do.dtype), precision=prec)
    if keep_d is not None:
        dw = _drop(dw, keep_d, spec, q.dtype)
    g = dw.astype(p.dtype)
    dx = p * (g - jnp.sum(p * g, axis=-1, keepdims=True))           # softmax vjp
    if keep is not None:
        dx = jnp.where(keep, dx, jnp.zeros((), dx.dtype))          # masked: no gradient
    ds = dx.astype(pre)          # the scores' dtype (transpose of the softmax_dtype cast)
    dbias = ds if bias is not None and jnp.issubdtype(bias.dtype, jnp.inexact) else None
    if spec.scale is not None:
        ds = ds * jnp.asarray(spec.scale, ds.dtype)
    if spec.divisor is not None:
        ds = ds / jnp.asarray(spec.divisor, ds.dtype)
    prec = _bwd_precision(spec.qk_precision)
    dq = jnp.einsum("...hqk,...khd->...qhd", ds, k.astype(ds.dtype), precision=prec)
    dk = jnp.einsum("...hqk,...qhd->...khd", ds, q.astype(ds.dtype), precision=prec)
    return dq, dk, dv, dbias


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------- queries, keys, values recomputed from their projection's recipe
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _core_rec(q, k, v, bias, mask, rng, rec, spec, recipes):
    del rec, recipes
    return _forward(q, k, v, bias, mask, rng, spec)[0]


def _core_rec_fwd(q, k, v, bias, mask, rng, rec, spec, recipes):
    """As ``_core_fwd``, but ``q``, ``k`` or ``v`` may equal ``fn(*rec[idx])`` (``recipes``,
    :func:`jaxmem._prims.recipes.project`): one whose producers keep those arguments for
    their own backward (``groups``) is not stored; its recipe's arguments are."""
    qkv = (q.value, k.value, v.value)
    o, (m, den) = _forward(*qkv, value(bias), value(mask), value(rng), spec)
    stored = tuple(x if r is None or not kept([rec[i] for i in r[1]], r[2], perturbed)
                   else None for x, r in zip(qkv, recipes))
    res_rec = tuple(value(p) for p in rec) if any(x is None for x in stored) else None
    return o, (stored, value(bias), value(mask), value(rng), m, den, res_rec)


def _core_rec_bwd(spec, recipes, res, do):
    stored, bias, mask, rng, m, den, res_rec = res
    q, k, v = (tie(x, do) if x is not None else None for x in stored)
    bias, mask, rng, m, den = tie((bias, mask, rng, m, den), do)
    if res_rec is not None:
        # every argument tied (tying only the norm's ``x`` let XLA:GPU keep HF ViT's forward
        # q, k, v: 48.1 vs 45.0 MiB); shared arguments appear once in ``res_rec``, so a
        # shared recomputation (the norm, one projection split three ways) is one computation
        args = list(tie(res_rec, do))
        q, k, v = (x if x is not None else r[0](*[args[i] for i in r[1]])
                   for x, r in zip((q, k, v), recipes))
    grads = _core_grads(spec, q, k, v, bias, mask, rng, m, den, do)
    n_rec = 1 + max(i for r in recipes if r is not None for i in r[1])
    return (*grads, (None,) * n_rec)


_core_rec.defvjp(_core_rec_fwd, _core_rec_bwd, symbolic_zeros=True)


#: While :func:`projections_seen` is active: the names (``"q"``, ``"k"``, ``"v"``) of the
#: inputs that :func:`attention_core` found recorded as a projection (one list per core call).
_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxmem_attention_projections",
                                                                   default=None)


@contextlib.contextmanager
def projections_seen() -> Iterator[list]:
    """Collect, per :func:`attention_core` call inside the context, which of ``q, k, v`` it
    may recompute from their projection instead of storing (a tuple of names; empty when
    none): what ``jaxmem.transform``'s report says of each attention core."""
    seen: list = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def _with_recipes(q, k, v):
    """``(rec, recipes)`` for :func:`_core_rec` when one of ``q, k, v`` is a recorded
    projection (:func:`jaxmem._prims.recipes.project`, then relayouts; several producers
    after a rotary embedding combined its halves), else ``None``:
    ``rec`` the distinct arguments of their recipes, ``recipes[j]`` ``None`` or
    ``(fn, indices into rec, groups)``."""
    rec: list = []
    where: dict = {}
    recipes = []
    for x in (q, k, v):
        r = recipe(x) if depth(x) == PROJECTED else None
        if r is None:
            recipes.append(None)
            continue
        fn, args, groups = r
        idx = []
        for a in args:
            if id(a) not in where:
                where[id(a)] = len(rec)
                rec.append(a)
            idx.append(where[id(a)])
        recipes.append((fn, tuple(idx), groups))
    if all(r is None for r in recipes):
        return None
    return tuple(rec), tuple(recipes)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, *, bias: jax.Array | None = None,
                   mask: jax.Array | None = None, rng: jax.Array | None = None,
                   spec: AttentionSpec = AttentionSpec()) -> jax.Array:
    """The one exact attention core behind :func:`attention` and
    :mod:`jaxmem.fewbit.flax_attention` (no argument checks: callers check).

    ``q: (..., T, H, D)``, ``k: (..., S, H, D)``, ``v: (..., S, H, Dv)`` (promoted to one
    dtype by the caller), ``bias`` float and ``mask`` bool broadcastable to
    ``(..., H, T, S)``, ``rng`` the dropout key when ``spec.dropout_rate > 0``.  Forward: the
    arithmetic ``spec`` describes.  Backward stores ``q, k, v, bias, mask, rng`` and two
    ``(..., H, T, 1)`` row statistics (max ``m``, sum ``l`` of ``exp(s - m)``), recomputes
    ``P = exp(s - m) / l`` and the dropout multiplier ``M`` (from ``rng``), and returns
    ``dv = (P M)^T do``, ``dW = do v^T M``, ``ds = [keep] P (dW - rowsum(P dW))``,
    ``dbias = ds`` (summed to ``bias``'s shape), ``dq = scale ds k``, ``dk = scale ds^T q``.
    A row whose keys are all masked has uniform weights ``1 / S`` (its scores all equal
    the fill value) and, since no score depends on ``q`` or ``k``, ``dq = 0`` and no ``dk``
    from it, exactly like autodiff of the masked softmax.

    A ``q``, ``k`` or ``v`` recorded as a projection of a normalisation's output
    (:func:`jaxmem._prims.recipes.project`: ``jaxmem.transform(..., projections=True)``)
    is not stored when that norm keeps its residuals anyway: the backward recomputes it from
    them and the weight (one projection per recorded tensor, shared ones once).
    """
    found = _with_recipes(q, k, v)
    seen = _SEEN.get()
    if seen is not None:
        seen.append(() if found is None else
                    tuple(n for n, r in zip("qkv", found[1]) if r is not None))
    if found is not None:
        return _core_rec(q, k, v, bias, mask, rng, found[0], spec, found[1])
    return _core(q, k, v, bias, mask, rng, spec)


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              scale: float | None = None, bias: ArrayLike | None = None,
              mask: ArrayLike | None = None, query_chunk: int | None = None) -> jax.Array:
    """Exact dot-product attention ``softmax(q k^T * scale + bias [masked]) v``.

    Shapes ``q: (..., T, H, D)``, ``k, v: (..., S, H, D)`` (the ``"bthd"`` layout of
    :class:`jaxmem.models.SelfAttention`); returns ``(..., T, H, D)``.  ``scale`` defaults to
    ``1 / sqrt(D)``.  ``bias`` (float) and ``mask`` (bool, ``False`` = masked) broadcast to
    ``(..., H, T, S)``; ``causal=True`` also masks key ``j > i + (S - T)``.  Masked scores
    become the dtype's most negative finite value before the softmax (like the model zoo and
    Flax), so a query row with every key masked (e.g. the first ``T - S`` rows when
    ``causal`` and ``T > S``) gets uniform weights ``1 / S``, gradient ``dq = 0`` and no
    ``dk`` contribution -- what ``jax.nn.dot_product_attention`` and autodiff return.
    ``S = 0`` gives zeros, ``T = 0`` or a zero batch an empty result.

    Backward (flash-style, exact): stores ``q, k, v`` (and ``bias``/``mask``) and two float32
    statistics per row (float64 for float64 inputs); recomputes ``P = exp(s - m) / l`` and
    returns ``dv = P^T do``, ``dP = do v^T``, ``ds = P * (dP - rowsum(P * dP))``,
    ``dq = scale ds k``, ``dk = scale ds^T q``.  Nothing of size ``T x S`` is kept between
    forward and backward; with ``query_chunk`` nothing of that size is formed either (both
    passes run ``query_chunk`` query rows at a time: :mod:`jaxmem.selective.attention_chunks`).

    Args:
      q: queries, ``(..., T, H, D)``, floating point.
      k: keys, ``(..., S, H, D)``.
      v: values, ``(..., S, H, D)``.
      causal: mask key ``j > i + (S - T)`` for query ``i``.
      scale: multiplies the scores (default ``1 / sqrt(D)``).
      bias: optional float array added to the scores, broadcast to ``(..., H, T, S)``.
      mask: optional bool array (``False`` = masked), broadcast to ``(..., H, T, S)``.
      query_chunk: ``None`` (whole) or query rows per chunk, an int >= 1.

    Returns:
      The attention output, ``(..., T, H, D)``, in the dtype of ``q``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.selective import attention
      >>> q = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 2, 4))
      >>> o = attention(q, q, q, causal=True)
      >>> o.shape
      (2, 5, 2, 4)
      >>> ref = jax.nn.dot_product_attention(q, q, q, is_causal=True)
      >>> bool(jnp.allclose(o, ref, atol=1e-5))
      True
    """
    who = "attention"
    q = _check_float(q, who, "q")
    k = _check_float(k, who, "k")
    v = _check_float(v, who, "v")
    if not isinstance(causal, bool):
        raise TypeError(f"{who}: causal must be a bool, got {causal!r}")
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"{who}: q, k, v must have the same rank >= 3 (..., T, H, D), got "
                         f"shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[:-3] != k.shape[:-3] or q.shape[-2:] != k.shape[-2:]:
        raise ValueError(f"{who}: q (..., T, H, D) and k, v (..., S, H, D) must agree, got "
                         f"shapes {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{who}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{who}: scale must be a Python float or None, got {scale!r}")
    sshape = q.shape[:-3] + (q.shape[-2], q.shape[-3], k.shape[-3])
    if bias is not None:
        bias = _check_float(bias, who, "bias")
        _check_broadcast(bias, sshape, who, "bias")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"{who}: mask must be a boolean array, got dtype {mask.dtype}")
        _check_broadcast(mask, sshape, who, "mask")
    if query_chunk is not None and (isinstance(query_chunk, bool)
                                    or not isinstance(query_chunk, int) or query_chunk < 1):
        raise ValueError(f"{who}: query_chunk must be None or an int >= 1, got {query_chunk!r}")
    spec = AttentionSpec(scale=float(scale), causal="bottom_right" if causal else None,
                         query_chunk=query_chunk)
    return _core(q, k, v, bias, mask, None, spec)


def _check_broadcast(a, shape, who: str, arg: str):
    try:
        out = jnp.broadcast_shapes(a.shape, tuple(shape))
    except ValueError:
        out = None
    if out != tuple(shape):
        raise ValueError(f"{who}: {arg} of shape {a.shape} must broadcast to the scores' "
                         f"shape (..., H, T, S) = {tuple(shape)}")
