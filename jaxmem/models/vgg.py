"""VGG-style conv stack (NHWC) with a width multiplier, optional BatchNorm and a small head.

``cfg`` lists the trunk: an int ``c`` is ``Conv 3x3 (padding 1, bias) -> [BatchNorm] -> ReLU``
with ``round(c * width)`` output channels, ``'M'`` is a 2x2 max-pool with stride 2. Convs are
numbered ``conv_0, conv_1, ...`` (BatchNorms ``bn_0, ...`` alongside) inside the submodule
``features`` (:class:`VGGFeatures`, usable alone). The head is a global average pool over the
spatial axes (so any input size >= 2**#pools works and no NHWC/NCHW flatten-order permutation is
needed), then ``fc_0 .. fc_{k-1}`` Dense layers of widths ``hidden`` with ReLU, then ``fc_k``
to ``num_classes``. No dropout (deterministic, so frameworks compare exactly).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ._common import scaled
from .batchnorm import TorchBatchNorm

VGG_CFGS: dict[str, tuple] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}


def check_cfg(cfg) -> None:
    for item in cfg:
        if not (item == "M" or (isinstance(item, int) and item > 0)):
            raise ValueError(f"VGG cfg entries must be positive ints or 'M', got {item!r} in {cfg!r}")


class VGGFeatures(nn.Module):
    """The VGG conv trunk alone. Call ``(x, train=False)``; ``x`` NHWC.

    ``train`` only matters with ``batch_norm=True`` (then apply with
    ``mutable=['batch_stats']`` in training).
    """

    cfg: Sequence[Any] = VGG_CFGS["vgg16"]
    width: float = 1.0
    batch_norm: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        check_cfg(self.cfg)
        if x.ndim != 4:
            raise ValueError(f"VGGFeatures: input must be NHWC (4-D), got shape {tuple(x.shape)}")
        i = 0
        for item in self.cfg:
            if item == "M":
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
                continue
            x = nn.Conv(scaled(item, self.width), (3, 3), padding=((1, 1), (1, 1)),
                        use_bias=True, dtype=self.dtype, name=f"conv_{i}")(x)
            if self.batch_norm:
                x = TorchBatchNorm(dtype=self.dtype, name=f"bn_{i}")(x, train)
            x = nn.relu(x)
            i += 1
        return x


class VGG(nn.Module):
    """VGG: ``features`` trunk -> global average pool -> ``fc_*`` head.

    Attributes:
      cfg: trunk layout (ints and ``'M'``), e.g. ``VGG_CFGS['vgg16']``.
      width: channel multiplier for the trunk and the hidden head layers.
      batch_norm: :class:`TorchBatchNorm` (torch-exact BatchNorm) after every conv.
      num_classes: output size.
      hidden: widths of the hidden head layers before scaling by ``width`` (default (512,)).
      dtype: computation dtype.
    """

    cfg: Sequence[Any] = VGG_CFGS["vgg16"]
    width: float = 1.0
    batch_norm: bool = False
    num_classes: int = 10
    hidden: Sequence[int] = (512,)
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = VGGFeatures(self.cfg, self.width, self.batch_norm, self.dtype, name="features")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        for j, h in enumerate(self.hidden):
            x = nn.Dense(scaled(h, self.width), dtype=self.dtype, name=f"fc_{j}")(x)
            x = nn.relu(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, name=f"fc_{len(self.hidden)}")(x)


def vgg(name: str = "vgg16", *, width: float = 1.0, batch_norm: bool = False,
        num_classes: int = 10, hidden: Sequence[int] = (512,), dtype: Any = None) -> VGG:
    """VGG from a named cfg (``'vgg11' | 'vgg13' | 'vgg16' | 'vgg19'``)."""
    if name not in VGG_CFGS:
        raise ValueError(f"vgg: name must be one of {sorted(VGG_CFGS)}, got {name!r}")
    return VGG(VGG_CFGS[name], width, batch_norm, num_classes, tuple(hidden), dtype)


def vgg11(*, width: float = 1.0, batch_norm: bool = False, num_classes: int = 10,
          hidden: Sequence[int] = (512,), dtype: Any = None) -> VGG:
    """VGG-11 (cfg 'A')."""
    return vgg("vgg11", width=width, batch_norm=batch_norm, num_classes=num_classes,
               hidden=hidden, dtype=dtype)


def vgg16(*, width: float = 1.0, batch_norm: bool = False, num_classes: int = 10,
          hidden: Sequence[int] = (512,), dtype: Any = None) -> VGG:
    """VGG-16 (cfg 'D'): 13 convs, 5 pools. ``width=0.25`` gives 16..128 channels."""
    return vgg("vgg16", width=width, batch_norm=batch_norm, num_classes=num_classes,
               hidden=hidden, dtype=dtype)


def vgg_features(name: str = "vgg16", *, width: float = 1.0, batch_norm: bool = False,
                 dtype: Any = None) -> VGGFeatures:
    """The trunk of a named VGG alone (its variables equal ``vgg(...)``'s ``['features']``)."""
    if name not in VGG_CFGS:
        raise ValueError(f"vgg_features: name must be one of {sorted(VGG_CFGS)}, got {name!r}")
    return VGGFeatures(VGG_CFGS[name], width, batch_norm, dtype)


__all__ = ["VGG", "VGG_CFGS", "VGGFeatures", "vgg", "vgg11", "vgg16", "vgg_features"]
