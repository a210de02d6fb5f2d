"""PyTorch reference of row-centric training (LR-CNN OverL), independent of jaxmem.

``RowSequential(nn.Sequential(...), rows=N)`` runs a stack of ``nn.Conv2d`` / ``nn.ReLU`` /
``nn.Tanh`` / ``nn.MaxPool2d`` / ``nn.AvgPool2d`` / eval-mode ``nn.BatchNorm2d`` tile by tile
along H (NCHW): the forward runs each tile without building a graph, the backward recomputes
one tile at a time and pulls back its slice of the output gradient (per-row recomputation).
Halos are derived from the last layer back to the input; padding is applied only at the
true image border (semi-closed padding), so outputs and gradients equal ``torch.nn``.
Only the 'overlap' mode (OverL) is implemented here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowSequential", "tile_ranges"]


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _rowmap(m):
    """(k_eff, stride, pad_top) along H, or None for pointwise modules."""
    if isinstance(m, nn.Conv2d):
        if isinstance(m.padding, str):
            raise ValueError("torch_ref.rowconv: use integer Conv2d padding")
        k, s, d, p = _pair(m.kernel_size)[0], _pair(m.stride)[0], _pair(m.dilation)[0], \
            _pair(m.padding)[0]
        return d * (k - 1) + 1, s, p
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        k = _pair(m.kernel_size)[0]
        s = _pair(m.stride if m.stride is not None else m.kernel_size)[0]
        d = _pair(getattr(m, "dilation", 1))[0]
        if getattr(m, "ceil_mode", False):
            raise ValueError("torch_ref.rowconv: ceil_mode pooling is not supported")
        if isinstance(m, nn.AvgPool2d) and not m.count_include_pad:
            raise ValueError("torch_ref.rowconv: AvgPool2d needs count_include_pad=True")
        return d * (k - 1) + 1, s, _pair(m.padding)[0]
    if isinstance(m, (nn.ReLU, nn.Tanh, nn.Identity, nn.GELU, nn.Sigmoid)):
        return None
    if isinstance(m, nn.BatchNorm2d):
        if m.training:
            raise ValueError("torch_ref.rowconv: BatchNorm2d must be in eval mode (whole-image "
                             "statistics cannot be tiled); call .eval() or split the stack")
        return None
    raise TypeError(f"torch_ref.rowconv: unsupported module {m!r}")


def _heights(mods, H):
    hs = [H]
    for m in mods:
        rm = _rowmap(m)
        if rm is not None:
            k, s, p = rm
            H = (H + 2 * p - k) // s + 1
        hs.append(H)
    return hs


def tile_ranges(mods, H, rows):
    """Per tile: the (start, stop) output rows it computes at every layer (clipped)."""
    hs = _heights(mods, H)
    Ho = hs[-1]
    T = -(-Ho // rows)
    tiles = []
    for a in range(0, Ho, T):
        b = min(Ho, a + T)
        rngs = [None] * (len(mods) + 1)
        rngs[-1] = (a, b)
        for li in range(len(mods) - 1, -1, -1):
            a0, b0 = rngs[li + 1]
            rm = _rowmap(mods[li])
            if rm is None:
                r0, r1 = a0, b0
            else:
                k, s, p = rm
                r0, r1 = a0 * s - p, (b0 - 1) * s - p + k
            rngs[li] = (r0, r1)  # unclipped input rows of layer li
        tiles.append(rngs)
    return tiles, hs


class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mods, rows, *params):
        tiles, hs = tile_ranges(mods, x.shape[2], rows)
        outs = []
        with torch.no_grad():
            for rngs in tiles:
                outs.append(_forward_tile(mods, x, rngs, hs))
        ctx.mods, ctx.rows = mods, rows
        ctx.save_for_backward(x, *params)
        return torch.cat(outs, 2)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        mods = ctx.mods
        tiles, hs = tile_ranges(mods, x.shape[2], ctx.rows)
        dx = torch.zeros_like(x)
        dps = [torch.zeros_like(p) for p in params]
        leaves = [p for m in mods for p in m.parameters()]
        for rngs in tiles:
            a, b = rngs[-1]
            r0, r1 = max(0, rngs[0][0]), min(hs[0], rngs[0][1])
            with torch.enable_grad():
                xw = x[:, :, r0:r1].detach().requires_grad_(True)
                y = _forward_tile(mods, xw, rngs, hs, offset=r0)
                grads = torch.autograd.grad(y, [xw] + leaves, g[:, :, a:b], allow_unused=True)
            dx[:, :, r0:r1] += grads[0]
            for i, gp in enumerate(grads[1:]):
                if gp is not None:
                    dps[i] += gp
        return (dx, None, None, *dps)


def _forward_tile(mods, x, rngs, hs, offset=None):
    """Compute the tile: at every layer take exactly the clipped rows it needs."""
    r0, r1 = rngs[0]
    if offset is None:
        h = x[:, :, max(0, r0):min(hs[0], r1)]
    else:
        h = x
    for li, m in enumerate(mods):
        r0, r1 = rngs[li]
        a0, b0 = max(0, r0), min(hs[li], r1)
        assert h.shape[2] == b0 - a0, (li, h.shape, a0, b0)
        rm = _rowmap(m)
        if rm is None:
            h = m(h)
        else:
            top, bot = a0 - r0, r1 - b0
            pw = _pair(m.padding)[1]
            if isinstance(m, nn.Conv2d):
                h = F.conv2d(F.pad(h, (0, 0, top, bot)), m.weight, m.bias, m.stride, (0, pw),
                             m.dilation, m.groups)
            elif isinstance(m, nn.MaxPool2d):
                h = F.max_pool2d(F.pad(h, (0, 0, top, bot), value=float("-inf")),
                                 m.kernel_size, m.stride, (0, pw), m.dilation)
            else:
                h = F.avg_pool2d(F.pad(h, (0, 0, top, bot)), m.kernel_size, m.stride, (0, pw),
                                 count_include_pad=True)
            # the output holds rows rngs[li+1] (unclipped); crop to the next layer's map
            n0, n1 = rngs[li + 1]
            c0, c1 = max(0, n0), min(hs[li + 1], n1)
            h = h[:, :, c0 - n0: h.shape[2] - (n1 - c1)]
    return h


class RowSequential(nn.Module):
    """Row-tiled wrapper of an ``nn.Sequential`` (same parameters, exact gradients)."""

    def __init__(self, seq: nn.Sequential, rows: int = 1):
        super().__init__()
        self.seq = seq
        self.rows = rows

    def forward(self, x):
        mods = list(self.seq)
        for m in mods:
            _rowmap(m)
        if self.rows == 1:
            return self.seq(x)
        hs = _heights(mods, x.shape[2])
        if self.rows > hs[-1]:
            raise ValueError(f"rows={self.rows} is more than the {hs[-1]} output rows")
        return _RowFn.apply(x, mods, self.rows, *[p for m in mods for p in m.parameters()])
