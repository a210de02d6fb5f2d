"""Torch twin of ``jaxmem.models.VGG`` (NCHW): ``features`` trunk (``conv_i`` [+ ``bn_i``],
ReLU, 2x2 max-pools) -> global average pool -> ``fc_*`` head. No dropout."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._common import batchnorm2d, scaled

VGG_CFGS: dict[str, tuple] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}


class VGGFeatures(nn.Module):
    """The VGG conv trunk: ``VGGFeatures(cfg, width=1.0, batch_norm=False, in_channels=3)``."""

    def __init__(self, cfg: Sequence[Any] = VGG_CFGS["vgg16"], width: float = 1.0,
                 batch_norm: bool = False, in_channels: int = 3):
        super().__init__()
        for item in cfg:
            if not (item == "M" or (isinstance(item, int) and item > 0)):
                raise ValueError(f"VGG cfg entries must be positive ints or 'M', got {item!r}")
        self.cfg, self.batch_norm = tuple(cfg), batch_norm
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2)
        c, i = in_channels, 0
        for item in cfg:
            if item == "M":
                continue
            out = scaled(item, width)
            setattr(self, f"conv_{i}", nn.Conv2d(c, out, 3, 1, 1, bias=True))
            if batch_norm:
                setattr(self, f"bn_{i}", batchnorm2d(out))
            c, i = out, i + 1
        self.out_channels = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = 0
        for item in self.cfg:
            if item == "M":
                x = self.pool(x)
                continue
            x = getattr(self, f"conv_{i}")(x)
            if self.batch_norm:
                x = getattr(self, f"bn_{i}")(x)
            x = self.relu(x)
            i += 1
        return x


class VGG(nn.Module):
    """``VGG(cfg, width=1.0, batch_norm=False, num_classes=10, hidden=(512,), in_channels=3)``."""

    def __init__(self, cfg: Sequence[Any] = VGG_CFGS["vgg16"], width: float = 1.0,
                 batch_norm: bool = False, num_classes: int = 10,
                 hidden: Sequence[int] = (512,), in_channels: int = 3):
        super().__init__()
        self.features = VGGFeatures(cfg, width, batch_norm, in_channels)
        self.relu = nn.ReLU()
        d = self.features.out_channels
        self.n_hidden = len(hidden)
        for j, h in enumerate(hidden):
            setattr(self, f"fc_{j}", nn.Linear(d, scaled(h, width)))
            d = scaled(h, width)
        setattr(self, f"fc_{len(hidden)}", nn.Linear(d, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))
        for j in range(self.n_hidden):
            x = self.relu(getattr(self, f"fc_{j}")(x))
        return getattr(self, f"fc_{self.n_hidden}")(x)


def vgg(name: str = "vgg16", *, width: float = 1.0, batch_norm: bool = False,
        num_classes: int = 10, hidden: Sequence[int] = (512,), in_channels: int = 3) -> VGG:
    if name not in VGG_CFGS:
        raise ValueError(f"vgg: name must be one of {sorted(VGG_CFGS)}, got {name!r}")
    return VGG(VGG_CFGS[name], width, batch_norm, num_classes, hidden, in_channels)


def vgg11(**kw) -> VGG:
    return vgg("vgg11", **kw)


def vgg16(**kw) -> VGG:
    return vgg("vgg16", **kw)


def vgg_features(name: str = "vgg16", *, width: float = 1.0, batch_norm: bool = False,
                 in_channels: int = 3) -> VGGFeatures:
    if name not in VGG_CFGS:
        raise ValueError(f"vgg_features: name must be one of {sorted(VGG_CFGS)}, got {name!r}")
    return VGGFeatures(VGG_CFGS[name], width, batch_norm, in_channels)
