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
* :func:`attention` -- ``softmax(q k^T * scale [+ causal mask]) v`` with a flash-style
  backward: it stores ``q, k, v`` and the per-row log-sum-exp, and recomputes the
  probabilities in the backward pass (``P = exp(S - lse)``); nothing ``T x T`` survives
  the forward pass.  Costs one extra ``k q^T`` product in the backward pass.
* :func:`patch_attention` -- runs :class:`jaxmem.models.SelfAttention` (GPT, ViT of the
  model zoo) with :func:`attention` while tracing inside the context.
* :func:`patch_softmax` -- scoped, restorable switch of ``jax.nn.softmax`` /
  ``flax.linen.softmax`` / ``flax.nnx.softmax`` to :func:`softmax` (models that call the
  softmax inline, like :class:`jaxmem.models.GPT`), in the style of
  :func:`jaxmem.fewbit.patch_activations`.

Recomputations in a backward pass carry a data dependency on the incoming cotangent
(``_after``) so XLA cannot hoist them into the forward pass and keep their result alive
(the same trick :mod:`jaxmem.selective.norm` documents; ``lax.optimization_barrier`` is
dropped by the CPU pipeline -- measured).  Every claim is checked with the compiled-bytes
slope in ``parity_tests/fewbit/test_fewbit_attention.py``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

__all__ = ["SOFTMAX_MODULES", "attention", "patch_attention", "patch_softmax", "softmax"]

#: modules whose ``softmax`` attribute :func:`patch_softmax` replaces
SOFTMAX_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                   "flax.nnx.nn.activations")

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


def _after(g, dtype):
    """A scalar zero of ``dtype`` that data-depends on ``g`` (keeps recomputation in bwd).

    ``where(isfinite(g0), g0, 0) * 0`` is 0 also when ``g0`` is inf/NaN (so a non-finite
    cotangent element does not leak into unrelated gradients); XLA does not fold ``x * 0``
    for floats, so the dependency survives.
    """
    first = (jax.lax.reshape(g, (g.size,))[:1] if g.ndim else g.reshape(1))[0]
    return (jnp.where(jnp.isfinite(first), first, jnp.zeros_like(first)) * 0).astype(dtype)


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


def softmax(x, axis: int | Sequence[int] | None = -1, where=None):
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

def _scores(qt, kt, scale, causal: bool):
    """``qt: (..., H, T, D)``, ``kt: (..., H, S, D)`` -> masked scores ``(..., H, T, S)``."""
    s = jnp.einsum("...htd,...hsd->...hts", qt, kt) * jnp.asarray(scale, qt.dtype)
    if causal:
        t, s_len = s.shape[-2], s.shape[-1]
        keep = jnp.tril(jnp.ones((t, s_len), bool), k=s_len - t)
        s = jnp.where(keep, s, jnp.finfo(s.dtype).min)
    return s


def _heads_first(a):
    return jnp.swapaxes(a, -3, -2)  # (..., T, H, D) <-> (..., H, T, D)


def _attn_forward(q, k, v, scale, causal):
    qt, kt, vt = _heads_first(q), _heads_first(k), _heads_first(v)
    s = _scores(qt, kt, scale, causal)
    p = _ORIG_SOFTMAX(s, axis=-1)
    o = _heads_first(jnp.einsum("...hts,...hsd->...htd", p, vt))
    sf = s.astype(_stat_dtype(s.dtype))
    m = jnp.max(sf, axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(sf - m), axis=-1, keepdims=True))
    return o, lse, (qt, kt, vt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, scale, causal):
    return _attn_forward(q, k, v, scale, causal)[0]


def _attention_fwd(q, k, v, scale, causal):
    o, lse, _ = _attn_forward(q, k, v, scale, causal)
    return o, (q, k, v, lse)


def _attention_bwd(scale, causal, res, do):
    # * every residual enters through ``+ z`` (a zero that depends on ``do``), so nothing
    #   below can be scheduled into the forward pass; XLA fuses ``q + z`` with q's producer,
    #   i.e. it keeps the caller's array (e.g. the fused qkv product) and no extra copy;
    # * the scores are recomputed transposed, ``k q^T`` (..., H, S, T);
    # * ``rowsum(do * o) == rowsum(P * dP)``, so the output is not needed.
    q, k, v, lse = res
    z = _after(do, q.dtype)
    qt, kt, vt = _heads_first(q + z), _heads_first(k + z), _heads_first(v + z)
    lse_t = jnp.swapaxes(lse, -1, -2)                               # (..., H, 1, T)
    st = jnp.einsum("...hsd,...htd->...hst", kt, qt) * jnp.asarray(scale, qt.dtype)
    if causal:
        s_len, t = st.shape[-2], st.shape[-1]
        keep_t = jnp.tril(jnp.ones((t, s_len), bool), k=s_len - t).T
        st = jnp.where(keep_t, st, jnp.finfo(st.dtype).min)
    pt = jnp.exp(st.astype(lse_t.dtype) - lse_t).astype(qt.dtype)  # P^T, recomputed
    dot = _heads_first(do)
    dv = jnp.einsum("...hst,...htd->...hsd", pt, dot)
    dpt = jnp.einsum("...hsd,...htd->...hst", vt, dot)
    delta_t = jnp.sum(pt * dpt, axis=-2, keepdims=True)              # (..., H, 1, T)
    dst = pt * (dpt - delta_t) * jnp.asarray(scale, qt.dtype)
    dq = jnp.einsum("...hst,...hsd->...htd", dst, kt)
    dk = jnp.einsum("...hst,...htd->...hsd", dst, qt)
    return _heads_first(dq), _heads_first(dk), _heads_first(dv)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Exact dot-product attention ``softmax(q k^T * scale [+ causal mask]) v``.

    Shapes ``q: (..., T, H, D)``, ``k, v: (..., S, H, D)`` (the ``"bthd"`` layout of
    :class:`jaxmem.models.SelfAttention`); returns ``(..., T, H, D)``.  ``scale`` defaults to
    ``1 / sqrt(D)``.  ``causal=True`` masks key ``j > i + (S - T)`` with the dtype's most
    negative finite value before the softmax (like the model zoo).

    Backward (flash-style, exact): stores ``q, k, v`` and a float32 log-sum-exp per row
    (float64 for float64 inputs); recomputes ``P = exp(S - lse)`` and returns
    ``dv = P^T do``, ``dP = do v^T``, ``ds = P * (dP - rowsum(P * dP)) * scale``
    (``rowsum(P * dP) == rowsum(do * o)``, so the output is not stored), ``dq = ds k``,
    ``dk = ds^T q``.  Nothing of size ``T x S`` is kept between forward and backward.
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
        scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{who}: scale must be a Python float or None, got {scale!r}")
    return _attention(q, k, v, float(scale), causal)


# ------------------------------------------------------------------------------ patch

def _patched_softmax(x, axis=-1, where=None, **kw):
    if kw or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return _ORIG_SOFTMAX(x, axis=axis, where=where, **kw)
    return softmax(x, axis=axis, where=where)


_patched_softmax.__wrapped__ = _ORIG_SOFTMAX


@contextlib.contextmanager
def patch_softmax(modules: Sequence[str] = SOFTMAX_MODULES) -> Iterator[dict]:
    """Temporarily replace ``softmax`` in ``jax.nn`` / ``flax.linen`` / ``flax.nnx`` by
    :func:`softmax` (exact; backward stores only the output).

    Same rules as :func:`jaxmem.fewbit.patch_activations`: wrap the *tracing*; only look-ups
    through the module (``nn.softmax(x)``) are redirected; everything is restored on exit.
    Yields ``{"module.softmax": replacement}``.
    """
    saved, patched = [], {}
    try:
        for modname in modules:
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
            cur = getattr(mod, "softmax", None)
            if cur is _ORIG_SOFTMAX or cur is _patched_softmax:
                saved.append((mod, cur))
                mod.softmax = _patched_softmax
                patched[f"{modname}.softmax"] = _patched_softmax
        yield patched
    finally:
        for mod, cur in reversed(saved):
            mod.softmax = cur


# --------------------------------------------------------------- Linen model-zoo switch

def _dense(x, params, dtype):
    """``flax.linen.Dense`` arithmetic (promote, dot over the last axis, + bias)."""
    from flax.linen.dtypes import promote_dtype
    kernel, bias = params["kernel"], params.get("bias")
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def _zoo_attention(m, x):
    b, t, d = x.shape
    if d % m.n_head:
        raise ValueError(f"SelfAttention: d_model={d} is not divisible by n_head={m.n_head}")
    p = m.variables["params"]
    hd = d // m.n_head
    qkv = _dense(x, p["c_attn"], m.dtype)
    q, k, v = (a.reshape(b, t, m.n_head, hd) for a in jnp.split(qkv, 3, axis=-1))
    y = attention(q, k, v, causal=bool(m.causal), scale=1.0 / math.sqrt(hd))
    return _dense(y.reshape(b, t, d), p["c_proj"], m.dtype)


@contextlib.contextmanager
def patch_attention() -> Iterator[None]:
    """Run :class:`jaxmem.models.SelfAttention` (GPT, ViT of the model zoo) with
    :func:`attention` while tracing inside the context.

    A Flax method interceptor: each ``SelfAttention.__call__`` (outside ``init``) is computed
    from the module's own ``c_attn`` / ``c_proj`` parameters with the same arithmetic
    (``flax.linen.Dense``'s promote-dot-bias, the same split, scale and causal mask), so the
    forward is the model's and the gradient is exact; only the attention matrix is not
    stored.  Parameters and their tree are untouched.  Other attention modules are left
    alone (call :func:`attention` in them directly).  Wrap the tracing, like
    :func:`jaxmem.fewbit.patch_activations`.
    """
    import flax.linen as nn

    from jaxmem.models.transformer import SelfAttention

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if (type(m) is not SelfAttention or context.method_name != "__call__"
                or m.is_initializing() or kwargs or len(args) != 1):
            return next_fun(*args, **kwargs)
        return _zoo_attention(m, args[0])

    with nn.intercept_methods(interceptor):
        yield
