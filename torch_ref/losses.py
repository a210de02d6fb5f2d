"""PyTorch reference of :func:`jaxmem.losses.chunked_softmax_cross_entropy`.

``chunked_cross_entropy(h, w, y, bias=None, chunk_size=1024)``: per-token
``F.cross_entropy(h @ w + bias, y, reduction="none")``, ``chunk_size`` tokens at a time, each
chunk under ``torch.utils.checkpoint`` (non-reentrant): autograd saves each chunk's inputs,
not its ``chunk_size x vocab`` logits, and forms them again in the backward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def _chunk_losses(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    z = hc @ w
    if bias is not None:
        z = z + bias
    return F.cross_entropy(z, yc, reduction="none")


def chunked_cross_entropy(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                          bias: torch.Tensor | None = None,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Per-token losses, shape ``h.shape[:-1]`` (``h``: ``(..., d)``, ``w``: ``(d, vocab)``,
    ``y``: integer ``h.shape[:-1]``)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: `chunk_size` must be an int >= 1, got "
                         f"{chunk_size!r}")
    lead = h.shape[:-1]
    hf, yf = h.reshape(-1, h.shape[-1]), y.reshape(-1).long()
    parts = [checkpoint(_chunk_losses, hf[i:i + chunk_size], w, yf[i:i + chunk_size], bias,
                        use_reentrant=False)
             for i in range(0, hf.shape[0], chunk_size)]
    return torch.cat(parts).reshape(lead) if parts else h.new_zeros(lead)
