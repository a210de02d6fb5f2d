"""Torch twin of ``jaxmem.models.ConvChain`` (selective-differentiation paper, Figure 1).

``depth`` x [Conv2d 3x3, stride 1, padding 1, bias=False, channels->channels -> ReLU (if
``relu``)]. Convs are ``conv_0 .. conv_{depth-1}``; ReLU is one ``nn.ReLU`` module
(``self.relu``, not in-place) so module-swapping tools can replace it. NCHW. Kernels drawn from
N(0, gain/fan_in) (gain 2 with ReLU, 1 without), the same distribution as the JAX twin.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._common import check_channels


class ConvChain(nn.Module):
    """See module docstring. ``relu=False`` is the paper's exact (linear) Figure-1 chain."""

    def __init__(self, depth: int = 8, channels: int = 8, relu: bool = True):
        super().__init__()
        if not (isinstance(depth, int) and depth >= 1):
            raise ValueError(f"ConvChain: depth must be an int >= 1, got {depth!r}")
        self.depth, self.channels, self.use_relu = depth, channels, relu
        for i in range(depth):
            setattr(self, f"conv_{i}", nn.Conv2d(channels, channels, 3, 1, 1, bias=False))
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt((2.0 if self.use_relu else 1.0) / (self.channels * 9))
        with torch.no_grad():
            for i in range(self.depth):
                getattr(self, f"conv_{i}").weight.normal_(0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_channels(x, self.channels, "ConvChain")
        for i in range(self.depth):
            x = self.relu(getattr(self, f"conv_{i}")(x))
        return x


def conv_chain(depth: int = 8, channels: int = 8, relu: bool = True) -> ConvChain:
    return ConvChain(depth, channels, relu)
