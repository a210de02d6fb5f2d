"""Torch twin of ``jaxmem.models.ViT`` (NCHW; names ``patch_embed, cls_token, pos_embed,
blocks_i, ln_f, head``)."""
from __future__ import annotations

import torch
from torch import nn

from jaxmem.models.vit import ViTConfig  # plain dataclass, no JAX computation

from ._common import check_channels
from .transformer import Block, layer_norm


class ViT(nn.Module):
    def __init__(self, config: ViTConfig | None = None):
        super().__init__()
        self.config = cfg = config if config is not None else ViTConfig()
        d = cfg.d_model
        self.patch_embed = nn.Conv2d(cfg.in_channels, d, cfg.patch_size, cfg.patch_size, 0)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.n_patches + 1, d) * 0.02)
        for i in range(cfg.n_layer):
            setattr(self, f"blocks_{i}", Block(d, cfg.n_head, cfg.mlp_ratio, False,
                                               cfg.gelu_approximate, True))
        self.ln_f = layer_norm(d)
        self.head = nn.Linear(d, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        check_channels(x, cfg.in_channels, "ViT")
        x = self.patch_embed(x)  # (N, d, h, w)
        n = x.shape[0]
        x = x.flatten(2).transpose(1, 2)  # (N, h*w, d), row-major over the grid
        x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1) + self.pos_embed
        for i in range(cfg.n_layer):
            x = getattr(self, f"blocks_{i}")(x)
        return self.head(self.ln_f(x)[:, 0])


def vit_tiny(*, image_size: int = 32, patch_size: int = 4, in_channels: int = 3,
             num_classes: int = 10, n_layer: int = 12) -> ViT:
    return ViT(ViTConfig(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                         num_classes=num_classes, n_layer=n_layer))
