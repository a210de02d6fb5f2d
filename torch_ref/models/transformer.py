"""Torch twins of ``jaxmem.models.transformer`` (pre-LN block, fused-qkv attention, GELU MLP).

Attention is written out (no ``F.scaled_dot_product_attention``) so both frameworks compute
the same thing and save the same tensors: scores ``q k^T / sqrt(d_head)``, causal positions
filled with the dtype's most negative finite value, softmax, ``@ v``.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def layer_norm(d: int) -> nn.LayerNorm:
    return nn.LayerNorm(d, eps=1e-5)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, causal: bool = False, bias: bool = True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"SelfAttention: d_model={d_model} is not divisible by n_head={n_head}")
        self.n_head, self.causal = n_head, causal
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=-1)
        q = q.reshape(b, t, self.n_head, hd).transpose(1, 2)
        k = k.reshape(b, t, self.n_head, hd).transpose(1, 2)
        v = v.reshape(b, t, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y)


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int, gelu_approximate: bool = False, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, hidden, bias=bias)
        self.gelu = nn.GELU(approximate="tanh" if gelu_approximate else "none")
        self.c_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, mlp_ratio: int = 4, causal: bool = False,
                 gelu_approximate: bool = False, bias: bool = True):
        super().__init__()
        self.ln_1 = layer_norm(d_model)
        self.attn = SelfAttention(d_model, n_head, causal, bias)
        self.ln_2 = layer_norm(d_model)
        self.mlp = MLPBlock(d_model, mlp_ratio * d_model, gelu_approximate, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
