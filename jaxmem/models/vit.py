"""Vision Transformer (Dosovitskiy et al. 2021), tiny by default, NHWC images.

``patch_embed`` Conv(p x p, stride p, bias) -> tokens (row-major over the patch grid) ->
prepend ``cls_token`` (1, 1, d) -> add ``pos_embed`` (1, 1 + n_patches, d) -> ``n_layer``
pre-LN encoder blocks ``blocks_0 ..`` (non-causal :class:`~jaxmem.models.transformer.Block`,
exact GELU called inline) -> ``ln_f`` -> ``head`` Dense on the cls token. No dropout.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ._common import check_channels
from .transformer import Block, layer_norm


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT hyper-parameters (ViT-Ti/16 on 224 images: d_model 192, n_head 3, n_layer 12)."""

    image_size: int = 32
    patch_size: int = 4
    in_channels: int = 3
    d_model: int = 192
    n_head: int = 3
    n_layer: int = 12
    mlp_ratio: int = 4
    num_classes: int = 10
    gelu_approximate: bool = False

    def __post_init__(self):
        for f in ("image_size", "patch_size", "in_channels", "d_model", "n_head", "n_layer",
                  "mlp_ratio", "num_classes"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"ViTConfig: {f} must be an int >= 1, got {v!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig: image_size={self.image_size} must be divisible by "
                             f"patch_size={self.patch_size}")
        if self.d_model % self.n_head:
            raise ValueError(f"ViTConfig: d_model={self.d_model} must be divisible by "
                             f"n_head={self.n_head}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nn.Module):
    """ViT encoder + classification head. Call ``model.apply(variables, images)`` with
    ``images`` NHWC ``(N, image_size, image_size, in_channels)``; returns ``(N, num_classes)``."""

    config: ViTConfig = ViTConfig()
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        check_channels(x, cfg.in_channels, "ViT")
        if x.shape[1:3] != (cfg.image_size, cfg.image_size):
            raise ValueError(f"ViT: images must be {cfg.image_size}x{cfg.image_size}, got "
                             f"{x.shape[1]}x{x.shape[2]}")
        p, d = cfg.patch_size, cfg.d_model
        x = nn.Conv(d, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                    name="patch_embed")(x)
        n = x.shape[0]
        x = x.reshape(n, -1, d)
        cls = self.param("cls_token", nn.initializers.normal(0.02), (1, 1, d))
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, cfg.n_patches + 1, d))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (n, 1, d)), x], axis=1)
        x = x + pos.astype(x.dtype)
        for i in range(cfg.n_layer):
            x = Block(cfg.n_head, cfg.mlp_ratio, False, cfg.gelu_approximate, True, self.dtype,
                      name=f"blocks_{i}")(x)
        x = layer_norm("ln_f", self.dtype)(x)
        return nn.Dense(cfg.num_classes, dtype=self.dtype, name="head")(x[:, 0])


def vit_tiny(*, image_size: int = 32, patch_size: int = 4, in_channels: int = 3,
             num_classes: int = 10, n_layer: int = 12, dtype: Any = None) -> ViT:
    """ViT-Tiny widths (d_model 192, 3 heads, MLP 768) for small images."""
    return ViT(ViTConfig(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                         num_classes=num_classes, n_layer=n_layer), dtype)


__all__ = ["ViT", "ViTConfig", "vit_tiny"]
