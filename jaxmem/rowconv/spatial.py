"""Spatial parallelism: the image height sharded over devices, halo rows exchanged.

Each of ``n`` devices on a mesh axis holds ``T_in = H / n`` consecutive rows of the input.
The stack is cut into segments at ``Checkpoint()`` markers; for every segment each device
computes its own block of ``T_out = T_in / S`` output rows (``S`` the segment's stride
product) and needs, by the composed row maps of ``halo.py``, the input rows

    [d*T_in + c,  d*T_in + c + L)        L = (T_out - 1)*S + R

(``c <= 0`` the top paddings composed through the strides, ``c = -sum_l lo_l * S_<l``
with ``S_<l`` the stride product before layer ``l``; ``R`` the receptive field,
``R = 1 + sum_l (k_eff,l - 1) * S_<l`` for a chain; a residual block takes the hull of its
branches). Before the segment every device therefore receives

    top    = max(0, -c)             rows: the *last* ``top`` rows of device d-1,
    bottom = max(0, c + L - T_in)   rows: the *first* ``bottom`` rows of device d+1,

each by one ``lax.ppermute`` over the axis (the receptive-field growth of the whole
segment is exchanged once, not per conv). Device 0 and device n-1 receive zeros; those rows
lie outside the image and every layer masks them to its own padding value (0, or -inf for
max pooling), exactly as the untiled layer pads: nothing is padded for VALID. On its window
each device then runs the row tiling of ``rowconv.apply`` (OverL, ``rows`` sub-tiles of its
block, one ``custom_vjp``). The backward is exact: the transpose of a ``ppermute`` is the
reverse ``ppermute``, so a halo row's cotangent is added on the device that owns the row;
parameters enter as device-varying values (``lax.pcast``) whose transpose is a ``psum`` over
the axis, i.e. the weight gradients are summed over the devices.

Memory per device: the residuals of a segment are its input block and the two halos
(never a concatenated copy of the block), and one sub-tile's activations at a time; the
parameters (and their gradients) are replicated.

Layout: the map after a segment is held in blocks of ``T_out`` rows per device; when the
real height is smaller (VALID convolutions shrink it), the rows ``>= H_out`` of the last
blocks are padding that the next layer masks and :func:`spatial_apply` drops.

Communication of one step (per device, ``B`` local batch, ``W``/``C`` the segment input's
width/channels, ``b`` bytes per element): forward, one collective-permute per non-zero
``top`` and per non-zero ``bottom`` of every segment, ``(top + bottom) * B*W*C*b`` bytes;
the backward repeats it (the reverse permutes) for every segment whose input is
differentiated. :meth:`SpatialPlan.permutes` returns these numbers; no all-gather of the
image is ever needed.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmem._prims.ties import varying_axes
from jaxmem._prims.ties import zeros_after as _zeros_after

from . import halo as H
from .layers import check_params
from .tiled import _mask_rows, _ov_seq, _per_segment, check_input, check_tileable, split_segments

__all__ = ["SegmentHalo", "SpatialPlan", "spatial_apply", "spatial_local", "spatial_plan"]


@dataclasses.dataclass(frozen=True)
class SegmentHalo:
    """Halo geometry of one segment on one device (all sizes in rows of the segment input).

    Attributes:
      start, stop: the segment's layer index range in the full list.
      in_shape, out_shape: global NHWC shapes (real heights) of the segment input/output.
      local_in: rows per device of the input (``T_in``); local_out: of the output (``T_out``).
      stride: the segment's stride product ``S`` (``local_in == S * local_out``).
      offset: ``c``, first input row needed by device d is ``d*T_in + c``.
      window: ``L``, input rows a device computes on (its block plus both halos).
      top, bottom: halo rows received from device d-1 and from device d+1.
    """

    start: int
    stop: int
    in_shape: tuple
    out_shape: tuple
    local_in: int
    local_out: int
    stride: int
    offset: int
    window: int
    top: int
    bottom: int

    def permute_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes one device receives for this segment's halos in one direction."""
        _, _, W, C = self.in_shape
        return (self.top + self.bottom) * batch * W * C * itemsize


@dataclasses.dataclass(frozen=True)
class SpatialPlan:
    """Per-segment halos of a stack whose input height is split over ``devices``."""

    devices: int
    segments: tuple
    out_shape: tuple  # global output shape (real height)
    out_rows: int  # rows per device of the output blocks (devices * out_rows >= height)

    def permutes(self, batch: int, itemsize: int = 4, grad: bool = True,
                 grad_input: bool = True) -> tuple[int, int]:
        """(count, bytes per device) of the collective-permutes of one call.

        ``batch``: the per-device batch. ``grad``: a forward + backward step (False: the
        forward only). ``grad_input``: the stack's input is differentiated (otherwise the
        first segment's halos are not sent back).
        """
        count = nbytes = 0
        for i, s in enumerate(self.segments):
            k = int(s.top > 0) + int(s.bottom > 0)
            b = s.permute_bytes(batch, itemsize)
            reps = 1 + int(grad and (grad_input or i > 0))
            count += reps * k
            nbytes += reps * b
        return count, nbytes


def _as_devices(devices) -> int:
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise ValueError(f"devices must be an int >= 1 (the size of the spatial mesh axis), "
                         f"got {devices!r}")
    return int(devices)


def spatial_plan(layers: Sequence[Any], input_shape: Sequence[int], devices: int) -> SpatialPlan:
    """Halo rows of every segment when the input height is split over ``devices``.

    Raises ValueError when the height does not split evenly down the stack
    (``H % (devices * stride product)``), when a segment would need rows from beyond the
    neighbouring devices (halo larger than a device's block), or when a segment's output
    is taller than its blocks (padding that grows the map).
    """
    n = _as_devices(devices)
    layers = list(layers)
    shape = H.check_shape(input_shape)
    check_tileable(layers, "layers")
    segs = split_segments(layers)
    if not segs:
        raise ValueError("layers is empty (or holds only Checkpoint markers)")
    # stride product of the whole stack: every block height must divide evenly
    geoms_all, s_total, cur = [], 1, shape
    for a, b in segs:
        g = H.geometry(layers[a:b], cur, start=a)
        geoms_all.append(g)
        s_total *= H.total_stride(g)
        cur = g[-1].out_shape
    Hin = shape[1]
    if Hin % (n * s_total):
        raise ValueError(
            f"input height H={Hin} cannot be split over devices={n}: every device must hold "
            f"the same number of rows at every stride, so H must be divisible by devices x "
            f"stride product = {n} x {s_total} = {n * s_total}; pad or crop the image to a "
            f"multiple of {n * s_total} rows, or use fewer devices")
    out = []
    T_in = Hin // n
    for (a, b), geoms in zip(segs, geoms_all):
        S = H.total_stride(geoms)
        T_out = T_in // S
        _, iv = H.overlap_plan(geoms, T_out)
        c, L = iv.c, iv.L
        top, bottom = max(0, -c), max(0, c + L - T_in)
        h_in, h_out = geoms[0].in_shape[1], geoms[-1].out_shape[1]
        if top > T_in or bottom > T_in:
            raise ValueError(
                f"layers[{a}:{b}]: each device holds {T_in} rows of this segment's input "
                f"(height {h_in} over devices={n}) but needs {top} rows from the device above "
                f"and {bottom} from the device below (receptive field "
                f"{H.receptive_field(geoms)}); halos may only reach the neighbouring devices. "
                "Use fewer devices, or cut the stack into shorter segments with "
                "rowconv.Checkpoint()")
        if h_out > n * T_out:
            raise ValueError(
                f"layers[{a}:{b}]: the output height {h_out} exceeds devices x rows per device "
                f"= {n} x {T_out}; padding that grows the map cannot be split evenly. Use "
                "'SAME'/'VALID' or padding that does not add rows")
        out.append(SegmentHalo(a, b, geoms[0].in_shape, geoms[-1].out_shape, T_in, T_out, S,
                               c, L, top, bottom))
        T_in = T_out
    return SpatialPlan(n, tuple(out), out[-1].out_shape, T_in)


# ----------------------------------------------------------------------------- one device


def _exchange(x, seg: SegmentHalo, axis_name, n):
    """(top, bottom) halo rows of device ``d``: the last ``top`` rows of device d-1 and the
    first ``bottom`` rows of device d+1 (zeros beyond the image; the layers mask them)."""
    B, _, W, C = x.shape
    top = bot = _like(jnp.zeros((B, 0, W, C), x.dtype), x)
    if seg.top:
        top = lax.slice_in_dim(x, seg.local_in - seg.top, seg.local_in, axis=1)
        top = (lax.ppermute(top, axis_name, [(i, i + 1) for i in range(n - 1)])
               if n > 1 else _like(jnp.zeros_like(top), x))
    if seg.bottom:
        bot = lax.slice_in_dim(x, 0, seg.bottom, axis=1)
        bot = (lax.ppermute(bot, axis_name, [(i + 1, i) for i in range(n - 1)])
               if n > 1 else _like(jnp.zeros_like(bot), x))
    return top, bot


def _vma(tree) -> frozenset:
    out = frozenset()
    for v in jax.tree.leaves(tree):
        out |= varying_axes(v)
    return out


def _like(z, ref):
    """``z`` with the device-varying axes of the values in ``ref`` (scan carries must agree
    inside ``shard_map``)."""
    want = tuple(sorted(_vma(ref) - _vma(z)))
    return lax.pcast(z, want, to="varying") if want else z


def _device_segment(geoms, seg: SegmentHalo, rows: int, unroll: int):
    """custom_vjp (params, top, x, bottom, device index, rng) -> this device's output block.

    The window ``E = [top; x; bottom]`` is never built for sub-tiles shorter than the block
    (the input block would be copied and kept): a tile reads its rows from ``head = [top;
    x[:Lt]]``, from ``x`` or from ``tail = [x[-Lt:]; bottom]`` (tile-sized copies), and the
    backward adds its window cotangent into the same three pieces.
    """
    T_out, S, T_in = seg.local_out, seg.stride, seg.local_in
    T, starts = H.overlap_starts(T_out, rows)
    nodes, iv = H.overlap_plan(geoms, T)
    own = [i * T for i in range(len(starts))]
    Lt, ht = iv.L, seg.top
    whole = Lt >= T_in  # one tile (or tiny blocks): read from the concatenated window

    def pieces(top, x, bot, after=None):
        def cat(parts):
            if after is None:
                return jnp.concatenate(parts, axis=1)
            # the backward's copy is written into a buffer made after the cotangent: XLA
            # would otherwise merge it with the forward's equal concatenation and keep
            # that one alive from the forward to the backward
            rows_ = sum(q.shape[1] for q in parts)
            buf = _zeros_after(parts[0].shape[:1] + (rows_,) + parts[0].shape[2:], x.dtype,
                               after)
            off = 0
            for q in parts:
                if q.shape[1]:
                    buf = lax.dynamic_update_slice_in_dim(buf, q, off, axis=1)
                off += q.shape[1]
            return buf

        if whole:
            return (cat([top, x, bot]),)
        return (cat([top, lax.slice_in_dim(x, 0, Lt, axis=1)]), x,
                cat([lax.slice_in_dim(x, T_in - Lt, T_in, axis=1), bot]))

    def where_(a):
        """(piece index, offset in it) of the tile window starting at window row ``a``."""
        if whole:
            return [(jnp.bool_(True), a)]
        in_head = a < ht
        in_tail = jnp.logical_and(jnp.logical_not(in_head), a + Lt > ht + T_in)
        in_x = jnp.logical_not(jnp.logical_or(in_head, in_tail))
        return [(in_head, jnp.clip(a, 0, ht)),
                (in_x, jnp.clip(a - ht, 0, T_in - Lt)),
                (in_tail, jnp.clip(a - ht - T_in + Lt, 0, seg.bottom))]

    def read(ps, a):
        w = None
        for (ok, off), p in zip(where_(a), ps):
            r = lax.dynamic_slice_in_dim(p, off, Lt, axis=1)
            w = r if w is None else jnp.where(ok, r, w)
        return w

    def add(dps, a, dw):
        out = []
        for (ok, off), p in zip(where_(a), dps):
            acc = lax.dynamic_slice_in_dim(p, off, Lt, axis=1) + jnp.where(ok, dw, 0)
            out.append(lax.dynamic_update_slice_in_dim(p, acc.astype(p.dtype), off, axis=1))
        return tuple(out)

    def split(dps, top, x, bot):
        """Cotangents of (top, x, bottom) from those of the pieces."""
        if whole:
            (de,) = dps
            return (lax.slice_in_dim(de, 0, ht, axis=1),
                    lax.slice_in_dim(de, ht, ht + T_in, axis=1),
                    lax.slice_in_dim(de, ht + T_in, ht + T_in + bot.shape[1], axis=1))
        dh, dx, dt = dps
        dx = dx.at[:, :Lt].add(lax.slice_in_dim(dh, ht, ht + Lt, axis=1))
        dx = dx.at[:, T_in - Lt:].add(lax.slice_in_dim(dt, 0, Lt, axis=1))
        return (lax.slice_in_dim(dh, 0, ht, axis=1), dx,
                lax.slice_in_dim(dt, Lt, Lt + bot.shape[1], axis=1))

    def forward(params, top, x, bot, d, rng):
        ps = pieces(top, x, bot)

        def tile(s):
            return _ov_seq(nodes, params, read(ps, s * S), d * T_out + s, rng).astype(x.dtype)

        # the block starts as the first tile padded below, not as a zeros constant: XLA
        # may create a constant at the program start, merge it with equal ones elsewhere
        # and then copy it into the loop (measured: one extra block per segment)
        y0 = tile(starts[0])
        out = lax.pad(y0, jnp.zeros((), x.dtype),
                      [(0, 0, 0), (0, T_out - T, 0), (0, 0, 0), (0, 0, 0)])
        if len(starts) == 1:
            return out

        def body(out, s):
            return lax.dynamic_update_slice_in_dim(out, tile(s), s, axis=1), None

        out, _ = lax.scan(body, out, jnp.asarray(starts[1:], jnp.int32), unroll=unroll)
        return out

    def backward(params, top, x, bot, d, rng, g, want_dx):
        ps = pieces(top, x, bot, after=g)
        ref = (params, x, d)
        dp0 = jax.tree.map(lambda p: _like(jnp.zeros_like(p), ref), params)

        def body(carry, so):
            dp, dps = carry
            s, o = so
            win = read(ps, s * S)
            gy = lax.dynamic_slice_in_dim(g, s, T, axis=1)
            gy = _mask_rows(gy, s - o, T, 0.0).astype(x.dtype)  # shifted last tile
            fn = lambda p, w: _ov_seq(nodes, p, w, d * T_out + s, rng)
            if want_dx:
                _, vjp = jax.vjp(fn, params, win)
                dpi, dwin = vjp(gy)
                dps = add(dps, s * S, dwin)
            else:
                _, vjp = jax.vjp(lambda p: fn(p, win), params)
                (dpi,) = vjp(gy)
            return (jax.tree.map(jnp.add, dp, dpi), dps), None

        dps = (tuple(_like(_zeros_after(p.shape, p.dtype, g), ref) for p in ps)
               if want_dx else None)
        (dp, dps), _ = lax.scan(body, (dp0, dps), (jnp.asarray(starts, jnp.int32),
                                                   jnp.asarray(own, jnp.int32)), unroll=unroll)
        return dp, (split(dps, top, x, bot) if want_dx else (None, None, None))

    flags: dict = {}

    @jax.custom_vjp
    def seg_fn(params, top, x, bot, d, rng):
        return forward(params, top, x, bot, d, rng)

    def seg_fwd(params, top, x, bot, d, rng):
        flags["dx"] = bool(x.perturbed or top.perturbed or bot.perturbed)
        args = jax.tree.map(lambda t: t.value, (params, top, x, bot, d, rng),
                            is_leaf=lambda t: isinstance(t, CustomVJPPrimal))
        return forward(*args), args

    def seg_bwd(res, g):
        params, top, x, bot, d, rng = res
        if isinstance(g, SymbolicZero):
            return jax.tree.map(lambda _: None, params), None, None, None, None, None
        dp, (dtop, dx, dbot) = backward(params, top, x, bot, d, rng, g, flags.get("dx", True))
        return dp, dtop, dx, dbot, None, None

    seg_fn.defvjp(seg_fwd, seg_bwd, symbolic_zeros=True)
    return seg_fn


def _varying(tree, axes):
    """Mark replicated values as device-varying over ``axes`` (transpose: psum)."""
    def one(v):
        want = tuple(sorted(set(axes) - varying_axes(v)))
        if not want:
            return v
        try:
            return lax.pcast(v, want, to="varying")
        except (ValueError, TypeError):  # shard_map(check_vma=False)
            return v
    return jax.tree.map(one, tree)


def _check_rows_local(r_fp, plan: SpatialPlan):
    for r, s in zip(r_fp, plan.segments):
        if r > s.local_out:
            raise ValueError(
                f"rows={r} (segment layers[{s.start}:{s.stop}]) is more than the {s.local_out} "
                f"output rows each of the {plan.devices} devices computes; use rows <= "
                f"{s.local_out}")


def spatial_local(layers: Sequence[Any], params: Sequence[Any], x: jax.Array, *,
                  axis_name: str, height: int, rows: int = 1, rng: jax.Array | None = None,
                  unroll: int = 1) -> jax.Array:
    """One device's part of a height-sharded stack; call it inside ``jax.shard_map``.

    Args:
      layers, params: as for ``rowconv.apply`` (params replicated over ``axis_name``).
      x: this device's block of ``height / n`` consecutive input rows (NHWC), device ``i``
        of the axis holding rows ``[i*height/n, (i+1)*height/n)``.
      axis_name: the mesh axis the height is split over (``n`` = its size).
      height: the global input height ``H``.
      rows: row sub-tiles per device (an int, or one per segment), OverL tiling.
      rng: PRNG key for ``Dropout`` (masks follow global rows: independent of ``n``).

    Returns this device's block of ``SpatialPlan.out_rows`` output rows; rows whose global
    index is ``>= out_shape[1]`` (only when VALID layers shrink the map) are padding.
    """
    n = lax.axis_size(axis_name)
    check_input(x)
    if isinstance(height, bool) or not isinstance(height, numbers.Integral):
        raise TypeError(f"height must be the global input height (an int), got {height!r}")
    if x.shape[1] * n != height:
        raise ValueError(f"x holds {x.shape[1]} rows on each of the {n} devices of axis "
                         f"{axis_name!r}, which is not height={height}")
    layers = list(layers)
    if isinstance(unroll, bool) or not isinstance(unroll, numbers.Integral) or unroll < 1:
        raise ValueError(f"unroll must be an int >= 1, got {unroll!r}")
    gshape = (x.shape[0], height) + tuple(x.shape[2:])
    check_params(layers, list(params), gshape)
    plan = spatial_plan(layers, gshape, n)
    r_fp = _per_segment(rows, len(plan.segments), "rows")
    _check_rows_local(r_fp, plan)
    # varying over the height axis and every axis x varies over (e.g. a batch axis):
    # the transpose sums the weight gradients over all of them
    params = _varying(list(params), varying_axes(x) | {axis_name})
    d = lax.axis_index(axis_name).astype(jnp.int32)
    for seg, r in zip(plan.segments, r_fp):
        geoms = H.geometry(layers[seg.start:seg.stop], (x.shape[0],) + seg.in_shape[1:],
                           start=seg.start)
        top, bot = _exchange(x, seg, axis_name, n)
        x = _device_segment(geoms, seg, r, unroll)(params[seg.start:seg.stop], top, x, bot,
                                                   d, rng)
    return x


def spatial_apply(layers: Sequence[Any], params: Sequence[Any], x: jax.Array, *, mesh: Mesh,
                  axis_name: str, rows: int = 1, rng: jax.Array | None = None,
                  batch_axis: str | None = None, unroll: int = 1) -> jax.Array:
    """``rowconv.apply`` with the image height split over the mesh axis ``axis_name``.

    ``x`` (global NHWC) is read as ``PartitionSpec(batch_axis, axis_name)``: each device
    holds ``H / n`` rows (and, with ``batch_axis``, its share of the batch); it exchanges
    only halo rows with its neighbours (see the module docstring for the sizes) and tiles
    its own rows into ``rows`` sub-tiles. The result equals the untiled stack (outputs and
    gradients, input and parameters) and is sharded the same way.

    Args:
      layers: the stack, as for :func:`jaxmem.rowconv.apply` (``Checkpoint()`` markers
        allowed).
      params: from :func:`jaxmem.rowconv.init` (a list aligned with ``layers``).
      x: global input batch, NHWC; its height must split evenly over the ``axis_name``
        devices (and its batch over ``batch_axis``).
      mesh: a ``jax.sharding.Mesh``.
      axis_name: the mesh axis the image height is split over.
      rows: row sub-tiles per device (an int, or one per segment).
      rng: PRNG key, needed by ``Dropout(deterministic=False)``.
      batch_axis: another mesh axis to split the batch over (default: not split).
      unroll: ``lax.scan`` unroll factor of the tile loops.

    Returns:
      The stack's global output (NHWC), sharded as ``PartitionSpec(batch_axis,
      axis_name)``; equal to ``rowconv.apply(layers, params, x)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh
      >>> from jaxmem import rowconv
      >>> layers = [rowconv.Conv(4, 3), rowconv.Act(jax.nn.relu), rowconv.Pool("max", 2)]
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 8, 3))
      >>> params = rowconv.init(layers, jax.random.PRNGKey(1), x.shape)
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("space",))
      >>> y = rowconv.spatial_apply(layers, params, x, mesh=mesh, axis_name="space", rows=2)
      >>> y.shape
      (1, 8, 4, 4)
      >>> ref = rowconv.apply(layers, params, x)
      >>> bool(jnp.allclose(y, ref, rtol=1e-5, atol=1e-6))
      True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; its axes are "
                         f"{mesh.axis_names}")
    if batch_axis is not None and (batch_axis not in mesh.axis_names
                                   or batch_axis == axis_name):
        raise ValueError(f"batch_axis={batch_axis!r} must be another axis of the mesh "
                         f"(axes {mesh.axis_names}, height axis {axis_name!r})")
    check_input(x)
    n = mesh.shape[axis_name]
    nb = 1 if batch_axis is None else mesh.shape[batch_axis]
    if x.shape[0] % nb:
        raise ValueError(f"batch {x.shape[0]} is not divisible by the {nb} devices of "
                         f"batch_axis={batch_axis!r}")
    layers = list(layers)
    plan = spatial_plan(layers, x.shape, n)  # clear errors before shard_map traces
    _check_rows_local(_per_segment(rows, len(plan.segments), "rows"), plan)
    spec = P(batch_axis, axis_name)
    H_in, H_out = x.shape[1], plan.out_shape[1]

    def local(p, xl, key):
        return spatial_local(layers, p, xl, axis_name=axis_name, height=H_in, rows=rows,
                             rng=key, unroll=unroll)

    # jit: custom_vjp with symbolic zeros (the tile loops) needs a traced shard_map
    y = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), spec, P()), out_specs=spec))(
        list(params), x, rng)
    return y if y.shape[1] == H_out else y[:, :H_out]
