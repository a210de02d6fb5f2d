"""Row-centric convolution training (LR-CNN: OverL and 2PS), exact gradients.

A conv stack is run tile by tile along the image height, so only one tile's activations
live at a time; the backward pass recomputes each tile. See ``README.md (rowconv section)``.

    layers = [rowconv.Conv(16, 3), rowconv.Act(jax.nn.relu), rowconv.Pool("max", 2)]
    params = rowconv.init(layers, key, (2, 256, 256, 3))
    y = rowconv.apply(layers, params, x, rows=8, mode="overlap")   # == rows=1
"""
from __future__ import annotations

import jax.numpy as jnp

from . import trunks
from .halo import HaloReport, check_shape, halos
from .layers import (
    Act,
    Affine,
    BatchNorm,
    Checkpoint,
    Conv,
    Dropout,
    Pool,
    Residual,
    apply_layers,
    init_layers,
    output_shape,
)
from .planner import Plan, estimate, plan
from .tiled import MODES, apply, segment_rows, split_segments

__all__ = [
    "MODES",
    "Act",
    "Affine",
    "BatchNorm",
    "Checkpoint",
    "Conv",
    "Dropout",
    "HaloReport",
    "Plan",
    "Pool",
    "Residual",
    "apply",
    "apply_layers",
    "estimate",
    "halos",
    "init",
    "output_shape",
    "plan",
    "segment_rows",
    "split_segments",
    "trunks",
]


def init(layers, key, input_shape, dtype=jnp.float32):
    """Parameters for ``layers`` on NHWC ``input_shape`` (a list aligned with ``layers``)."""
    return init_layers(list(layers), key, check_shape(input_shape), dtype)[0]
