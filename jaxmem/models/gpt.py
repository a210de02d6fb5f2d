"""GPT-2-style decoder (Radford et al. 2019) with a tied LM head.

``logits = LN_f(h_{L-1}(... h_0(wte[tokens] + wpe[positions]))) @ wte^T``: token embedding
``wte`` (vocab, d), learned position embedding ``wpe`` (ctx, d), ``n_layer`` pre-LN blocks
``h_0 ..`` (causal :class:`~jaxmem.models.transformer.Block`, GELU called inline as
``nn.gelu(x, approximate=config.gelu_approximate)``; GPT-2 uses the tanh approximation), final
``ln_f``, and the head ``wte.attend`` (weights tied to ``wte``: no separate head parameter).
No dropout.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .transformer import Block, layer_norm


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters. Defaults are a tiny CPU-sized model (GPT-2 small: vocab 50257,
    ctx 1024, d_model 768, n_head 12, n_layer 12)."""

    vocab: int = 256
    ctx: int = 64
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2
    mlp_ratio: int = 4
    gelu_approximate: bool = True
    bias: bool = True

    def __post_init__(self):
        for f in ("vocab", "ctx", "d_model", "n_head", "n_layer", "mlp_ratio"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"GPTConfig: {f} must be an int >= 1, got {v!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be divisible by "
                             f"n_head={self.n_head}")


class GPT(nn.Module):
    """GPT-2-style decoder. Call ``model.apply(variables, tokens)`` with int ``tokens`` of shape
    ``(batch, time)``, ``time <= config.ctx``; returns logits ``(batch, time, vocab)``."""

    config: GPTConfig = GPTConfig()
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens, features: bool = False):
        """Logits ``(batch, time, vocab)``; with ``features=True`` the final norm's output
        ``(batch, time, d_model)`` instead (the head's input: e.g. for
        :func:`jaxmem.losses.chunked_softmax_cross_entropy` with ``wte.embedding.T``)."""
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"GPT: tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"GPT: tokens must be integers, got dtype {tokens.dtype}")
        t = tokens.shape[1]
        if t > cfg.ctx:
            raise ValueError(f"GPT: sequence length {t} exceeds config.ctx={cfg.ctx}")
        emb_init = nn.initializers.normal(0.02)
        wte = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=emb_init, dtype=self.dtype,
                       name="wte")
        wpe = nn.Embed(cfg.ctx, cfg.d_model, embedding_init=emb_init, dtype=self.dtype,
                       name="wpe")
        x = wte(tokens) + wpe(jnp.arange(t))[None]
        for i in range(cfg.n_layer):
            x = Block(cfg.n_head, cfg.mlp_ratio, True, cfg.gelu_approximate, cfg.bias,
                      self.dtype, name=f"h_{i}")(x)
        x = layer_norm("ln_f", self.dtype)(x)
        return x if features else wte.attend(x)


def gpt(config: GPTConfig | None = None, **overrides) -> GPT:
    """``GPT(GPTConfig(**overrides))``, e.g. ``gpt(n_layer=4, d_model=128)``."""
    base = config if config is not None else GPTConfig()
    return GPT(dataclasses.replace(base, **overrides))


__all__ = ["GPT", "GPTConfig", "gpt"]
