"""PyTorch reference of row-centric training (LR-CNN OverL and 2PS), independent of jaxmem.

``RowSequential(nn.Sequential(...), rows=N, mode="overlap" | "share")`` runs a stack of
``nn.Conv2d`` / ``nn.ReLU`` / ``nn.Tanh`` / ``nn.GELU`` / ``nn.Sigmoid`` / ``nn.MaxPool2d`` /
``nn.AvgPool2d`` / eval-mode ``nn.BatchNorm2d`` / :class:`Residual` blocks tile by tile
along H (NCHW). The forward runs each tile without building a graph; the backward
recomputes one tile at a time with grad enabled (per-row recomputation).

The stack is a DAG of *maps* (the input, every layer output, every residual sum). Along H
every op maps output row ``j`` to input rows ``[j*s - p, j*s - p + k_eff)`` (pointwise ops
and the residual add: ``k_eff = s = 1, p = 0``). Rows outside ``[0, H)`` are the op's
padding, applied only at the true image border (semi-closed padding), never at a tile
border, so outputs and gradients equal ``torch.nn``.

* ``overlap`` (OverL): tile ``i`` owns output rows ``[i*T, (i+1)*T)``; walking the DAG from
  the output back, each map's row range is the hull of what its consumers need. Every tile
  is computed independently from its slice of the input; halo rows are recomputed.
* ``share`` (2PS): every map is a stream. ``own_hi[m][i]`` is the highest row of map ``m``
  that tiles ``0..i`` need (from the output back); tile ``i`` computes exactly the *new* rows
  ``[own_hi[m][i-1], own_hi[m][i])`` of every map, so no row is computed twice. The rows of
  ``m`` that a later tile still reads (``[keep_lo[m][i], own_hi[m][i])``, the shared boundary
  rows) are carried to the next tile. The forward stores only these carries (a few rows
  per map and tile boundary, no graph). The backward runs tiles from last to first: it
  recomputes tile ``i`` from its saved carry-in and its new input rows, pulls back its
  slice of the output gradient *plus* the gradient of its carry-out (received from tile
  ``i+1``), and hands the gradient of its carry-in to tile ``i-1``. This is exactly the
  chain rule of the untiled stack, so no gradient is averaged or approximated.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODES", "Residual", "RowSequential", "tile_ranges"]

MODES = ("overlap", "share")


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class Residual(nn.Module):
    """``branch(x) + shortcut(x)`` (``shortcut=None``: identity), as ``rowconv.Residual``."""

    def __init__(self, branch: nn.Sequential, shortcut: nn.Sequential | None = None):
        super().__init__()
        self.branch = branch if isinstance(branch, nn.Sequential) else nn.Sequential(*branch)
        if shortcut is not None and not isinstance(shortcut, nn.Sequential):
            shortcut = nn.Sequential(*shortcut)
        self.shortcut = shortcut

    def forward(self, x):
        return self.branch(x) + (x if self.shortcut is None else self.shortcut(x))


def _rowmap(m):
    """(k_eff, stride, pad_top) along H, or None for pointwise modules."""
    if isinstance(m, nn.Conv2d):
        if isinstance(m.padding, str):
            raise TypeError("torch_ref.rowconv: use integer Conv2d padding, not a string")
        if m.padding_mode != "zeros":
            raise ValueError("torch_ref.rowconv: Conv2d padding_mode must be 'zeros'")
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
    if isinstance(m, Residual):
        for sub in list(m.branch) + list(m.shortcut or []):
            _rowmap(sub)
        return None
    raise TypeError(f"torch_ref.rowconv: unsupported module {m!r}; allowed: Conv2d, "
                    "MaxPool2d, AvgPool2d, ReLU/Tanh/GELU/Sigmoid/Identity, eval BatchNorm2d, "
                    "torch_ref.rowconv.Residual")


# ----------------------------------------------------------------------------- the DAG


@dataclasses.dataclass
class _Op:
    kind: str  # "layer" | "add"
    module: object
    ins: list  # input map ids
    out: int
    k: int = 1
    s: int = 1
    p: int = 0


def _build(mods, H):
    """Ops in topological order and the height of every map (map 0 is the input)."""
    heights = [H]
    ops: list[_Op] = []

    def chain(seq, m_in):
        cur = m_in
        for m in seq:
            if isinstance(m, Residual):
                b = chain(list(m.branch), cur)
                s = cur if m.shortcut is None else chain(list(m.shortcut), cur)
                if heights[b] != heights[s]:
                    raise ValueError("torch_ref.rowconv: Residual branch and shortcut heights "
                                     f"differ ({heights[b]} vs {heights[s]})")
                heights.append(heights[b])
                ops.append(_Op("add", None, [b, s], len(heights) - 1))
            else:
                rm = _rowmap(m)
                k, s, p = rm if rm is not None else (1, 1, 0)
                Ho = (heights[cur] + 2 * p - k) // s + 1
                if Ho < 1:
                    raise ValueError(f"torch_ref.rowconv: {m!r} gives an empty output")
                heights.append(Ho)
                ops.append(_Op("layer", m, [cur], len(heights) - 1, k, s, p))
            cur = len(heights) - 1
        return cur

    chain(mods, 0)
    return ops, heights


def _need(op, H_in, o0, o1):
    """Clipped input rows [a, b) the op needs for output rows [o0, o1) (empty: (0, 0))."""
    if o1 <= o0:
        return None
    return max(0, o0 * op.s - op.p), min(H_in, (o1 - 1) * op.s - op.p + op.k)


def tile_ranges(mods, H, rows, mode="overlap"):
    """Static per-tile plan.

    Returns ``(ops, heights, plan)``. overlap: ``plan[i][m] = (lo, hi)``, the rows of map
    ``m`` tile ``i`` computes. share: ``plan[i][m] = (keep_lo, lo, hi)``: tile ``i`` computes
    the new rows ``[lo, hi)`` of ``m`` and carries ``[keep_lo, hi)`` to tile ``i+1``.
    """
    ops, heights = _build(list(mods), H)
    nmap = len(heights)
    Ho = heights[-1]
    T = -(-Ho // rows)
    outs = [(a, min(Ho, a + T)) for a in range(0, Ho, T)]
    if mode == "overlap":
        plan = []
        for a, b in outs:
            rng = [None] * nmap
            rng[-1] = (a, b)
            for op in reversed(ops):
                if rng[op.out] is None:
                    continue
                for m_in in op.ins:
                    nd = _need(op, heights[m_in], *rng[op.out])
                    if nd is not None:
                        r = rng[m_in]
                        rng[m_in] = nd if r is None else (min(r[0], nd[0]), max(r[1], nd[1]))
            plan.append(rng)
        return ops, heights, plan
    if mode != "share":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    own = []  # own[i][m]: rows [0, own) of m are computed by tiles 0..i
    prev = [0] * nmap
    for _, b in outs:
        hi = [0] * nmap
        hi[-1] = b
        for op in reversed(ops):
            for m_in in op.ins:
                nd = _need(op, heights[m_in], 0, hi[op.out])
                if nd is not None:
                    hi[m_in] = max(hi[m_in], nd[1])
        hi = [max(u, v) for u, v in zip(hi, prev)]
        own.append(hi)
        prev = hi
    n = len(outs)
    # first row of each map that tile j reads
    start = [[None] * nmap for _ in range(n)]
    for j in range(n):
        for op in ops:
            o0 = own[j - 1][op.out] if j else 0
            for m_in in op.ins:
                nd = _need(op, heights[m_in], o0, own[j][op.out])
                if nd is not None and nd[1] > nd[0]:
                    cur = start[j][m_in]
                    start[j][m_in] = nd[0] if cur is None else min(cur, nd[0])
    plan = []
    for i in range(n):
        row = []
        for m in range(nmap):
            later = [start[j][m] for j in range(i + 1, n) if start[j][m] is not None]
            keep = min([own[i][m]] + later)
            row.append((keep, own[i - 1][m] if i else 0, own[i][m]))
        plan.append(row)
    return ops, heights, plan


# ----------------------------------------------------------------------------- one tile


class _Buf:
    """Rows [lo, lo + t.shape[2]) of one map (t None: no rows)."""

    def __init__(self, t, lo):
        self.t, self.lo = t, lo

    def rows(self, a, b):
        if b <= a:
            return None
        assert self.t is not None and self.lo <= a and b <= self.lo + self.t.shape[2], \
            (a, b, self.lo, None if self.t is None else self.t.shape)
        return self.t[:, :, a - self.lo:b - self.lo]


def _cat(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return torch.cat([a, b], 2)


def _eval_op(op, bufs, heights, o0, o1):
    """Output rows [o0, o1) of ``op`` from its input buffers (None if empty)."""
    if o1 <= o0:
        return None
    if op.kind == "add":
        return bufs[op.ins[0]].rows(o0, o1) + bufs[op.ins[1]].rows(o0, o1)
    m = op.module
    H = heights[op.ins[0]]
    r0, r1 = o0 * op.s - op.p, (o1 - 1) * op.s - op.p + op.k
    a0, b0 = max(0, r0), min(H, r1)
    h = bufs[op.ins[0]].rows(a0, b0)
    if _rowmap(m) is None:
        return m(h)
    top, bot = a0 - r0, r1 - b0
    pw = _pair(m.padding)[1]
    if isinstance(m, nn.Conv2d):
        y = F.conv2d(F.pad(h, (0, 0, top, bot)), m.weight, m.bias, m.stride, (0, pw),
                     m.dilation, m.groups)
    elif isinstance(m, nn.MaxPool2d):
        y = F.max_pool2d(F.pad(h, (0, 0, top, bot), value=float("-inf")),
                         m.kernel_size, m.stride, (0, pw), m.dilation)
    else:
        y = F.avg_pool2d(F.pad(h, (0, 0, top, bot)), m.kernel_size, m.stride, (0, pw),
                         count_include_pad=True)
    assert y.shape[2] == o1 - o0, (y.shape, o0, o1)
    return y


def _overlap_tile(ops, heights, rng, x_rows):
    bufs = {0: _Buf(x_rows, rng[0][0])}
    for op in ops:
        r = rng[op.out]
        if r is not None:
            bufs[op.out] = _Buf(_eval_op(op, bufs, heights, *r), r[0])
    return bufs[len(heights) - 1].t


def _share_tile(ops, heights, row, prev_row, carry_in, x_new):
    """Tile of 2PS: (new output rows, carry-out {map: rows [keep_lo, hi)})."""
    def buf(m, new):
        lo = prev_row[m][0] if prev_row is not None else 0
        return _Buf(_cat(carry_in.get(m), new), lo)

    bufs = {0: buf(0, x_new)}
    for op in ops:
        _, o0, o1 = row[op.out]
        bufs[op.out] = buf(op.out, _eval_op(op, bufs, heights, o0, o1))
    carry = {}
    for m, (keep, _, hi) in enumerate(row):
        if hi > keep:
            carry[m] = bufs[m].rows(keep, hi)
    last = len(heights) - 1
    _, o0, o1 = row[last]
    carry.pop(last, None)
    return bufs[last].rows(o0, o1), carry


# ----------------------------------------------------------------------------- autograd


def _leaves(mods):
    return [p for m in mods for p in m.parameters()]


class _OverlapFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mods, rows, *params):
        ops, heights, plan = tile_ranges(mods, x.shape[2], rows, "overlap")
        with torch.no_grad():
            outs = [_overlap_tile(ops, heights, rng, x[:, :, rng[0][0]:rng[0][1]])
                    for rng in plan]
        ctx.mods, ctx.rows = mods, rows
        ctx.save_for_backward(x, *params)
        return torch.cat(outs, 2)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        ops, heights, plan = tile_ranges(ctx.mods, x.shape[2], ctx.rows, "overlap")
        leaves = _leaves(ctx.mods)
        dx = torch.zeros_like(x)
        dps = [torch.zeros_like(p) for p in params]
        for rng in plan:
            (r0, r1), (a, b) = rng[0], rng[-1]
            with torch.enable_grad():
                xw = x[:, :, r0:r1].detach().requires_grad_(True)
                y = _overlap_tile(ops, heights, rng, xw)
                grads = torch.autograd.grad(y, [xw] + leaves, g[:, :, a:b], allow_unused=True)
            dx[:, :, r0:r1] += grads[0]
            for i, gp in enumerate(grads[1:]):
                if gp is not None:
                    dps[i] += gp
        return (dx, None, None, *dps)


class _ShareFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mods, rows, *params):
        ops, heights, plan = tile_ranges(mods, x.shape[2], rows, "share")
        outs, carries = [], []
        carry: dict = {}
        with torch.no_grad():
            for i, row in enumerate(plan):
                carries.append(carry)
                _, lo, hi = row[0]
                y, c = _share_tile(ops, heights, row, plan[i - 1] if i else None, carry,
                                   x[:, :, lo:hi] if hi > lo else None)
                outs.append(y)
                # clone: a view would keep the whole tile buffer alive
                carry = {m: t.clone() for m, t in c.items()}
        # carries go through save_for_backward so saved-tensor hooks (and
        # torch_ref.measure.saved_bytes) see them
        ctx.carry_keys = [list(c) for c in carries]
        ctx.mods, ctx.rows, ctx.n_params = mods, rows, len(params)
        ctx.save_for_backward(x, *params, *[t for c in carries for t in c.values()])
        return torch.cat([o for o in outs if o is not None], 2)

    @staticmethod
    def backward(ctx, g):
        x, *rest = ctx.saved_tensors
        params, flat = rest[:ctx.n_params], iter(rest[ctx.n_params:])
        carries = [{m: next(flat) for m in keys} for keys in ctx.carry_keys]
        ops, heights, plan = tile_ranges(ctx.mods, x.shape[2], ctx.rows, "share")
        leaves = _leaves(ctx.mods)
        dx = torch.zeros_like(x)
        dps = [torch.zeros_like(p) for p in params]
        g_carry: dict = {}  # gradient of tile i's carry-out, from tile i+1
        for i in range(len(plan) - 1, -1, -1):
            row = plan[i]
            _, lo, hi = row[0]
            _, a, b = row[-1]
            with torch.enable_grad():
                cin = {m: t.detach().requires_grad_(True) for m, t in carries[i].items()}
                xw = x[:, :, lo:hi].detach().requires_grad_(True) if hi > lo else None
                y, cout = _share_tile(ops, heights, row, plan[i - 1] if i else None, cin, xw)
                outs, gouts = [], []
                if y is not None:
                    outs.append(y)
                    gouts.append(g[:, :, a:b])
                for m, gc in g_carry.items():
                    outs.append(cout[m])
                    gouts.append(gc)
                cin_keys = list(cin)
                inputs = ([xw] if xw is not None else []) + [cin[m] for m in cin_keys] + leaves
                grads = torch.autograd.grad(outs, inputs, gouts, allow_unused=True) \
                    if outs else [None] * len(inputs)
            if xw is not None:
                if grads[0] is not None:
                    dx[:, :, lo:hi] += grads[0]
                grads = grads[1:]
            g_carry = {}
            for m, gc in zip(cin_keys, grads[:len(cin_keys)]):
                g_carry[m] = gc if gc is not None else torch.zeros_like(cin[m])
            for j, gp in enumerate(grads[len(cin_keys):]):
                if gp is not None:
                    dps[j] += gp
        # map 0's carry-in of tile 0 is empty: every input-row gradient is in dx
        return (dx, None, None, *dps)


class RowSequential(nn.Module):
    """Row-tiled wrapper of an ``nn.Sequential`` (same parameters, exact gradients).

    ``mode``: 'overlap' (OverL, independent tiles with recomputed halos) or 'share' (2PS,
    boundary rows carried from tile to tile, nothing recomputed in the forward).
    """

    def __init__(self, seq: nn.Sequential, rows: int = 1, mode: str = "overlap"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        self.seq = seq
        self.rows = rows
        self.mode = mode

    def forward(self, x):
        mods = list(self.seq)
        for m in mods:
            _rowmap(m)
        if self.rows == 1:
            return self.seq(x)
        _, heights = _build(mods, x.shape[2])
        if self.rows > heights[-1]:
            raise ValueError(f"rows={self.rows} is more than the {heights[-1]} output rows")
        fn = _OverlapFn if self.mode == "overlap" else _ShareFn
        return fn.apply(x, mods, self.rows, *_leaves(mods))
