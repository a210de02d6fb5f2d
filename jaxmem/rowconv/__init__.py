"""Row-centric convolution training (LR-CNN: OverL and 2PS), exact gradients.

A conv stack is run tile by tile along the image height, so only one tile's activations
live at a time; the backward pass recomputes each tile. See ``docs/rowconv.md``.

    layers = [rowconv.Conv(16, 3), rowconv.Act(jax.nn.relu), rowconv.Pool("max", 2)]
    params = rowconv.init(layers, key, (2, 256, 256, 3))
    y = rowconv.apply(layers, params, x, rows=8, mode="overlap")   # == rows=1

Spatial parallelism: :func:`spatial_apply` shards the height over a mesh axis; each device
tiles its own rows and exchanges only halo rows with its neighbours (``lax.ppermute``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem import _deprecation

from . import trunks
from .halo import HaloReport, check_shape, halos
from .layers import (
    Act,
    Affine,
    BatchNorm,
    Checkpoint,
    Conv,
    Dropout,
    Layer,
    Pool,
    Residual,
    RowLayer,
    apply_layers,
    init_layers,
    output_shape,
)
from .planner import Tiling, estimate, plan
from .spatial import SpatialPlan, spatial_apply, spatial_local, spatial_plan
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
    "Layer",
    "Pool",
    "Residual",
    "RowLayer",
    "SpatialPlan",
    "Tiling",
    "apply",
    "apply_layers",
    "estimate",
    "halos",
    "init",
    "output_shape",
    "plan",
    "segment_rows",
    "spatial_apply",
    "spatial_local",
    "spatial_plan",
    "split_segments",
    "trunks",
]


def init(layers: Sequence[Layer], key: jax.Array, input_shape: Sequence[int],
         dtype: Any = jnp.float32) -> list[Any]:
    """Parameters for ``layers`` on NHWC ``input_shape`` (a list aligned with ``layers``)."""
    return init_layers(list(layers), key, check_shape(input_shape), dtype)[0]


__getattr__ = _deprecation.deprecated_attributes(
    "jaxmem.rowconv", {"TilePlan": ("jaxmem.rowconv.planner:Tiling", "jaxmem.rowconv.Tiling")})
