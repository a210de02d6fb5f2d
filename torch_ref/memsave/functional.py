"""Memory-saving autograd primitives (Bhatia & Dangel, "Lowering PyTorch's Memory
Consumption for Selective Differentiation"), written from the paper.

Each ``torch.autograd.Function`` runs the same forward/backward kernels as PyTorch (``aten``
ops) but decides in ``forward`` -- from ``ctx.needs_input_grad`` -- which tensors the backward
pass needs:

* linear / convolution ``z = f(x, W) + b``: ``x`` only if ``W`` needs a gradient, ``W`` only
  if ``x`` does; the bias needs nothing;
* batch / layer / group norm: the input (+ per-group statistics) only if the input or the
  weight needs a gradient; in eval mode batch norm is affine in ``x`` and needs the input only
  for the weight gradient;
* ReLU: a boolean mask of ``x > 0`` (1 B/element) or a 1-bit packed mask (1/8 B/element);
* max-pool: the argmax indices as int32; dropout: only a random seed.

Tensors not saved are replaced by zero-stride placeholders (``_placeholder``) in the
input's dtype, so the aten backward kernels get correct shapes without any storage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "batch_norm",
    "conv",
    "dropout",
    "group_norm",
    "layer_norm",
    "linear",
    "max_pool",
    "pack_bits",
    "relu",
    "unpack_bits",
]


def _placeholder(shape, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``shape`` with no storage of its own (a 1-element zero, expanded)."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(shape)


# ----------------------------------------------------------------------------- linear
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        need_x, need_w, need_b = ctx.needs_input_grad
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = g @ weight if need_x else None
        gw = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if need_w else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if (need_b and ctx.has_bias) else None
        return gx, gw, gb


def linear(x, weight, bias=None):
    """``F.linear`` that stores ``x`` only if ``weight`` needs a gradient (and vice versa)."""
    return _Linear.apply(x, weight, bias)


# -------------------------------------------------------------------------- convolution
class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding,
                groups):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.meta = (x.shape, weight.shape, None if bias is None else bias.shape, stride,
                    padding, dilation, transposed, output_padding, groups)
        return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation,
                                          transposed, output_padding, groups)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        (xs, ws, bs, stride, padding, dilation, transposed, output_padding,
         groups) = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bs is not None
        x = x if x is not None else _placeholder(xs, g)
        weight = weight if weight is not None else _placeholder(ws, g)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, x, weight, bs, stride, padding, dilation, transposed, output_padding, groups,
            [need_x, need_w, need_b])
        return gx, gw, gb, None, None, None, None, None, None


def conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, transposed=False,
         output_padding=0):
    """N-d (transposed) convolution with differentiability-aware saving (NCHW layout)."""
    nsp = x.dim() - 2

    def tup(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nsp

    if isinstance(padding, str):
        raise ValueError("torch_ref.memsave.conv: string padding is resolved by the Conv "
                         f"modules; pass explicit ints here, got {padding!r}")
    return _Conv.apply(x, weight, bias, tup(stride), tup(padding), tup(dilation), transposed,
                       tup(output_padding), groups)


# ---------------------------------------------------------------------------- norms
class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        out, save_mean, save_invstd = _native_bn(x, weight, bias, running_mean, running_var,
                                                 training, momentum, eps)
        keep_x = need_w if not training else (need_x or need_w)
        ctx.save_for_backward(
            x if keep_x else None, weight if need_x else None,
            running_mean if not training else None,
            running_var if (not training and (need_x or need_w)) else None,
            save_mean if training and (need_x or need_w) else None,
            save_invstd if training and (need_x or need_w) else None)
        ctx.meta = (x.shape, training, eps, weight is not None, bias is not None,
                    None if weight is None else weight.shape)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, rmean, rvar, smean, sinvstd = ctx.saved_tensors
        xs, training, eps, has_w, has_b, wshape = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w, need_b = need_w and has_w, need_b and has_b
        red = [0] + list(range(2, g.dim()))
        shape = [1, -1] + [1] * (g.dim() - 2)
        gb = g.sum(red) if need_b else None
        if not training:
            invstd = torch.rsqrt(rvar + eps) if (need_x or need_w) else None
            gx = g * (invstd * (weight if weight is not None else 1.0)).reshape(shape) \
                if need_x else None
            gw = (g * (x - rmean.reshape(shape)) * invstd.reshape(shape)).sum(red) \
                if need_w else None
            return gx, gw, gb, None, None, None, None, None
        if not (need_x or need_w):
            return None, None, gb, None, None, None, None, None
        if weight is None and has_w:
            weight = _placeholder(wshape, g)
        gx, gw, _ = torch.ops.aten.native_batch_norm_backward(
            g, x, weight, None, None, smean, sinvstd, True, eps, [need_x, need_w, False])
        return gx, gw, gb, None, None, None, None, None


def _native_bn(x, weight, bias, running_mean, running_var, training, momentum, eps):
    out, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
        x, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, save_mean, save_invstd


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """``F.batch_norm`` (same argument order) storing only what requested gradients need;
    running statistics are updated in place in training mode, as PyTorch does."""
    return _BatchNorm.apply(x, weight, bias, running_mean, running_var, training, momentum,
                            eps)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, normalized_shape, weight, bias,
                                                           eps)
        keep = need_x or need_w
        ctx.save_for_backward(x if keep else None, mean if keep else None,
                              rstd if keep else None, weight if need_x else None)
        ctx.meta = (normalized_shape, weight is not None, bias is not None,
                    None if weight is None else weight.shape)
        return out

    @staticmethod
    def backward(ctx, g):
        x, mean, rstd, weight = ctx.saved_tensors
        nshape, has_w, has_b, wshape = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w, need_b = need_w and has_w, need_b and has_b
        red = list(range(g.dim() - len(nshape)))
        gb = g.sum(red) if need_b else None
        if not (need_x or need_w):
            return None, None, gb, None, None
        if weight is None and has_w:
            weight = _placeholder(wshape, g)
        gx, gw, _ = torch.ops.aten.native_layer_norm_backward(
            g, x, nshape, mean, rstd, weight, None, [need_x, need_w, False])
        return gx, gw, gb, None, None


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` storing the input only if the input or weight needs a gradient."""
    return _LayerNorm.apply(x, weight, bias, tuple(normalized_shape), eps)


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        n, c = x.shape[:2]
        hw = x.numel() // (n * c) if n * c else 0
        out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c, hw,
                                                           num_groups, eps)
        keep = need_x or need_w
        ctx.save_for_backward(x if keep else None, mean if keep else None,
                              rstd if keep else None, weight if need_x else None)
        ctx.meta = (n, c, hw, num_groups, weight is not None, bias is not None,
                    None if weight is None else weight.shape)
        return out

    @staticmethod
    def backward(ctx, g):
        x, mean, rstd, weight = ctx.saved_tensors
        n, c, hw, groups, has_w, has_b, wshape = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w, need_b = need_w and has_w, need_b and has_b
        red = [0] + list(range(2, g.dim()))
        gb = g.sum(red) if need_b else None
        if not (need_x or need_w):
            return None, None, gb, None, None
        if weight is None and has_w:
            weight = _placeholder(wshape, g)
        gx, gw, _ = torch.ops.aten.native_group_norm_backward(
            g.contiguous(), x, mean, rstd, weight, n, c, hw, groups, [need_x, need_w, False])
        return gx, gw, gb, None, None


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """``F.group_norm`` storing the input only if the input or weight needs a gradient."""
    return _GroupNorm.apply(x, weight, bias, num_groups, eps)


# ------------------------------------------------------------------------ activations
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into ``ceil(numel / 8)`` uint8 bytes (bit ``j`` of byte ``i`` is
    element ``8 i + j``)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                           device=mask.device)
    return (flat.reshape(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    n = 1
    for s in shape:
        n *= s
    return bits.reshape(-1)[:n].reshape(shape).bool()


class _ReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed):
        mask = x > 0
        ctx.packed = packed
        ctx.shape = x.shape
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(pack_bits(mask) if packed else mask)
        else:
            ctx.save_for_backward(None)
        return torch.relu(x)

    @staticmethod
    def backward(ctx, g):
        (m,) = ctx.saved_tensors
        if m is None:
            return None, None
        if ctx.packed:
            m = unpack_bits(m, ctx.shape)
        return g * m, None


def relu(x, packed: bool = False):
    """ReLU that stores a bool mask (``packed=False``, 1 B/element) or a 1-bit packed mask
    (``packed=True``, 1/8 B/element) instead of its output."""
    return _ReLU.apply(x, packed)


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, nd, kernel_size, stride, padding, dilation, ceil_mode):
        fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
        out, idx = fn(x, kernel_size, stride, padding, dilation, ceil_mode,
                      return_indices=True)
        ctx.x_shape = x.shape
        ctx.save_for_backward(idx.to(torch.int32) if ctx.needs_input_grad[0] else None)
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        if idx is None:
            return (None,) * 7
        xs = ctx.x_shape
        gx = g.new_zeros(xs[:2] + (int(torch.tensor(xs[2:]).prod()),))
        gx.scatter_add_(2, idx.long().reshape(xs[0], xs[1], -1), g.reshape(xs[0], xs[1], -1))
        return (gx.reshape(xs),) + (None,) * 6


def max_pool(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """Max pooling (1/2/3-d by ``x.dim()``) storing int32 argmax indices, not the input."""
    nd = x.dim() - 2
    return _MaxPool.apply(x, nd, kernel_size, stride if stride is not None else kernel_size,
                          padding, dilation, ceil_mode)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        mask = _dropout_mask(seed, x, p)
        ctx.seed, ctx.p, ctx.shape = seed, p, x.shape
        return x * mask / (1 - p)

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None
        mask = _dropout_mask(ctx.seed, g, ctx.p)
        return g * mask / (1 - ctx.p), None


def _dropout_mask(seed, like, p):
    gen = torch.Generator(device=like.device)
    gen.manual_seed(seed)
    return torch.rand(like.shape, generator=gen, device=like.device, dtype=torch.float32) >= p


def dropout(x, p: float = 0.5, training: bool = True):
    """Inverted dropout that stores only a seed; the mask is regenerated in backward."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return torch.zeros_like(x)
    return _Dropout.apply(x, p)
