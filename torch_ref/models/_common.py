"""Helpers shared by the torch twin models."""
from __future__ import annotations

import torch
from torch import nn


def scaled(channels: int, width: float) -> int:
    """``max(1, round(channels * width))`` -- identical to ``jaxmem.models._common.scaled``."""
    if not (isinstance(width, (int, float)) and width > 0):
        raise ValueError(f"width must be a positive number (a multiplier), got {width!r}")
    return max(1, round(channels * width))


def check_channels(x: torch.Tensor, expected: int, model: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{model}: input must be NCHW (4-D), got shape {tuple(x.shape)}")
    if x.shape[1] != expected:
        raise ValueError(
            f"{model}: input has {x.shape[1]} channels (axis 1, NCHW), expected {expected}")


def batchnorm2d(c: int) -> nn.BatchNorm2d:
    """torch's BatchNorm2d with explicit defaults (eps 1e-5, momentum 0.1)."""
    return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)
