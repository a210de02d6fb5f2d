"""Torch twin of ``jaxmem.models.ResNet`` (NCHW, torchvision v1.5 layout, same names:
``conv1, bn1, layer{s}_{b}.{conv1,bn1,...,downsample_conv,downsample_bn}, fc``)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._common import batchnorm2d, check_channels, scaled

BLOCKS = ("basic", "bottleneck")
STEMS = ("imagenet", "cifar")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, downsample: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = batchnorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = batchnorm2d(planes)
        self.relu = nn.ReLU()
        self.has_downsample = downsample
        if downsample:
            self.downsample_conv = nn.Conv2d(in_planes, planes, 1, stride, 0, bias=False)
            self.downsample_bn = batchnorm2d(planes)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.has_downsample:
            identity = self.downsample_bn(self.downsample_conv(x))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, downsample: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, 1, 0, bias=False)
        self.bn1 = batchnorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = batchnorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, 1, 0, bias=False)
        self.bn3 = batchnorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.has_downsample = downsample
        if downsample:
            self.downsample_conv = nn.Conv2d(in_planes, planes * 4, 1, stride, 0, bias=False)
            self.downsample_bn = batchnorm2d(planes * 4)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.has_downsample:
            identity = self.downsample_bn(self.downsample_conv(x))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """``ResNet(block='basic', stage_sizes=(2,2,2,2), width=1.0, num_classes=1000,
    in_channels=3, stem='imagenet')`` -- same arguments as the JAX twin (minus dtype)."""

    def __init__(self, block: str = "basic", stage_sizes: Sequence[int] = (2, 2, 2, 2),
                 width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
                 stem: str = "imagenet"):
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"ResNet: block must be one of {BLOCKS}, got {block!r}")
        if stem not in STEMS:
            raise ValueError(f"ResNet: stem must be one of {STEMS}, got {stem!r}")
        block_cls = BasicBlock if block == "basic" else Bottleneck
        self.in_channels, self.stem = in_channels, stem
        c0 = scaled(64, width)
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, c0, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, c0, 3, 1, 1, bias=False)
        self.bn1 = batchnorm2d(c0)
        self.relu = nn.ReLU()
        self.block_names: list[str] = []
        in_planes = c0
        for s, n_blocks in enumerate(stage_sizes):
            planes = scaled(64 * 2**s, width)
            for b in range(n_blocks):
                stride = 2 if (s > 0 and b == 0) else 1
                down = stride != 1 or in_planes != planes * block_cls.expansion
                name = f"layer{s + 1}_{b}"
                setattr(self, name, block_cls(in_planes, planes, stride, down))
                self.block_names.append(name)
                in_planes = planes * block_cls.expansion
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_channels(x, self.in_channels, "ResNet")
        x = self.relu(self.bn1(self.conv1(x)))
        if self.stem == "imagenet":
            x = self.maxpool(x)
        for name in self.block_names:
            x = getattr(self, name)(x)
        return self.fc(x.mean(dim=(2, 3)))


def resnet18(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet") -> ResNet:
    return ResNet("basic", (2, 2, 2, 2), width, num_classes, in_channels, stem)


def resnet34(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet") -> ResNet:
    return ResNet("basic", (3, 4, 6, 3), width, num_classes, in_channels, stem)


def resnet50(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
             stem: str = "imagenet") -> ResNet:
    return ResNet("bottleneck", (3, 4, 6, 3), width, num_classes, in_channels, stem)


def resnet101(*, width: float = 1.0, num_classes: int = 1000, in_channels: int = 3,
              stem: str = "imagenet") -> ResNet:
    return ResNet("bottleneck", (3, 4, 23, 3), width, num_classes, in_channels, stem)
