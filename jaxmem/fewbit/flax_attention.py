"""Flax's dot-product attention computed by jaxmem's exact memory-efficient core.

Drop-ins with the signatures of Flax's functions (layout ``[batch..., length, heads,
head_dim]``); the forward is Flax's arithmetic step for step, the gradient the exact
derivative of it, and autodiff keeps no ``T x S`` array (see
:func:`jaxmem.selective.attention.attention_core`):

* :func:`dot_product_attention` -- ``flax.linen.dot_product_attention``:
  ``softmax((q / sqrt(D)) k^T + bias, masked with finfo.min) [* dropout] v``;
* :func:`nnx_dot_product_attention` -- ``flax.nnx.dot_product_attention``: without
  dropout and ``module`` it is ``jax.nn.dot_product_attention`` (float32 logits,
  ``q k^T / sqrt(D)``, fill ``-0.7 * max``, float32 softmax), otherwise the Linen
  arithmetic above (``is_causal`` adds the ``tril(T, S)`` mask).

Attention dropout: the keep mask is ``bernoulli(dropout_rng, 1 - rate, shape)`` with Flax's
exact call and shape (``(1,) * (key.ndim - 2) + (T, S)`` when ``broadcast_dropout``); only the
key is stored and the mask is regenerated in the backward pass.

A fully masked query row has uniform weights ``1 / S`` (its scores all equal the fill value),
``dq = 0`` and no ``dk`` contribution, as in Flax and JAX.

What cannot be reproduced exactly runs Flax's own function (a *fallback*): ``module=`` (sowing the weights), custom einsums
(``einsum_dot_general``, ``qk_attn_weights_einsum``, ``attn_weights_value_einsum``),
grouped-query attention (nnx, query heads != key heads), non-float inputs, non-concrete
``deterministic`` / ``dropout_rate``, and dropout without a ``dropout_rng``.

Pass either as a module's ``attention_fn``; :func:`jaxmem.transform` (and the Flax
conversions over it) finds attention by what it computes, whichever function computes it.
"""
from __future__ import annotations

import inspect
import numbers

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen.dtypes import promote_dtype as _linen_promote
from flax.nnx.nn import dtypes as _nnx_dtypes

from jaxmem.selective.attention import AttentionSpec, attention_core

__all__ = ["dot_product_attention", "nnx_dot_product_attention"]

# Flax's own functions, taken from the modules' field defaults (never a patched attribute)
FLAX_LINEN_ATTENTION = nn.MultiHeadDotProductAttention.__dataclass_fields__[
    "attention_fn"].default
FLAX_NNX_ATTENTION = inspect.signature(nnx.MultiHeadAttention.__init__).parameters[
    "attention_fn"].default



# ------------------------------------------------------------------------------ checks

def _float_inputs(*arrays) -> bool:
    return all(jnp.issubdtype(a.dtype, jnp.floating) for a in arrays)


def _check_shapes(query, key, value, who: str):
    if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
        raise ValueError(f"{who}: query, key, value must have the same rank >= 3 "
                         f"([batch..., length, heads, head_dim]), got shapes {query.shape}, "
                         f"{key.shape}, {value.shape}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"{who}: query, key, value batch dims must match, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{who}: query and key head_dim must match, got {query.shape[-1]} "
                         f"and {key.shape[-1]}")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"{who}: key and value lengths must match, got {key.shape[-3]} "
                         f"and {value.shape[-3]}")


def _dropout_active(deterministic, dropout_rate):
    """``(active, reason)``; reason is set when the flags are not concrete Python values."""
    if isinstance(deterministic, jax.core.Tracer) or isinstance(dropout_rate,
                                                                jax.core.Tracer):
        return None, "traced deterministic= or dropout_rate="
    if not isinstance(dropout_rate, numbers.Real):
        return None, f"dropout_rate={dropout_rate!r} is not a Python number"
    return (not deterministic) and dropout_rate > 0.0, None


def _as_mask(mask):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask.astype(jnp.bool_)


def _dtype_name(d):
    return jnp.dtype(d).name


# ------------------------------------------------------------------------------- linen

def _linen_attend(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                  dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                  precision=None, module=None, force_fp32_for_softmax=False,
                  einsum_dot_general=None, qk_attn_weights_einsum=None,
                  attn_weights_value_einsum=None):
    """``(output, fallback_reason or None)`` for Flax Linen's ``dot_product_attention``."""
    args = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, force_fp32_for_softmax,
            einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)

    def flax(reason):
        return FLAX_LINEN_ATTENTION(*args), reason

    if module is not None:
        return flax("module= (sows the attention weights)")
    if einsum_dot_general is not None or qk_attn_weights_einsum is not None \
            or attn_weights_value_einsum is not None:
        return flax("custom einsum (einsum_dot_general / qk_attn_weights_einsum / "
                    "attn_weights_value_einsum)")
    active, reason = _dropout_active(deterministic, dropout_rate)
    if reason:
        return flax(reason)
    if active and dropout_rng is None:
        return flax("dropout without dropout_rng")
    query, key, value = _linen_promote(query, key, value, dtype=dtype)
    if not _float_inputs(query, key, value):
        return flax(f"non-float inputs ({query.dtype})")
    _check_shapes(query, key, value, "dot_product_attention")
    if query.shape[-2] != key.shape[-2] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"dot_product_attention: query, key, value num_heads must match, "
                         f"got {query.shape[-2]}, {key.shape[-2]}, {value.shape[-2]}")
    dtype = query.dtype
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    fp32 = bool(force_fp32_for_softmax) and dtype != jnp.float32
    spec = AttentionSpec(
        scale=None, fill="min", causal=None,
        softmax_dtype="float32" if fp32 else None,
        weights_dtype=None if fp32 else _dtype_name(dtype),
        dropout_rate=float(dropout_rate) if active else 0.0,
        broadcast_dropout=bool(broadcast_dropout),
        qk_precision=precision, pv_precision=precision)
    bias = None if bias is None else jnp.asarray(bias)
    out = attention_core(query, key, value, bias=bias, mask=_as_mask(mask),
                         rng=dropout_rng if active else None, spec=spec)
    return out, None


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False,
                          dtype=None, precision=None, module=None,
                          force_fp32_for_softmax=False, einsum_dot_general=None,
                          qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    """Drop-in for ``flax.linen.dot_product_attention`` (same signature, same forward).

    ``w = softmax((query / sqrt(D)) key^T + bias, masked -> finfo(dtype).min)`` (float32
    softmax with ``force_fp32_for_softmax``), ``w *= bernoulli(dropout_rng, 1 - rate) /
    (1 - rate)`` when ``not deterministic and dropout_rate > 0``, output ``w value``.
    Exact gradients for query, key, value and bias; no ``T x S`` residual (the dropout
    mask is regenerated from ``dropout_rng``).  Unsupported arguments run Flax's function.
    """
    out, reason = _linen_attend(query, key, value, bias, mask, broadcast_dropout,
                                dropout_rng, dropout_rate, deterministic, dtype, precision,
                                module, force_fp32_for_softmax, einsum_dot_general,
                                qk_attn_weights_einsum, attn_weights_value_einsum)
    return out


# --------------------------------------------------------------------------------- nnx

def _jax_qk_precision(dtype):
    """``jax.nn.dot_product_attention``'s choice for the ``q k^T`` product."""
    if dtype == jnp.bfloat16:
        return jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    if dtype == jnp.float16:
        return jax.lax.DotAlgorithmPreset.F16_F16_F32
    return None


def _nnx_attend(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                precision=None, module=None, promote_dtype=_nnx_dtypes.promote_dtype,
                is_causal=False):
    """``(output, fallback_reason or None)`` for ``flax.nnx.dot_product_attention``."""
    args = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, promote_dtype, is_causal)

    def flax(reason):
        return FLAX_NNX_ATTENTION(*args), reason

    if module is not None:
        return flax("module= (sows the attention weights)")
    active, reason = _dropout_active(deterministic, dropout_rate)
    if reason:
        return flax(reason)
    if active and dropout_rng is None:
        return flax("dropout without dropout_rng")
    if not isinstance(is_causal, bool):
        return flax(f"is_causal={is_causal!r} is not a Python bool")
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if not _float_inputs(query, key, value):
        return flax(f"non-float inputs ({query.dtype})")
    _check_shapes(query, key, value, "nnx_dot_product_attention")
    if query.shape[-2] != key.shape[-2] or key.shape[-2] != value.shape[-2]:
        return flax("grouped-query attention (query heads != key/value heads)")
    causal = "top_left" if is_causal else None
    bias = None if bias is None else jnp.asarray(bias)
    if dropout_rate == 0.0:
        # Flax calls jax.nn.dot_product_attention (its XLA implementation) here
        d = query.shape[-1]
        spec = AttentionSpec(
            scale=float(1.0 / np.sqrt(d)),
            logits_dtype=_dtype_name(jnp.promote_types(query.dtype, jnp.float32)),
            fill="large", causal=causal, softmax_dtype="float32",
            weights_dtype=_dtype_name(key.dtype),
            qk_precision=_jax_qk_precision(query.dtype), pv_precision=None)
        return attention_core(query, key, value, bias=bias, mask=_as_mask(mask),
                              spec=spec), None
    dtype = query.dtype
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    spec = AttentionSpec(
        scale=None, fill="min", causal=causal, weights_dtype=_dtype_name(dtype),
        dropout_rate=float(dropout_rate) if active else 0.0,
        broadcast_dropout=bool(broadcast_dropout),
        qk_precision=precision, pv_precision=precision)
    out = attention_core(query, key, value, bias=bias, mask=_as_mask(mask),
                         rng=dropout_rng if active else None, spec=spec)
    return out, None


def nnx_dot_product_attention(query, key, value, bias=None, mask=None,
                              broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
                              deterministic=False, dtype=None, precision=None, module=None,
                              promote_dtype=_nnx_dtypes.promote_dtype, is_causal=False):
    """Drop-in for ``flax.nnx.dot_product_attention`` (same signature, same forward).

    ``dropout_rate == 0`` (and no ``module``): ``jax.nn.dot_product_attention``'s arithmetic,
    ``softmax_f32(q k^T / sqrt(D) + bias, masked -> -0.7 * max)`` then ``w v``; otherwise
    Flax's weights path ``softmax((q / sqrt(D)) k^T + bias, masked -> finfo.min)`` with
    attention dropout when ``not deterministic``.  ``is_causal`` masks key ``j > i``.
    Exact gradients; no ``T x S`` residual.  Unsupported arguments run Flax's function.
    """
    out, reason = _nnx_attend(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                              dropout_rate, deterministic, dtype, precision, module,
                              promote_dtype, is_causal)
    return out
