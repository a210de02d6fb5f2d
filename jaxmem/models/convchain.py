"""The deep convolution chain of the selective-differentiation paper (its Figure 1).

A stack of ``depth`` size-preserving convolutions: kernel 3x3, stride 1, padding 1, no bias,
``channels -> channels``. The paper's Figure 1 uses *only* convolutions (input
(256, 8, 256, 256) NCHW, i.e. ``channels=8``); this module follows the team contract and
puts a ReLU after every convolution by default (``relu=True``); pass ``relu=False`` for the
paper's exact linear chain, in which a layer's input is the only thing its kernel gradient
needs (so "only layer 4 differentiated" stores exactly one layer input).

Parameters are ``params['conv_{i}']['kernel']`` with ``i = 0 .. depth-1`` (layer ``k`` of
the paper, 1-based, is ``conv_{k-1}``), kernel layout HWIO ``(3, 3, channels, channels)``.
Images are NHWC. Kernels are drawn from N(0, gain / fan_in) with gain 2 (ReLU) or 1 (linear)
so activations keep their scale over depth; ``torch_ref.models.ConvChain`` draws from the same
distribution.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn

from ._common import check_channels


def chain_kernel_init(relu: bool):
    """N(0, gain/fan_in) with gain 2 for ReLU chains, 1 for linear chains (not truncated)."""
    return nn.initializers.variance_scaling(2.0 if relu else 1.0, "fan_in", "normal")


class ConvChain(nn.Module):
    """``depth`` x [Conv 3x3 (bias-free, size-preserving) -> ReLU (if ``relu``)].

    Attributes:
      depth: number of convolutions (>= 1).
      channels: channels of the input and of every layer (paper: 8).
      relu: apply ``nn.relu`` (called inline) after every convolution. ``False`` = paper Fig. 1.
      dtype: computation dtype (default: inferred from inputs and params).

    Call: ``model.apply(variables, x)`` with ``x`` NHWC ``(N, H, W, channels)``; returns the
    same shape.
    """

    depth: int = 8
    channels: int = 8
    relu: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        if not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"ConvChain: depth must be an int >= 1, got {self.depth!r}")
        check_channels(x, self.channels, "ConvChain")
        for i in range(self.depth):
            x = nn.Conv(self.channels, (3, 3), strides=1, padding=((1, 1), (1, 1)),
                        use_bias=False, dtype=self.dtype,
                        kernel_init=chain_kernel_init(self.relu), name=f"conv_{i}")(x)
            if self.relu:
                x = nn.relu(x)
        return x


def conv_chain(depth: int = 8, channels: int = 8, relu: bool = True, dtype: Any = None) -> ConvChain:
    """Constructor alias of :class:`ConvChain`."""
    return ConvChain(depth=depth, channels=channels, relu=relu, dtype=dtype)


__all__ = ["ConvChain", "chain_kernel_init", "conv_chain"]
