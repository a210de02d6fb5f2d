"""Torch twin of ``jaxmem.models.GPT`` (same config, same names ``wte, wpe, h_i, ln_f``;
the head reuses ``wte.weight``)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from jaxmem.models.gpt import GPTConfig  # plain dataclass, no JAX computation

from .transformer import Block, layer_norm


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = cfg = config if config is not None else GPTConfig()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.ctx, cfg.d_model)
        for i in range(cfg.n_layer):
            setattr(self, f"h_{i}", Block(cfg.d_model, cfg.n_head, cfg.mlp_ratio, True,
                                          cfg.gelu_approximate, cfg.bias))
        self.ln_f = layer_norm(cfg.d_model)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, 0.02)
            self.wpe.weight.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"GPT: tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.config.ctx:
            raise ValueError(f"GPT: sequence length {t} exceeds config.ctx={self.config.ctx}")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))[None]
        for i in range(self.config.n_layer):
            x = getattr(self, f"h_{i}")(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def gpt(config: GPTConfig | None = None, **overrides) -> GPT:
    base = config if config is not None else GPTConfig()
    return GPT(dataclasses.replace(base, **overrides))
