"""Torch twin of ``jaxmem.models.MLP``: ``dense_0 .. dense_{k-1}`` Linear layers with an
activation module (``self.act``) between them (not after the last)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

MLP_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "none")


def make_activation(name: str) -> nn.Module:
    """Activation module for a name of ``MLP_ACTIVATIONS`` (``gelu`` exact, ``gelu_tanh`` approx.)."""
    table = {
        "relu": lambda: nn.ReLU(),
        "gelu": lambda: nn.GELU(approximate="none"),
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "silu": lambda: nn.SiLU(),
        "tanh": lambda: nn.Tanh(),
        "sigmoid": lambda: nn.Sigmoid(),
        "none": lambda: nn.Identity(),
    }
    if name not in table:
        raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {name!r}")
    return table[name]()


class MLP(nn.Module):
    """``MLP(in_features, features=(h1, .., out), activation='relu', use_bias=True)``."""

    def __init__(self, in_features: int, features: Sequence[int] = (256, 256, 10),
                 activation: str = "relu", use_bias: bool = True):
        super().__init__()
        if len(features) == 0:
            raise ValueError("MLP: features must name at least one layer width")
        self.n = len(features)
        self.act = make_activation(activation)
        d = in_features
        for i, f in enumerate(features):
            setattr(self, f"dense_{i}", nn.Linear(d, int(f), bias=use_bias))
            d = int(f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = getattr(self, f"dense_{i}")(x)
            if i < self.n - 1:
                x = self.act(x)
        return x
