"""ResNet (He et al. 2016) with BasicBlock / Bottleneck and torch-exact BatchNorm, NHWC.

Layout (torchvision "v1.5": the stride of a Bottleneck sits on its 3x3 conv):

* stem ``'imagenet'``: ``conv1`` 7x7/2 (padding 3) -> ``bn1`` -> ReLU -> max-pool 3x3/2 (padding 1);
  stem ``'cifar'``: ``conv1`` 3x3/1 (padding 1) -> ``bn1`` -> ReLU (no pool), for small images.
* four stages of ``stage_sizes`` blocks with ``64, 128, 256, 512`` (times ``width``) planes,
  stride 1, 2, 2, 2; blocks are named ``layer{s}_{b}`` (``layer1_0``, ...), each with
  ``conv1, bn1, conv2, bn2[, conv3, bn3]`` and, where shape changes, ``downsample_conv``
  (1x1, strided) + ``downsample_bn``.
* global average pool -> ``fc``.

All convs are bias-free with explicit torch padding (never 'SAME': for stride 2 on even sizes
flax's 'SAME' pads (0, 1) while torch pads (1, 1)). ReLU is called inline (``nn.relu``).
``train=True`` uses batch statistics and updates ``batch_stats`` (apply with
``mutable=['batch_stats']``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ._common import check_channels, scaled
from .batchnorm import TorchBatchNorm

BLOCKS = ("basic", "bottleneck")
STEMS = ("imagenet", "cifar")


def _conv(features, k, stride, pad, dtype, name):
    return nn.Conv(features, (k, k), strides=(stride, stride), padding=((pad, pad), (pad, pad)),
                   use_bias=False, dtype=dtype, name=name)


class BasicBlock(nn.Module):
    """conv3x3(stride) -> bn -> relu -> conv3x3 -> bn, + shortcut, -> relu. Expansion 1."""

    planes: int
    stride: int = 1
    downsample: bool = False
    dtype: Any = None
    expansion = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        identity = x
        out = _conv(self.planes, 3, self.stride, 1, self.dtype, "conv1")(x)
        out = TorchBatchNorm(dtype=self.dtype, name="bn1")(out, train)
        out = nn.relu(out)
        out = _conv(self.planes, 3, 1, 1, self.dtype, "conv2")(out)
        out = TorchBatchNorm(dtype=self.dtype, name="bn2")(out, train)
        if self.downsample:
            identity = _conv(self.planes, 1, self.stride, 0, self.dtype, "downsample_conv")(x)
            identity = TorchBatchNorm(dtype=self.dtype, name="downsample_bn")(identity, train)
        return nn.relu(out + identity)


class Bottleneck(nn.Module):
    """conv1x1 -> bn -> relu -> conv3x3(stride) -> bn -> relu -> conv1x1 (x4) -> bn,
    + shortcut, -> relu. Expansion 4."""

    planes: int
    stride: int = 1
    downsample: bool = False
    dtype: Any = None
    expansion = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        identity = x
        out = _conv(self.planes, 1, 1, 0, self.dtype, "conv1")(x)
        out = TorchBatchNorm(dtype=self.dtype, name="bn1")(out, train)
        out = nn.relu(out)
        out = _conv(self.planes, 3, self.stride, 1, self.dtype, "conv2")(out)
        out = TorchBatchNorm(dtype=self.dtype, name="bn2")(out, train)
        out = nn.relu(out)
        out = _conv(self.planes * 4, 1, 1, 0, self.dtype, "conv3")(out)
        out = TorchBatchNorm(dtype=self.dtype, name="bn3")(out, train)
        if self.downsample:
            identity = _conv(self.planes * 4, 1, self.stride, 0, self.dtype, "downsample_conv")(x)
            identity = TorchBatchNorm(dtype=self.dtype, name="downsample_bn")(identity, train)
        return nn.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with configurable block, depth and width.

    Attributes:
      block: ``'basic'`` (BasicBlock) or ``'bottleneck'`` (Bottleneck).
      stage_sizes: blocks per stage, e.g. ``(2, 2, 2, 2)`` (ResNet-18), ``(3, 4, 6, 3)`` (-50).
      width: channel multiplier (1.0 = 64 stem channels; 0.25 = 16, for CPU benchmarks).
      num_classes: output size of ``fc``.
      in_channels: channels of the input image (checked).
      stem: ``'imagenet'`` (7x7/2 conv + max-pool) or ``'cifar'`` (3x3/1 conv, no pool).
      dtype: computation dtype.

    Call: ``model.apply(variables, x, train=False)``, ``x`` NHWC ``(N, H, W, in_channels)``.
    """

    block: str = "basic"
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    width: float = 1.0
    num_classes: int = 1000
    in_channels: int = 3
    stem: str = "imagenet"
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        if self.block not in BLOCKS:
            raise ValueError(f"ResNet: block must be one of {BLOCKS}, got {self.block!r}")
        if self.stem not in STEMS:
            raise ValueError(f"ResNet: stem must be one of {STEMS}, got {self.stem!r}")
        check_channels(x, self.in_channels, "ResNet")
        block_cls = BasicBlock if self.block == "basic" else Bottleneck
        c0 = scaled(64, self.width)
        if self.stem == "imagenet":
            x = _conv(c0, 7, 2, 3, self.dtype, "conv1")(x)
        else:
            x = _conv(c0, 3, 1, 1, self.dtype, "conv1")(x)
        x = TorchBatchNorm(dtype=self.dtype, name="bn1")(x, train)
        x = nn.relu(x)
        if self.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        in_planes = c0
        for s, n_blocks in enumerate(self.stage_sizes):
            planes = scaled(64 * 2**s, self.width)
            for b in range(n_blocks):
                stride = 2 if (s > 0 and b == 0) else 1
                down = stride != 1 or in_planes != planes * block_cls.expansion
                x = block_cls(planes, stride, down, self.dtype, name=f"layer{s + 1}_{b}")(x, train)
                in_planes = planes * block_cls.expansion
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="fc")(x)


def resnet18(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet", dtype: Any = None) -> ResNet:
    """ResNet-18: BasicBlock, stages (2, 2, 2, 2)."""
    return ResNet("basic", (2, 2, 2, 2), width, num_classes, in_channels, stem, dtype)


def resnet34(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet", dtype: Any = None) -> ResNet:
    """ResNet-34: BasicBlock, stages (3, 4, 6, 3)."""
    return ResNet("basic", (3, 4, 6, 3), width, num_classes, in_channels, stem, dtype)


def resnet50(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet", dtype: Any = None) -> ResNet:
    """ResNet-50: Bottleneck, stages (3, 4, 6, 3)."""
    return ResNet("bottleneck", (3, 4, 6, 3), width, num_classes, in_channels, stem, dtype)


def resnet101(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
              stem: str = "imagenet", dtype: Any = None) -> ResNet:
    """ResNet-101: Bottleneck, stages (3, 4, 23, 3) (the selective paper's Table 1 model)."""
    return ResNet("bottleneck", (3, 4, 23, 3), width, num_classes, in_channels, stem, dtype)


__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50", "resnet101"]
