"""Layer vocabulary of the row-tiled part, their parameters and their plain (untiled) maths.

Images are NHWC. Every layer maps rows of its input to rows of its output by an affine
receptive field along H:

    output row j  needs  input rows [j*s - lo, j*s - lo + k_eff)      (k_eff = d*(k-1)+1)

where ``s`` is the stride, ``lo`` the top padding and ``d`` the dilation along H. Pointwise
layers (activation, affine, frozen BatchNorm, dropout) have ``k_eff = s = 1, lo = 0``.
``halo.py`` composes these maps; ``tiled.py`` evaluates a layer on a *window* of input rows
with VALID padding along H (the true image border is padded by masking, never a tile
border: the paper's semi-closed padding), and with the layer's own padding along W.

The untiled reference (:func:`apply_layers`) uses exactly the same primitives with the
layer's full padding, so ``rowconv.apply(..., rows=1)`` *is* the plain stack.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ops import _conv2d

Padding = Any  # "SAME" | "VALID" | int | ((lo, hi), (lo, hi)) | (int, int)
Shape = tuple[int, ...]  # NHWC
Params = dict[str, Any]  # one layer's parameters (arrays by name)

__all__ = ["Act", "Affine", "BatchNorm", "Checkpoint", "Conv", "Dropout", "Layer", "Pool",
           "Residual", "RowLayer", "apply_layers", "init_layers", "output_shape"]


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
        return (v, v)
    try:
        t = tuple(int(u) for u in v)
    except TypeError:
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}") from None
    if len(t) != 2 or min(t) < 1:
        raise ValueError(f"{name} must be an int >= 1 or a pair of ints >= 1 (H, W), got {v!r}")
    return t


def _resolve_padding(padding: Padding, in_hw, keff_hw, strides, name="padding"):
    """((lo_h, hi_h), (lo_w, hi_w)) for an op with effective window ``keff_hw``."""
    if isinstance(padding, str):
        p = padding.upper()
        if p not in ("SAME", "VALID"):
            raise ValueError(
                f"{name}={padding!r} is not supported by rowconv; allowed: 'SAME', 'VALID', "
                "an int, or ((top, bottom), (left, right)) pairs (use explicit pairs for "
                "asymmetric or CIRCULAR-free padding)"
            )
        return tuple(tuple(int(a) for a in pr) for pr in lax.padtype_to_pads(
            tuple(in_hw), tuple(keff_hw), tuple(strides), p))
    if isinstance(padding, int):
        if padding < 0:
            raise ValueError(f"{name} must be >= 0, got {padding}")
        return ((padding, padding), (padding, padding))
    try:
        items = list(padding)
    except TypeError:
        raise TypeError(f"{name} must be a str, int or pairs, got {padding!r}") from None
    if len(items) != 2:
        raise ValueError(f"{name} needs one entry per spatial dim (H, W), got {padding!r}")
    out = []
    for it in items:
        if isinstance(it, int):
            out.append((it, it))
        else:
            lo, hi = (int(u) for u in it)
            out.append((lo, hi))
    if min(min(p) for p in out) < 0:
        raise ValueError(f"{name} must be non-negative, got {padding!r}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _RowMap:
    """How a layer maps rows along H: out row j needs in rows [j*s - lo, j*s - lo + keff)."""

    keff: int
    stride: int
    lo: int
    hi: int
    pad_value: float  # value of padded rows (0, or -inf for max pooling)


# ----------------------------------------------------------------------------- layers


@dataclasses.dataclass(frozen=True)
class Conv:
    """2-D convolution (Flax ``nn.Conv`` semantics; kernel HWIO, params {'kernel','bias'})."""

    features: int
    kernel_size: Any = 3
    strides: Any = 1
    kernel_dilation: Any = 1
    padding: Padding = "SAME"
    use_bias: bool = True
    feature_group_count: int = 1

    def geometry(self, in_shape: Shape) -> tuple[_RowMap, tuple[int, int], Shape]:
        B, H, W, C = in_shape
        kh, kw = _pair(self.kernel_size, "Conv.kernel_size")
        sh, sw = _pair(self.strides, "Conv.strides")
        dh, dw = _pair(self.kernel_dilation, "Conv.kernel_dilation")
        keff = (dh * (kh - 1) + 1, dw * (kw - 1) + 1)
        pads = _resolve_padding(self.padding, (H, W), keff, (sh, sw), "Conv.padding")
        Ho = (H + pads[0][0] + pads[0][1] - keff[0]) // sh + 1
        Wo = (W + pads[1][0] + pads[1][1] - keff[1]) // sw + 1
        if Ho < 1 or Wo < 1:
            raise ValueError(f"Conv{kh, kw} on input {in_shape} (NHWC: height {H}, width {W}) "
                             "gives an empty output")
        if C % self.feature_group_count or self.features % self.feature_group_count:
            raise ValueError(
                f"Conv.feature_group_count={self.feature_group_count} must divide the input "
                f"channels ({C}) and features ({self.features})")
        rm = _RowMap(keff[0], sh, pads[0][0], pads[0][1], 0.0)
        return rm, pads[1], (B, Ho, Wo, self.features)

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params:
        kh, kw = _pair(self.kernel_size, "Conv.kernel_size")
        cin = in_shape[-1] // self.feature_group_count
        fan_in = kh * kw * cin
        k1, k2 = jax.random.split(key)
        p = {"kernel": jax.random.normal(k1, (kh, kw, cin, self.features), dtype)
             / math.sqrt(fan_in)}
        if self.use_bias:
            p["bias"] = jnp.zeros((self.features,), dtype)
        return p

    def apply_window(self, p: Params, x: jax.Array, pad_h: tuple[int, int],
                     pad_w: tuple[int, int]) -> jax.Array:
        """Convolution with padding (pad_h, pad_w); pad_h=(0,0) on a tile window."""
        sh, sw = _pair(self.strides, "Conv.strides")
        dh, dw = _pair(self.kernel_dilation, "Conv.kernel_dilation")
        y = _conv2d(x, p["kernel"].astype(x.dtype), (sh, sw), (tuple(pad_h), tuple(pad_w)),
                   (dh, dw), self.feature_group_count)
        if self.use_bias:
            y = y + p["bias"].astype(y.dtype)
        return y


@dataclasses.dataclass(frozen=True)
class Pool:
    """Max or average pooling (``count_include_pad=True`` for 'avg', as Flax and torch)."""

    kind: str = "max"
    window: Any = 2
    strides: Any = None  # None: equal to window (torch's default)
    padding: Padding = "VALID"

    def __post_init__(self):
        if self.kind not in ("max", "avg"):
            raise ValueError(f"Pool.kind must be 'max' or 'avg', got {self.kind!r}")

    def geometry(self, in_shape: Shape) -> tuple[_RowMap, tuple[int, int], Shape]:
        B, H, W, C = in_shape
        wh, ww = _pair(self.window, "Pool.window")
        sh, sw = _pair(self.strides if self.strides is not None else self.window, "Pool.strides")
        pads = _resolve_padding(self.padding, (H, W), (wh, ww), (sh, sw), "Pool.padding")
        Ho = (H + sum(pads[0]) - wh) // sh + 1
        Wo = (W + sum(pads[1]) - ww) // sw + 1
        if Ho < 1 or Wo < 1:
            raise ValueError(f"Pool{wh, ww} on input {in_shape} (NHWC: height {H}, width {W}) "
                             "gives an empty output")
        pv = -jnp.inf if self.kind == "max" else 0.0
        return _RowMap(wh, sh, pads[0][0], pads[0][1], pv), pads[1], (B, Ho, Wo, C)

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params:
        return {}

    def __call__(self, x: jax.Array) -> jax.Array:
        """Untiled pooling (so a Pool also works inside ``nn.Sequential``)."""
        rm, pad_w, _ = self.geometry(x.shape)
        return self.apply_window({}, x, (rm.lo, rm.hi), pad_w)

    def apply_window(self, p: Params, x: jax.Array, pad_h: tuple[int, int],
                     pad_w: tuple[int, int]) -> jax.Array:
        wh, ww = _pair(self.window, "Pool.window")
        sh, sw = _pair(self.strides if self.strides is not None else self.window, "Pool.strides")
        pads = ((0, 0), tuple(pad_h), tuple(pad_w), (0, 0))
        if self.kind == "max":
            init = np.array(-np.inf, x.dtype)  # concrete: selects the differentiable max
            return lax.reduce_window(x, init, lax.max, (1, wh, ww, 1), (1, sh, sw, 1), pads)
        s = lax.reduce_window(x, np.array(0, x.dtype), lax.add, (1, wh, ww, 1),
                              (1, sh, sw, 1), pads)
        return s / jnp.array(wh * ww, x.dtype)


class _Pointwise:
    def geometry(self, in_shape: Shape) -> tuple[_RowMap, tuple[int, int], Shape]:
        return _RowMap(1, 1, 0, 0, 0.0), (0, 0), tuple(in_shape)

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params:
        return {}


def _known_elementwise() -> frozenset:
    """Activation functions known to be elementwise (jax.nn / flax aliases, jnp ufuncs and
    the few-bit ops): ``Act`` accepts them without probing."""
    names = ("relu", "relu6", "gelu", "silu", "swish", "sigmoid", "tanh", "elu", "celu", "selu",
             "softplus", "soft_sign", "log_sigmoid", "leaky_relu", "hard_tanh", "hard_sigmoid",
             "hard_silu", "hard_swish", "mish", "sparse_plus", "sparse_sigmoid", "squareplus",
             "identity")
    from jaxmem.fewbit import ops as fewbit_ops
    fns = [getattr(m, n) for m in (jax.nn, fewbit_ops) for n in names if hasattr(m, n)]
    fns += [jnp.tanh, jnp.abs, jnp.exp, jnp.sin, jnp.cos, jnp.square, jnp.negative]
    fns += [getattr(fewbit_ops, n) for n in fewbit_ops.__all__
            if n not in ("activation", "fewbit_op", "mask_op")]
    return frozenset(fns)


_KNOWN: list = []
_CHECKED: dict = {}


def _require_elementwise(fn) -> None:
    if not _KNOWN:
        _KNOWN.append(_known_elementwise())
    try:
        if fn in _KNOWN[0] or fn in _CHECKED:
            return
    except TypeError:  # unhashable callable: check every time
        pass
    from jaxmem.fewbit.factory import check_elementwise
    label = getattr(fn, "__name__", None) or repr(fn)
    try:
        # an NHWC probe: functions written for images (axis=1, ...) are probed as used here
        check_elementwise(fn, name=f"rowconv.Act({label})", shape=(2, 3, 2, 2))
    except ValueError as e:
        raise ValueError(
            f"{e}. rowconv tiles the image by rows, so Act(fn) must act on each element "
            "independently, otherwise the tiled output differs from the untiled stack. Apply "
            "such a function after the rowconv block; if fn is elementwise (or acts on each "
            "pixel's channels only) and the probe is wrong, pass Act(fn, elementwise=True)"
        ) from None
    try:
        _CHECKED[fn] = True
    except TypeError:
        pass


@dataclasses.dataclass(frozen=True)
class Act(_Pointwise):
    """Elementwise activation ``fn`` (e.g. ``jax.nn.relu``).

    Row tiling is exact only if ``fn`` acts on each element independently.  Known activations
    (``jax.nn`` / flax / few-bit ops) are accepted as they are; any other callable is probed
    with :func:`jaxmem.fewbit.check_elementwise` on an NHWC array at construction and refused
    (ValueError) if it is not elementwise.  ``elementwise=True`` skips the probe: the caller
    asserts that ``fn`` acts row by row (per element, or per pixel over channels).
    """

    fn: Callable = jax.nn.relu
    elementwise: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Act.fn must be a callable, got {self.fn!r}")
        if not isinstance(self.elementwise, bool):
            raise TypeError(f"Act.elementwise must be a bool, got {self.elementwise!r}")
        if not self.elementwise:
            _require_elementwise(self.fn)

    def apply_window(self, p: Params, x: jax.Array, pad_h: tuple[int, int] | None = None,
                     pad_w: tuple[int, int] | None = None) -> jax.Array:
        return self.fn(x)


@dataclasses.dataclass(frozen=True)
class Affine(_Pointwise):
    """Per-channel ``x * scale + bias`` (params {'scale','bias'}), e.g. a folded frozen BN."""

    features: int

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params:
        return {"scale": jnp.ones((self.features,), dtype),
                "bias": jnp.zeros((self.features,), dtype)}

    def apply_window(self, p: Params, x: jax.Array, pad_h: tuple[int, int] | None = None,
                     pad_w: tuple[int, int] | None = None) -> jax.Array:
        return x * p["scale"].astype(x.dtype) + p["bias"].astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class BatchNorm(_Pointwise):
    """BatchNorm. Only ``use_running_average=True`` (eval / frozen statistics) can be tiled:

        y = (x - mean) / sqrt(var + epsilon) * scale + bias

    with params {'scale','bias','mean','var'}. Train mode needs statistics over the whole
    image and is rejected inside the tiled part (see ``tiled.check_tileable``).
    """

    features: int
    use_running_average: bool = True
    epsilon: float = 1e-5

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params:
        f = (self.features,)
        return {"scale": jnp.ones(f, dtype), "bias": jnp.zeros(f, dtype),
                "mean": jnp.zeros(f, dtype), "var": jnp.ones(f, dtype)}

    def apply_window(self, p: Params, x: jax.Array, pad_h: tuple[int, int] | None = None,
                     pad_w: tuple[int, int] | None = None) -> jax.Array:
        if not self.use_running_average:
            # Whole-batch statistics (used by the untiled path only).
            axes = (0, 1, 2)
            mean = jnp.mean(x, axes)
            var = jnp.mean(jnp.square(x - mean), axes)
        else:
            mean, var = p["mean"].astype(x.dtype), p["var"].astype(x.dtype)
        inv = lax.rsqrt(var + jnp.array(self.epsilon, x.dtype)) * p["scale"].astype(x.dtype)
        return (x - mean) * inv + p["bias"].astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Dropout(_Pointwise):
    """Inverted dropout with a mask drawn *per image row* from ``fold_in(key, row)``.

    Drawing per global row makes the mask independent of the tiling, so tiled and untiled
    runs drop the same units (exact gradients). ``deterministic=True`` is the identity.
    """

    rate: float
    deterministic: bool = False

    def __post_init__(self):
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"Dropout.rate must be in [0, 1), got {self.rate}")

    def apply_rows(self, x: jax.Array, key: jax.Array | None, row0: Any) -> jax.Array:
        """Dropout on rows [row0, row0 + x.shape[1]) of the full map."""
        if self.deterministic or self.rate == 0.0:
            return x
        if key is None:
            raise ValueError("Dropout(deterministic=False) needs apply(..., rng=key)")
        B, R, W, C = x.shape
        rows = row0 + jnp.arange(R)

        def row_mask(r):
            return jax.random.bernoulli(jax.random.fold_in(key, r), 1.0 - self.rate, (B, W, C))

        keep = jax.vmap(row_mask, out_axes=1)(rows)
        return jnp.where(keep, x / jnp.array(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class Residual:
    """``branch(x) + shortcut(x)`` (shortcut None: identity); both are layer lists."""

    branch: Sequence[Any]
    shortcut: Sequence[Any] | None = None

    def __hash__(self):
        return hash((tuple(self.branch), None if self.shortcut is None else tuple(self.shortcut)))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Segment boundary for the hybrid (-H) variants: the map here is stored whole, and the
    layers before and after it are row-tiled separately."""


@runtime_checkable
class RowLayer(Protocol):
    """What a row-tileable layer implements (``Conv``, ``Pool``, ``Act``, ``Affine``,
    ``BatchNorm``, ``Dropout``); ``Residual`` and ``Checkpoint`` are structure, not layers.

    * ``geometry(in_shape) -> (row_map, pad_w, out_shape)``: output row ``j`` needs input rows
      ``[j*s - lo, j*s - lo + k_eff)`` (the row map's ``stride``, ``lo``, ``keff``; pointwise
      layers have ``k_eff = s = 1, lo = 0``), ``pad_w`` the padding along W;
    * ``init(key, in_shape, dtype) -> params``;
    * ``apply_window(params, x, pad_h, pad_w) -> y``: the layer on a window of input rows
      with VALID padding along H (``pad_h = (0, 0)``) or on the whole map with its own
      padding. ``Dropout`` instead has ``apply_rows(x, key, row0)``: its mask depends on
      the global row index, so a tile needs ``row0``.
    """

    def geometry(self, in_shape: Shape) -> tuple[Any, tuple[int, int], Shape]: ...

    def init(self, key: jax.Array, in_shape: Shape, dtype: Any = jnp.float32) -> Params: ...


#: a layer list entry: a row layer, a ``Residual`` block or a ``Checkpoint`` marker
Layer = RowLayer | Residual | Checkpoint

_LAYER_TYPES = (Conv, Pool, Act, Affine, BatchNorm, Dropout, Residual, Checkpoint)


def _check_layer(layer, where="layers"):
    if not isinstance(layer, _LAYER_TYPES):
        raise TypeError(
            f"{where}: unsupported layer {layer!r}; rowconv tiles only "
            "Conv, Pool, Act, Affine, BatchNorm(use_running_average=True), Dropout, Residual "
            "(and Checkpoint markers). Put other layers (Dense, flatten, global pooling, "
            "attention) after the rowconv block.")


# ----------------------------------------------------------------------------- init / untiled


def init_layers(layers: Sequence[Layer], key: jax.Array, input_shape: Sequence[int],
                dtype: Any = jnp.float32) -> tuple[list[Any], Shape]:
    """Parameters (a list aligned with ``layers``) and the output shape."""
    params = []
    shape = tuple(input_shape)
    for i, layer in enumerate(layers):
        _check_layer(layer, f"layers[{i}]")
        k = jax.random.fold_in(key, i)
        if isinstance(layer, Residual):
            pb, sb = init_layers(layer.branch, jax.random.fold_in(k, 0), shape, dtype)
            if layer.shortcut is None:
                ps, ss = [], shape
            else:
                ps, ss = init_layers(layer.shortcut, jax.random.fold_in(k, 1), shape, dtype)
            if sb != ss:
                raise ValueError(
                    f"layers[{i}] Residual: branch output {sb} != shortcut output {ss}")
            params.append({"branch": pb, "shortcut": ps})
            shape = sb
        elif isinstance(layer, Checkpoint):
            params.append({})
        else:
            params.append(layer.init(k, shape, dtype))
            shape = layer.geometry(shape)[2]
    return params, shape


def _param_shapes(layer, in_shape) -> dict | None:
    """Parameter name -> shape a layer needs on ``in_shape``; None if it has no parameters."""
    C = in_shape[-1]
    if isinstance(layer, Conv):
        kh, kw = _pair(layer.kernel_size, "Conv.kernel_size")
        out = {"kernel": (kh, kw, C // layer.feature_group_count, layer.features)}
        if layer.use_bias:
            out["bias"] = (layer.features,)
        return out
    if isinstance(layer, Affine):
        return {"scale": (layer.features,), "bias": (layer.features,)}
    if isinstance(layer, BatchNorm):
        f = (layer.features,)
        return {"scale": f, "bias": f, "mean": f, "var": f}
    return None


def check_params(layers: Sequence[Layer], params: Any, input_shape: Sequence[int],
                 where: str = "layers") -> None:
    """ValueError/TypeError naming the layer unless ``params`` fit ``layers`` on NHWC
    ``input_shape`` (every entry present, no unused entry, every shape right)."""
    shape = tuple(input_shape)
    if not isinstance(params, (list, tuple)) or len(params) != len(layers):
        n = len(params) if isinstance(params, (list, tuple)) else type(params).__name__
        raise ValueError(f"{where}: params must be a list with one entry per layer "
                         f"({len(layers)}), got {n}; use rowconv.init(layers, key, input_shape)")
    for i, (layer, p) in enumerate(zip(layers, params)):
        w = f"{where}[{i}] ({type(layer).__name__})"
        _check_layer(layer, f"{where}[{i}]")
        if isinstance(layer, Checkpoint):
            continue
        if isinstance(layer, Residual):
            if not hasattr(p, "keys") or "branch" not in p:
                raise ValueError(f"{w}: params must be a dict with 'branch' and 'shortcut' "
                                 f"lists, got {type(p).__name__}")
            check_params(layer.branch, p["branch"], shape, f"{where}[{i}].branch")
            check_params(layer.shortcut or [], p.get("shortcut", []), shape,
                         f"{where}[{i}].shortcut")
            shape = output_shape(layer.branch, shape)
            continue
        need = _param_shapes(layer, shape)
        if isinstance(layer, (Affine, BatchNorm)) and layer.features != shape[-1]:
            raise ValueError(
                f"{w}: features={layer.features} but its input {shape} has {shape[-1]} channels "
                "in its last axis (rowconv images are NHWC)")
        if isinstance(layer, Conv) and shape[-1] % layer.feature_group_count:
            raise ValueError(
                f"{w}: feature_group_count={layer.feature_group_count} does not divide the "
                f"{shape[-1]} channels of its input {shape} (last axis; rowconv images are NHWC)")
        if need is not None:
            if not hasattr(p, "keys"):
                raise TypeError(f"{w}: params must be a dict with {sorted(need)}, got "
                                f"{type(p).__name__}")
            missing = [k for k in need if k not in p]
            if missing:
                raise ValueError(f"{w}: params has no {missing[0]!r} entry; this layer needs "
                                 f"{sorted(need)}, got {sorted(p.keys())}")
            extra = sorted(k for k in p if k not in need)
            if extra:
                raise ValueError(f"{w}: params has entries {extra} this layer does not use "
                                 f"(it needs {sorted(need)})")
            for k, want in need.items():
                got = tuple(getattr(p[k], "shape", ()))
                if got != want:
                    hint = ""
                    if isinstance(layer, Conv) and k == "kernel" and len(got) == 4:
                        hint = (f"; the kernel takes {got[2] * layer.feature_group_count} input "
                                f"channels but the input {shape} has {shape[-1]} in its last "
                                "axis (rowconv images are NHWC: transpose an NCHW input with "
                                "x.transpose(0, 2, 3, 1))")
                    raise ValueError(f"{w}: params[{k!r}] has shape {got}, expected {want} "
                                     f"(HWIO kernel){hint}" if k == "kernel" else
                                     f"{w}: params[{k!r}] has shape {got}, expected {want}")
        shape = layer.geometry(shape)[2]


def output_shape(layers: Sequence[Layer], input_shape: Sequence[int]) -> Shape:
    shape = tuple(input_shape)
    for i, layer in enumerate(layers):
        _check_layer(layer, f"layers[{i}]")
        if isinstance(layer, Residual):
            shape = output_shape(layer.branch, shape)
        elif not isinstance(layer, Checkpoint):
            shape = layer.geometry(shape)[2]
    return shape


def apply_layers(layers: Sequence[Layer], params: Sequence[Any], x: jax.Array,
                 rng: jax.Array | None = None, _path: tuple = (), start: int = 0) -> jax.Array:
    """The plain untiled stack (reference semantics of every tiled mode).

    ``start``: index of ``layers[0]`` in the full list (dropout keys follow the full index).
    """
    for i, (layer, p) in enumerate(zip(layers, params), start):
        path = _path + (i,)
        if isinstance(layer, Residual):
            b = apply_layers(layer.branch, p["branch"], x, rng, path + (0,))
            s = x if layer.shortcut is None else apply_layers(
                layer.shortcut, p["shortcut"], x, rng, path + (1,))
            x = b + s
        elif isinstance(layer, Checkpoint):
            continue
        elif isinstance(layer, Dropout):
            x = layer.apply_rows(x, _layer_key(rng, path), 0)
        else:
            rm, pad_w, _ = layer.geometry(x.shape)
            x = layer.apply_window(p, x, (rm.lo, rm.hi), pad_w)
    return x


def _layer_key(rng, path):
    if rng is None:
        return None
    k = rng
    for i in path:
        k = jax.random.fold_in(k, i)
    return k
