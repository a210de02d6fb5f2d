"""Flax glue (Linen and NNX) around the functional core; parameters are unchanged.

* :class:`RowSequential` (Linen): ``RowSequential([nn.Conv(...), nn.relu, rc.Pool(...)],
  rows=8)`` has exactly the parameter tree of ``nn.Sequential`` of the same modules
  (``{'layers_i': {'kernel', 'bias'}}``), so existing variables load as they are.
* :class:`RowVGGFeatures` (Linen): the row-tiled twin of ``jaxmem.models.VGGFeatures``
  (same ``conv_i`` parameters; eval-mode only when ``batch_norm=True`` is not supported).
* :class:`NNXRowSequential` (NNX): wraps ``nnx.Conv`` modules (and activations / rowconv
  layers); gradients flow to the wrapped modules' own ``Param``s.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from . import layers as L
from .halo import as_rows
from .tiled import apply, check_input
from .trunks import VGG16, vgg_layers


def _conv_from(features, kernel_size, strides, padding, dilation, use_bias, groups,
               input_dilation=1):
    if input_dilation not in (1, None, (1, 1)):
        raise ValueError("rowconv: Conv input_dilation (transposed conv) is not supported")
    if isinstance(padding, str) and padding.upper() not in ("SAME", "VALID"):
        raise ValueError(f"rowconv: Conv padding={padding!r} not supported; allowed: 'SAME', "
                         "'VALID', int or explicit pairs")
    return L.Conv(features, tuple(kernel_size), strides if strides is not None else 1,
                  dilation if dilation is not None else 1, padding, use_bias, groups)


def to_rowconv(module: Any) -> L.Layer:
    """A rowconv layer for one Linen/NNX module, activation function or rowconv layer."""
    if isinstance(module, L._LAYER_TYPES):
        return module
    if isinstance(module, nn.Conv):
        return _conv_from(module.features, module.kernel_size, module.strides, module.padding,
                          module.kernel_dilation, module.use_bias, module.feature_group_count,
                          module.input_dilation)
    if isinstance(module, nnx.Conv):
        return _conv_from(module.out_features, module.kernel_size, module.strides,
                          module.padding, module.kernel_dilation, module.use_bias,
                          module.feature_group_count, module.input_dilation)
    if callable(module) and not isinstance(module, (nn.Module, nnx.Module)):
        # must be elementwise: at least check it keeps the shape (pooling would not)
        probe = jax.ShapeDtypeStruct((1, 5, 5, 2), jnp.float32)
        out = jax.eval_shape(module, probe)
        if getattr(out, "shape", None) != probe.shape:
            raise TypeError(f"rowconv: {module!r} changes the shape {probe.shape} -> "
                            f"{getattr(out, 'shape', out)}; only elementwise functions can be "
                            "wrapped as activations (use rowconv.Pool for pooling)")
        return L.Act(module)
    raise TypeError(f"rowconv: cannot tile {module!r}; supported: nn.Conv / nnx.Conv, "
                    "elementwise activation functions, rowconv layers (Pool, Affine, ...)")


class RowSequential(nn.Module):
    """Row-tiled ``nn.Sequential`` of convs / activations / rowconv layers."""

    layers: Sequence[Any]
    rows: Any = 1
    mode: str = "overlap"
    rows_bp: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        check_input(x)
        rl = [to_rowconv(m) for m in self.layers]
        shape = x.shape
        params = []
        for i, (m, layer) in enumerate(zip(self.layers, rl)):
            if isinstance(m, nn.Conv):
                # the nn.Conv is a bound child ('layers_i', as in nn.Sequential): create its
                # params at init with a tiny probe, then read them (never run it full size)
                if self.is_initializing():
                    kh, kw = m.kernel_size
                    dh, dw = L._pair(layer.kernel_dilation, "kernel_dilation")
                    m(jnp.zeros((1, dh * (kh - 1) + 1, dw * (kw - 1) + 1, shape[-1]), x.dtype))
                params.append(dict(m.variables["params"]))
            elif isinstance(layer, (L.Affine, L.BatchNorm, L.Residual)):
                params.append(self.param(f"rowconv_{i}", lambda k, s=shape, l=layer:
                                         L.init_layers([l], k, s)[0][0]))
            else:
                params.append({})
            shape = L.output_shape([layer], shape)
        return apply(rl, params, x, rows=self.rows, mode=self.mode, rows_bp=self.rows_bp,
                     rng=rng)


class RowVGGFeatures(nn.Module):
    """Row-tiled ``jaxmem.models.VGGFeatures`` (same ``conv_i`` parameters, no BN)."""

    cfg: Sequence[Any] = VGG16
    width: float = 1.0
    rows: Any = 1
    mode: str = "overlap"
    checkpoints_at_pools: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        check_input(x)
        rl = vgg_layers(self.cfg, self.width, self.checkpoints_at_pools)
        shape = x.shape
        params, i = [], 0
        for layer in rl:
            if isinstance(layer, L.Conv):
                # same child name and parameters as VGGFeatures' nn.Conv(name=f"conv_{i}")
                m = nn.Conv(layer.features, (3, 3), padding=((1, 1), (1, 1)), name=f"conv_{i}")
                if self.is_initializing():
                    m(jnp.zeros((1, 3, 3, shape[-1]), x.dtype))
                params.append(dict(m.variables["params"]))
                i += 1
            else:
                params.append({})
            if not isinstance(layer, L.Checkpoint):
                shape = L.output_shape([layer], shape)
        rows = self.rows
        if not isinstance(rows, (list, tuple)):
            rows = as_rows(rows)
        if isinstance(rows, int) and rows > 1:
            from .tiled import segment_rows
            rows = segment_rows(rl, x.shape, rows, self.mode)
        return apply(rl, params, x, rows=rows, mode=self.mode)


class NNXRowSequential(nnx.Module):
    """NNX: row-tiled sequence of ``nnx.Conv`` modules, activations and rowconv layers."""

    def __init__(self, *layers: Any, rows: int | Sequence[int] = 1, mode: str = "overlap",
                 rows_bp: int | Sequence[int] | None = None):
        self.layers = nnx.List(list(layers)) if hasattr(nnx, "List") else list(layers)
        self.rows, self.mode, self.rows_bp = rows, mode, rows_bp

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        rl, params = [], []
        for m in self.layers:
            layer = to_rowconv(m)
            rl.append(layer)
            if isinstance(m, nnx.Conv):
                p = {"kernel": m.kernel[...]}
                if m.use_bias:
                    p["bias"] = m.bias[...]
                params.append(p)
            elif isinstance(layer, L._LAYER_TYPES) and not isinstance(layer, L.Act):
                raise TypeError("NNXRowSequential: parametrised rowconv layers need NNX "
                                "modules; use nnx.Conv (or RowSequential for Linen)")
            else:
                params.append({})
        return apply(rl, params, x, rows=self.rows, mode=self.mode, rows_bp=self.rows_bp,
                     rng=rng)


__all__ = ["NNXRowSequential", "RowSequential", "RowVGGFeatures", "to_rowconv"]
