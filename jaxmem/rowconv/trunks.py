"""Ready-made rowconv layer stacks: the VGG and ResNet-50 conv trunks (CPU-scalable width).

``vgg_layers`` mirrors ``jaxmem.models.VGGFeatures`` (3x3 convs, padding 1, bias, ReLU,
2x2/2 max pools). ``resnet50_layers`` is a bottleneck ResNet-50 trunk with
*frozen* BatchNorm (eval statistics, the only kind that can be row-tiled exactly).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax

from .layers import Act, BatchNorm, Checkpoint, Conv, Layer, Pool, Residual

__all__ = ["VGG16", "resnet50_layers", "vgg_layers"]

VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
         512, 512, 512, "M")


def _scaled(c, width):
    return max(1, round(c * width))


def vgg_layers(cfg: Sequence[int | str] = VGG16, width: float = 1.0,
               checkpoints_at_pools: bool | Sequence[int] = False) -> list[Layer]:
    """rowconv layers of a VGG trunk, optionally cut into tiled segments (hybrid -H).

    ``checkpoints_at_pools``: ``True`` puts a ``Checkpoint`` after every pool but the last
    (one segment per stage); a sequence of 1-based pool numbers puts one after those pools
    only (e.g. ``(2, 3, 4)``: the first two stages one segment); ``False`` none."""
    pools = sum(1 for item in cfg if item == "M")
    if isinstance(checkpoints_at_pools, bool):
        after = set(range(1, pools)) if checkpoints_at_pools else set()
    else:
        try:
            after = {int(i) for i in checkpoints_at_pools}
        except TypeError:
            raise TypeError("checkpoints_at_pools must be a bool or a sequence of pool "
                            f"numbers, got {checkpoints_at_pools!r}") from None
        if any(not 1 <= i <= pools for i in after):
            raise ValueError(f"checkpoints_at_pools {sorted(after)}: pool numbers run from 1 "
                             f"to {pools} for this cfg")
    layers, seen = [], 0
    for item in cfg:
        if item == "M":
            layers.append(Pool("max", 2, 2))
            seen += 1
            if seen in after:
                layers.append(Checkpoint())
        else:
            layers += [Conv(_scaled(item, width), 3, padding=((1, 1), (1, 1))),
                       Act(jax.nn.relu)]
    if layers and isinstance(layers[-1], Checkpoint):
        layers.pop()
    return layers


def _bottleneck(width_out, mid, stride, project):
    branch = [Conv(mid, 1, use_bias=False), BatchNorm(mid), Act(jax.nn.relu),
              Conv(mid, 3, strides=stride, padding=((1, 1), (1, 1)), use_bias=False),
              BatchNorm(mid), Act(jax.nn.relu),
              Conv(width_out, 1, use_bias=False), BatchNorm(width_out)]
    shortcut = [Conv(width_out, 1, strides=stride, use_bias=False),
                BatchNorm(width_out)] if project else None
    return [Residual(branch, shortcut), Act(jax.nn.relu)]


def resnet50_layers(width: float = 1.0, stages: Sequence[int] = (3, 4, 6, 3),
                    checkpoints_at_stages: bool = False, stem: bool = True) -> list[Layer]:
    """ResNet-50 trunk (frozen BN): stem 7x7/2 + maxpool 3x3/2, then bottleneck stages."""
    layers = []
    c = _scaled(64, width)
    if stem:
        layers += [Conv(c, 7, strides=2, padding=((3, 3), (3, 3)), use_bias=False),
                   BatchNorm(c), Act(jax.nn.relu), Pool("max", 3, 2, ((1, 1), (1, 1)))]
    for s, n in enumerate(stages):
        mid = _scaled(64 * 2 ** s, width)
        out = 4 * mid
        for b in range(n):
            stride = 2 if (b == 0 and s > 0) else 1
            layers += _bottleneck(out, mid, stride, project=(b == 0))
        if checkpoints_at_stages and s < len(stages) - 1:
            layers.append(Checkpoint())
    return layers
