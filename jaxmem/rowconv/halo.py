"""Halo analysis: which input rows each row tile needs, layer by layer.

Row map of one layer (see ``layers.py``): output row ``j`` needs input rows
``[j*s - lo, j*s - lo + k_eff)``. For a tile of ``L`` consecutive output rows starting at
row ``a`` the layer therefore needs ``L_in = (L-1)*s + k_eff`` input rows starting at
``a*s - lo``. Walking from the last layer back to the input composes these maps. Every
start is affine in the tile's output start ``o``: ``start = S*o + c`` with ``S`` the product
of the strides above, so one static plan serves every tile of a ``lax.scan`` (only ``o`` is
dynamic). A residual block needs the hull of what its branch and its shortcut need.

Rows outside ``[0, H)`` of a layer's input are the layer's padding: they are set to the
pad value (0, or -inf for max pooling) by masking on the true image border only; a tile
border is never padded (the paper's *semi-closed padding*).

Two partitionings (the paper's Sec. IV):

* **overlap** (OverL): tile ``i`` covers output rows ``[o_i, o_i + T)``,
  ``T = ceil(H_out / N)``, ``o_i = min(i*T, H_out - T)``; every tile recomputes its whole
  receptive field (the halo rows are computed by both neighbours).
* **share** (2PS): layers are streams. Tile ``i`` feeds ``T_in`` *new* rows into a layer
  whose input stream is offset by ``e`` (it delivers rows ``[i*T_in + e, (i+1)*T_in + e)``);
  the layer keeps the last ``h`` input rows of the previous tile in the scan carry and emits
  ``T_out = T_in / s`` new output rows with offset
  ``c = min(0, floor((e + lo + s - k_eff) / s))``, ``h = e - c*s + lo``. Offsets are <= 0
  (a lag), so the first tile's carried rows lie above the image (pure padding) and no
  row is ever computed twice. The output stream starts at ``e_L <= 0``; ``N`` tiles of
  ``T = ceil((H_out - e_L)/N)`` rows cover ``[0, H_out)``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

from jaxmem._prims.tree import walk

from .layers import Checkpoint, Layer, Residual, Shape, _check_layer, _RowMap

__all__ = ["HaloReport", "halos"]  # the rest is rowconv's internal geometry

# ----------------------------------------------------------------------------- static geometry


def check_shape(shape: Sequence[int], name: str = "input_shape") -> Shape:
    """An NHWC shape as a tuple of 4 ints (batch >= 0, height/width/channels >= 1)."""
    try:
        t = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be an NHWC shape (4 ints), got {shape!r}") from None
    if len(t) != 4 or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in t):
        raise ValueError(f"{name} must be an NHWC shape (4 ints), got {shape!r}")
    t = tuple(int(d) for d in t)
    if t[0] < 0 or min(t[1:]) < 1:
        raise ValueError(f"{name} {t} (NHWC) needs height, width and channels >= 1")
    return t



@dataclasses.dataclass
class _Geom:
    """Static geometry of one layer on a given input shape."""

    layer: Any
    in_shape: tuple
    out_shape: tuple
    rowmap: _RowMap | None = None  # None for Residual
    pad_w: tuple = (0, 0)
    branch: list | None = None
    shortcut: list | None = None  # None: identity
    path: tuple = ()  # index path in the full layer list (dropout keys)

    @property
    def spatial(self):
        rm = self.rowmap
        return rm is not None and (rm.keff > 1 or rm.stride > 1 or rm.lo or rm.hi)


def geometry(layers: Sequence[Layer], input_shape: Sequence[int], path: tuple = (),
             start: int = 0) -> list[_Geom]:
    """Per-layer static geometry (shapes, row maps); Checkpoint markers are not allowed."""
    out = []
    shape = check_shape(input_shape) if not path else tuple(input_shape)
    for i, layer in enumerate(layers, start):
        _check_layer(layer, f"layers[{i}]")
        if isinstance(layer, Checkpoint):
            raise ValueError("Checkpoint markers are handled by tiled.split_segments")
        if isinstance(layer, Residual):
            b = geometry(layer.branch, shape, path + (i, 0))
            s = None if layer.shortcut is None else geometry(layer.shortcut, shape, path + (i, 1))
            bo = b[-1].out_shape if b else shape
            so = shape if not s else s[-1].out_shape
            if bo != so:
                raise ValueError(f"layers[{i}] Residual: branch output {bo} != shortcut {so}")
            out.append(_Geom(layer, shape, bo, None, (0, 0), b, s, path + (i,)))
            shape = bo
        else:
            rm, pad_w, oshape = layer.geometry(shape)
            out.append(_Geom(layer, shape, oshape, rm, pad_w, path=path + (i,)))
            shape = oshape
    return out


def total_stride(geoms: Sequence[_Geom]) -> int:
    s = 1
    for g in geoms:
        if g.rowmap is not None:
            s *= g.rowmap.stride
        else:
            s *= total_stride(g.branch)
    return s


# ----------------------------------------------------------------------------- overlap plan


@dataclasses.dataclass
class _Iv:
    """Rows ``[S*o + c, S*o + c + L)`` of some map, for the tile starting at output row o."""

    S: int
    c: int
    L: int

    def at(self, o):
        return self.S * o + self.c


@dataclasses.dataclass
class _OvNode:
    geom: _Geom
    iv_in: _Iv
    iv_out: _Iv
    branch: list | None = None
    shortcut: list | None = None
    off_b: int = 0
    off_s: int = 0


def _need(geoms, iv_out: _Iv):
    """Backward pass: per-layer plan nodes and the interval the sequence needs."""
    nodes = []
    iv = iv_out
    for g in reversed(geoms):
        if g.rowmap is not None:
            rm = g.rowmap
            iv_in = _Iv(iv.S * rm.stride, iv.c * rm.stride - rm.lo, (iv.L - 1) * rm.stride + rm.keff)
            nodes.append(_OvNode(g, iv_in, iv))
        else:
            bn, ivb = _need(g.branch, iv)
            if g.shortcut is None:
                sn, ivs = None, iv
            else:
                sn, ivs = _need(g.shortcut, iv)
            assert ivb.S == ivs.S
            c0 = min(ivb.c, ivs.c)
            end = max(ivb.c + ivb.L, ivs.c + ivs.L)
            iv_in = _Iv(ivb.S, c0, end - c0)
            nodes.append(_OvNode(g, iv_in, iv, bn, sn, ivb.c - c0, ivs.c - c0))
        iv = iv_in
    nodes.reverse()
    return nodes, iv


def overlap_plan(geoms: Sequence[_Geom], tile_rows: int) -> tuple[list[_OvNode], _Iv]:
    """(nodes, input interval) for tiles of ``tile_rows`` output rows."""
    return _need(geoms, _Iv(1, 0, tile_rows))


def overlap_starts(h_out: int, rows: int) -> tuple[int, list[int]]:
    """Tile size T and the start row of each of the ``rows`` tiles (last one shifted up)."""
    T = -(-h_out // rows)
    n = -(-h_out // T)
    return T, [min(i * T, h_out - T) for i in range(n)]


# ----------------------------------------------------------------------------- share plan


@dataclasses.dataclass
class _ShNode:
    geom: _Geom
    e_in: int  # input stream offset
    T_in: int
    c_out: int  # output stream offset
    T_out: int
    carry: int = 0  # rows kept from the previous tile (the shared boundary rows)
    woff: int = 0  # window offset inside concat(carry, new)
    win: int = 0  # window length
    slot: int = -1  # index of this node's carry in the flat carry list
    branch: list | None = None
    shortcut: list | None = None
    delay_b: int = 0
    delay_s: int = 0
    slot_b: int = -1
    slot_s: int = -1


def _stream(geoms, e: int, T_in: int, slots: list):
    nodes = []
    for g in geoms:
        if g.rowmap is not None:
            rm = g.rowmap
            if T_in % rm.stride:
                raise AssertionError("tile rows must be a multiple of the stride")
            T_out = T_in // rm.stride
            if g.spatial:
                c = min(0, math.floor((e + rm.lo + rm.stride - rm.keff) / rm.stride))
                h = e - c * rm.stride + rm.lo
                win = (T_out - 1) * rm.stride + rm.keff
                node = _ShNode(g, e, T_in, c, T_out, max(h, 0), max(-h, 0), win)
                if node.carry > 0:
                    node.slot = len(slots)
                    slots.append(("rows", g.in_shape, node.carry))
            else:
                node = _ShNode(g, e, T_in, e, T_out)
            nodes.append(node)
            e, T_in = node.c_out, T_out
        else:
            bn, cb, Tb = _stream(g.branch, e, T_in, slots)
            if g.shortcut is None:
                sn, cs, Ts = None, e, T_in
            else:
                sn, cs, Ts = _stream(g.shortcut, e, T_in, slots)
            cm = min(cb, cs)
            node = _ShNode(g, e, T_in, cm, Tb, branch=bn, shortcut=sn,
                          delay_b=cb - cm, delay_s=cs - cm)
            if node.delay_b:
                node.slot_b = len(slots)
                slots.append(("rows", g.out_shape, node.delay_b))
            if node.delay_s:
                node.slot_s = len(slots)
                slots.append(("rows", g.out_shape, node.delay_s))
            nodes.append(node)
            e, T_in = cm, Tb
    return nodes, e, T_in


def share_plan(geoms: Sequence[_Geom], rows: int
               ) -> tuple[list[_ShNode], list, int, int, int, int]:
    """(nodes, carry slots, T_out, n_tiles, e_out, T_in) for ``rows`` tiles in share mode."""
    S = total_stride(geoms)
    probe_slots: list = []
    _, e_out, _ = _stream(geoms, 0, S, probe_slots)  # offsets do not depend on T
    h_out = geoms[-1].out_shape[1]
    T = -(-(h_out - e_out) // rows)
    slots: list = []
    nodes, e2, T2 = _stream(geoms, 0, T * S, slots)
    assert e2 == e_out and T2 == T
    n = -(-(h_out - e_out) // T)
    return nodes, slots, T, n, e_out, T * S


# ----------------------------------------------------------------------------- public report


@dataclasses.dataclass
class HaloReport:
    """Result of :func:`halos`.

    Attributes:
      mode: 'overlap' or 'share'.
      rows: number of tiles.
      tile_rows: output rows per tile.
      input_rows: per tile, the (start, stop) rows of the *input image* it reads
        (clipped to the image; the rest is border padding).
      layer_rows: per top-level layer, per tile, the (start, stop) rows of that layer's
        input the tile computes on (unclipped: negative/over-size rows are padding).
      halo_rows: per top-level layer, rows a tile needs beyond its own share of that
        layer's input (overlap: recomputed; share: carried from the previous tile).
      receptive_field: input rows that influence one output row.
      max_rows: largest N for which every tile still covers its own halo at the input.
    """

    mode: str
    rows: int
    tile_rows: int
    input_rows: list
    layer_rows: list
    halo_rows: list
    receptive_field: int
    max_rows: int


def receptive_field(geoms: Sequence[_Geom]) -> int:
    _, iv = overlap_plan(geoms, 1)
    return iv.L


def _max_rows(geoms, mode: str = "overlap") -> int:
    """Largest row count whose input tile is at least as tall as its halo."""
    h_out = geoms[-1].out_shape[1]
    lo, hi = 1, h_out  # the check is monotone in n: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            _check_rows(geoms, mid, mode)
            lo = mid
        except ValueError:
            hi = mid - 1
    return lo


def as_rows(v: Any, name: str = "rows") -> int:
    """``v`` as a Python int >= 1 (NumPy integers accepted); TypeError for bools, floats and
    anything else, ValueError below 1."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 (the number of row tiles), got {v!r} "
                        f"({type(v).__name__})")
    if int(v) < 1:
        raise ValueError(f"{name} must be an int >= 1 (the number of row tiles), got {int(v)}")
    return int(v)


def _check_rows(geoms, rows: int, mode: str):
    h_out = geoms[-1].out_shape[1]
    rows = as_rows(rows)
    if rows > h_out:
        shp = geoms[0].in_shape
        raise ValueError(
            f"rows={rows} is more than the {h_out} output rows of this stack (its input of shape "
            f"{shp} is read as NHWC: height {shp[1]}, width {shp[2]}, {shp[3]} channels); use "
            f"rows <= {h_out}, or transpose an NCHW input to NHWC")
    if rows == 1:
        return
    S = total_stride(geoms)
    if mode == "overlap":
        T, _ = overlap_starts(h_out, rows)
        _, iv = overlap_plan(geoms, T)
        own = T * S
        halo = iv.L - own
        if own < halo:
            raise ValueError(
                f"rows={rows}: each tile owns {own} input rows but needs {halo} halo rows "
                f"(receptive field {receptive_field(geoms)}); the tile is smaller than its "
                "halo, so recomputation would exceed the saving. Use fewer rows, or cut the "
                "stack into segments with rowconv.Checkpoint()")
    elif mode == "share":
        nodes, slots, T, n, e_out, T_in = share_plan(geoms, rows)
        for nd in walk(nodes):
            if nd.carry > nd.T_in:
                raise ValueError(
                    f"rows={rows}: a layer carries {nd.carry} boundary rows but its tile has only "
                    f"{nd.T_in} new rows (the tile is smaller than its halo). Use fewer rows, "
                    "or cut the stack into segments with rowconv.Checkpoint()")
    else:
        raise ValueError(f"mode must be 'overlap' or 'share', got {mode!r}")


def halos(layers: Sequence[Layer], input_shape: Sequence[int], rows: int,
          mode: str = "overlap") -> HaloReport:
    """Per-tile row ranges of a (checkpoint-free) layer stack; see the module docstring."""
    rows = as_rows(rows)
    geoms = geometry(layers, input_shape)
    if not geoms:
        raise ValueError("layers is empty")
    _check_rows(geoms, rows, mode)
    H = geoms[0].in_shape[1]
    h_out = geoms[-1].out_shape[1]
    rf = receptive_field(geoms)
    if mode == "overlap":
        T, starts = overlap_starts(h_out, rows)
        nodes, iv = overlap_plan(geoms, T)
        inp = [(max(0, iv.at(o)), min(H, iv.at(o) + iv.L)) for o in starts]
        layer_rows = [[(nd.iv_in.at(o), nd.iv_in.at(o) + nd.iv_in.L) for o in starts]
                      for nd in nodes]
        halo = [nd.iv_in.L - nd.iv_in.S * T for nd in nodes]
    else:
        nodes, slots, T, n, e_out, T_in = share_plan(geoms, rows)
        inp = [(max(0, i * T_in), min(H, (i + 1) * T_in)) for i in range(n)]
        layer_rows = []
        halo = []
        for nd in nodes:
            if nd.branch is None and nd.geom.spatial:
                rm = nd.geom.rowmap
                st = nd.c_out * rm.stride - rm.lo
                layer_rows.append([(i * nd.T_in + st, i * nd.T_in + st + nd.win)
                                   for i in range(n)])
            else:
                layer_rows.append([(i * nd.T_in + nd.e_in, (i + 1) * nd.T_in + nd.e_in)
                                   for i in range(n)])
            halo.append(nd.carry)
    return HaloReport(mode, rows, T, inp, layer_rows, halo, rf, _max_rows(geoms, mode))
