"""Pre-LayerNorm transformer pieces shared by :mod:`.gpt` and :mod:`.vit`.

Block(x) = x + Attn(LN_1(x)); then x + MLP(LN_2(x)), with

* ``SelfAttention``: ``c_attn`` Dense(d -> 3d) gives q, k, v (in that order along the last
  axis), split into ``n_head`` heads of ``d / n_head``; ``softmax(q k^T / sqrt(d_head) [+ causal
  mask]) v``; heads concatenated; ``c_proj`` Dense(d -> d). The causal mask sets future scores
  to the dtype's most negative finite value (not -inf) before the softmax.
* ``MLPBlock``: ``c_fc`` Dense(d -> r d) -> ``nn.gelu(x, approximate=...)`` (inline) ->
  ``c_proj`` Dense(r d -> d).

LayerNorms are ``ln_1``, ``ln_2`` with torch's epsilon 1e-5 and the two-pass variance
(``use_fast_variance=False``). No dropout. Sequences are ``(batch, time, d_model)``.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


def layer_norm(name: str, dtype: Any = None) -> nn.LayerNorm:
    """LayerNorm with torch semantics (eps 1e-5, two-pass variance)."""
    return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, dtype=dtype, name=name)


class SelfAttention(nn.Module):
    """Multi-head self-attention with fused ``c_attn`` and output ``c_proj``."""

    n_head: int
    causal: bool = False
    use_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        if d % self.n_head:
            raise ValueError(f"SelfAttention: d_model={d} is not divisible by n_head={self.n_head}")
        hd = d // self.n_head
        qkv = nn.Dense(3 * d, use_bias=self.use_bias, dtype=self.dtype, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q = q.reshape(b, t, self.n_head, hd)
        k = k.reshape(b, t, self.n_head, hd)
        v = v.reshape(b, t, self.n_head, hd)
        att = jnp.einsum("bthd,bshd->bhts", q, k) * (1.0 / math.sqrt(hd))
        if self.causal:
            mask = jnp.tril(jnp.ones((t, t), dtype=bool))
            att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
        att = nn.softmax(att, axis=-1)
        y = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d)
        return nn.Dense(d, use_bias=self.use_bias, dtype=self.dtype, name="c_proj")(y)


class MLPBlock(nn.Module):
    """``c_fc`` -> GELU (inline ``nn.gelu``) -> ``c_proj``."""

    hidden: int
    gelu_approximate: bool = False
    use_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.Dense(self.hidden, use_bias=self.use_bias, dtype=self.dtype, name="c_fc")(x)
        h = nn.gelu(h, approximate=self.gelu_approximate)
        return nn.Dense(d, use_bias=self.use_bias, dtype=self.dtype, name="c_proj")(h)


class Block(nn.Module):
    """Pre-LN transformer block: ``ln_1, attn, ln_2, mlp``."""

    n_head: int
    mlp_ratio: int = 4
    causal: bool = False
    gelu_approximate: bool = False
    use_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = x + SelfAttention(self.n_head, self.causal, self.use_bias, self.dtype, name="attn")(
            layer_norm("ln_1", self.dtype)(x))
        x = x + MLPBlock(self.mlp_ratio * d, self.gelu_approximate, self.use_bias, self.dtype,
                         name="mlp")(layer_norm("ln_2", self.dtype)(x))
        return x
