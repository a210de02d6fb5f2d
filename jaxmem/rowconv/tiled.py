"""Row-tiled evaluation of a conv stack with exact gradients (OverL and 2PS).

Each tiled segment is one ``jax.custom_vjp`` whose rules drive the tiles explicitly:

* forward: a ``lax.scan`` over tiles writes each output tile into the output buffer
  (``dynamic_update_slice``). Nothing of the tile's inside is kept. In 'share' mode the
  boundary rows each layer hands to the next tile travel in the scan carry; their
  per-tile values (the paper's *sharing data*) are the only residuals besides ``x``.
* backward: a second ``lax.scan`` over tiles recomputes one tile (the chain rule of the
  tile function run layer by layer, ``_ov_vjp`` in overlap mode; ``jax.vjp`` of the whole
  tile in share mode), pulls back the tile's slice of the output cotangent, accumulates the
  parameter cotangents in the carry and adds the input-window cotangent into a
  preallocated buffer. 'share' runs it in reverse tile order and also carries the
  cotangent of the boundary rows to the previous tile.

Because each tile's receptive field is recomputed exactly (semi-closed padding by masking
only true image borders), and cotangents of overlapping halo rows are *summed* (overlap)
or passed on (share), outputs and gradients equal the untiled stack up to floating-point
summation order. The while loop is what keeps XLA from hoisting all tiles' recomputation
together (an unrolled Python loop gets re-scheduled back to full-size memory).

Inside a user's ``shard_map`` (e.g. the batch split over a data axis, parameters
replicated) the segment's inputs are cast to one varying type first; the cast transposes
to a ``psum``, so a replicated parameter gets the summed gradient, as through plain JAX ops.
"""
from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jaxmem._prims.ties import barrier_off_cpu, varying_axes
from jaxmem._prims.ties import zeros_created_after as zeros_after

from . import halo as H
from .layers import (
    Act,
    BatchNorm,
    Checkpoint,
    Dropout,
    Layer,
    Pool,
    Residual,
    _check_layer,
    _layer_key,
    apply_layers,
    check_params,
)

__all__ = ["MODES", "apply", "segment_rows", "split_segments"]

MODES = ("overlap", "share")


# ----------------------------------------------------------------------------- helpers


def _rows_ok(x, row0, n_rows):
    """``(1, R, 1, 1)`` mask of the rows of ``x`` whose global index (row0 + j) is in
    [0, n_rows)."""
    r = row0 + jnp.arange(x.shape[1])
    return ((r >= 0) & (r < n_rows))[None, :, None, None]


def _mask_rows(x, row0, n_rows, value):
    """Rows of ``x`` whose global index (row0 + j) is outside [0, n_rows) -> ``value``."""
    return jnp.where(_rows_ok(x, row0, n_rows), x, jnp.asarray(value, x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _relu_masked(x, ok, value):
    """``where(ok, relu(x), value)``: a ReLU whose output is masked for the next layer.

    Its backward keeps only the masked output ``m`` (which the next layer keeps anyway):
    ``dx = where(m > 0, g, 0)``. Where ``ok``, ``m > 0`` iff ``x > 0`` (the ReLU's own
    derivative, NaN included); elsewhere ``m`` is ``value`` (0 or -inf) and the mask's
    derivative is 0. So the gradient is bit for bit the composite's, without the ReLU's
    unmasked output (one tile-sized buffer per convolution) held beside ``m``."""
    return jnp.where(ok, jax.nn.relu(x), jnp.asarray(value, x.dtype))


def _relu_masked_fwd(x, ok, value):
    m = _relu_masked(x, ok, value)
    return m, m


def _relu_masked_bwd(value, m, g):
    zero = _unshared_zero(m.dtype)
    return jnp.where(m > zero, g, zero.astype(g.dtype)), None


_relu_masked.defvjp(_relu_masked_fwd, _relu_masked_bwd)


def _unshared_zero(dtype):
    """A scalar 0 that XLA:GPU does not merge with the other zero maps of a tile (CSE).

    A tile's max-pool backward scatters into a zeros map; were ``m > 0`` to read the same
    broadcast, that map would be used twice, so XLA:GPU would materialise it and copy it for
    the in-place scatter (two tile maps where one is needed). Behind an
    ``optimization_barrier`` (``ties.barrier_off_cpu``: a plain 0 on CPU, where the scalar's
    own buffer would be the only change) the comparison's zero is its own scalar, fused into
    its consumer. Values unchanged."""
    return barrier_off_cpu(jnp.zeros((), dtype))


def _masks_next(nd, nxt) -> bool:
    """Whether node ``nd`` is a ReLU whose output the next node ``nxt`` masks as its input
    (a spatial layer other than dropout): the two run as :func:`_relu_masked`."""
    layer = nd.geom.layer
    return (nxt is not None and isinstance(layer, Act) and layer.fn is jax.nn.relu
            and nxt.geom.rowmap is not None and nxt.geom.spatial
            and not isinstance(nxt.geom.layer, Dropout))


def _rows(x, start, length):
    return lax.slice_in_dim(x, start, start + length, axis=1)


def _read_window(x, start, L, top, bot):
    """Rows [start, start+L) of ``x`` (rows outside the map read as 0), without padding
    the whole map: clamp the slice into range, pad the *tile*, shift back."""
    c = jnp.clip(start, 0, x.shape[1] - L)
    w = lax.dynamic_slice_in_dim(x, c, L, axis=1)
    if top or bot:
        w = jnp.pad(w, ((0, 0), (top, bot), (0, 0), (0, 0)))
        w = lax.dynamic_slice_in_dim(w, start - c + top, L, axis=1)
    return w


def _add_window(dx, dw, start, top, bot):
    """``dx[rows start..start+L) += dw``, dropping rows outside ``dx``."""
    L = dw.shape[1]
    c = jnp.clip(start, 0, dx.shape[1] - L)
    if top or bot:
        dw = jnp.pad(dw, ((0, 0), (bot, top), (0, 0), (0, 0)))
        dw = lax.dynamic_slice_in_dim(dw, c - start + bot, L, axis=1)
    acc = lax.dynamic_slice_in_dim(dx, c, L, axis=1) + dw.astype(dx.dtype)
    return lax.dynamic_update_slice_in_dim(dx, acc, c, axis=1)


def _put_window(buf, w, start, n_own, top, bot):
    """Rows ``start .. start + n_own`` of ``buf`` (those inside it) := the first ``n_own``
    rows of ``w`` (``w``'s row j is global row ``start + j``); the other rows of ``buf`` keep
    their contents. The clamping is :func:`_add_window`'s."""
    L = w.shape[1]
    c = jnp.clip(start, 0, buf.shape[1] - L)
    if top or bot:
        w = jnp.pad(w, ((0, 0), (bot, top), (0, 0), (0, 0)))
        w = lax.dynamic_slice_in_dim(w, c - start + bot, L, axis=1)
    r = c + jnp.arange(L)
    own = (r >= start) & (r < start + n_own)
    cur = lax.dynamic_slice_in_dim(buf, c, L, axis=1)
    new = jnp.where(own[None, :, None, None], w.astype(buf.dtype), cur)
    return lax.dynamic_update_slice_in_dim(buf, new, c, axis=1)


def _grow(x, L):
    """Pad ``x`` at the bottom to at least L rows (tiny maps only)."""
    if x.shape[1] >= L:
        return x
    return jnp.pad(x, ((0, 0), (0, L - x.shape[1]), (0, 0), (0, 0)))


def _is_zero(g):
    return isinstance(g, SymbolicZero)


def _zeros_tree_after(tree, after):
    """``zeros_like`` of every leaf of ``tree``, made only once ``after`` exists (see
    ``zeros_after``: a constant would be created at program start and held until used)."""
    return jax.tree.map(lambda t: zeros_after(jnp.shape(t), jnp.result_type(t), after), tree)


def _layer_rows(g: H._Geom, p, x, row0, rng, masked=False):
    """Apply a non-residual layer to a window whose first row is global row ``row0``
    (``masked``: its rows outside the image already hold the layer's pad value)."""
    layer = g.layer
    if isinstance(layer, Dropout):
        return layer.apply_rows(x, _layer_key(rng, g.path), row0)
    if g.spatial:
        rm = g.rowmap
        if not masked:
            x = _mask_rows(x, row0, g.in_shape[1], rm.pad_value)
        y = layer.apply_window(p, x, (0, 0), g.pad_w)
        if isinstance(layer, Pool) and layer.kind == "max":
            # rows above/below the map can be all -inf: make them finite garbage.
            y = _mask_rows(y, (row0 + rm.lo) // rm.stride, g.out_shape[1], 0.0)
        return y
    return layer.apply_window(p, x, (0, 0), g.pad_w)


# ----------------------------------------------------------------------------- overlap tile


def _ov_node(nodes, k, p, x, o, rng, masked):
    """Node ``k`` of an overlap tile on window ``x`` (``masked``: its rows outside the image
    already hold the node's pad value, set by a preceding :func:`_relu_masked`)."""
    nd = nodes[k]
    g = nd.geom
    nxt = nodes[k + 1] if k + 1 < len(nodes) else None
    if _masks_next(nd, nxt):
        row0 = nxt.iv_in.at(o)
        return _relu_masked(x, _rows_ok(x, row0, nxt.geom.in_shape[1]),
                            nxt.geom.rowmap.pad_value)
    if g.rowmap is None:
        Lb = nd.branch[0].iv_in.L if nd.branch else nd.iv_out.L
        yb = _ov_seq(nd.branch, p["branch"], _rows(x, nd.off_b, Lb), o, rng)
        if g.shortcut is None:
            ys = _rows(x, nd.off_s, nd.iv_out.L)
        else:
            Ls = nd.shortcut[0].iv_in.L if nd.shortcut else nd.iv_out.L
            ys = _ov_seq(nd.shortcut, p["shortcut"], _rows(x, nd.off_s, Ls), o, rng)
        return yb + ys
    return _layer_rows(g, p, x, nd.iv_in.at(o), rng, masked)


def _masked_in(nodes, k) -> bool:
    """Whether node ``k``'s input window comes out of a :func:`_relu_masked`."""
    return k > 0 and _masks_next(nodes[k - 1], nodes[k])


def _ov_seq(nodes, params, x, o, rng):
    for k, p in enumerate(params):
        x = _ov_node(nodes, k, p, x, o, rng, _masked_in(nodes, k))
    return x


def _release_together(dp, gx):
    """``(dp, gx)`` unchanged, each available only once both are (``ties.barrier_off_cpu``):
    a layer's parameter cotangent is computed before the cotangent it hands to the layer
    before it is used, so XLA:GPU's scheduler cannot defer the layer's weight gradient, and
    with it the layer's residuals, past the earlier layers' backward. As it is on CPU."""
    return barrier_off_cpu((dp, gx)) if jax.tree.leaves(dp) else (dp, gx)


def _ov_vjp(nodes, params, x, o, rng, gy, want_dx):
    """``(dparams, dx)`` of the tile ``_ov_seq(nodes, params, x, o, rng)`` for the output
    cotangent ``gy``: the chain rule run one node at a time, ``(dp_k, g_{k-1}) =
    vjp_k(g_k)`` (the per-node VJPs ``jax.vjp`` of the whole tile runs), each pair released
    together (:func:`_release_together`). ``dx`` is None unless ``want_dx``. On the H100
    plan of a segment spanning two VGG stages (1024², 16 tiles) the tile's backward keeps
    15.09 MiB of temporaries instead of 16.69: the second stage's maps no longer wait for
    the first stage's pool backward."""
    vjps = []
    for k, p in enumerate(params):
        x, vjp = jax.vjp(functools.partial(_ov_node, nodes, k, o=o, rng=rng,
                                           masked=_masked_in(nodes, k)), p, x)
        vjps.append(vjp)
    dps, g = [None] * len(vjps), gy
    for k in reversed(range(len(vjps))):
        dp, gx = vjps[k](g)
        if k == 0 and not want_dx:
            dps[k], g = dp, None
        else:
            dps[k], g = _release_together(dp, gx)
    return dps, g


def _overlap_segment(geoms, params, x, rng, rows_fp, rows_bp, unroll):
    Hin = geoms[0].in_shape[1]
    Hout = geoms[-1].out_shape[1]
    T_f, st_f = H.overlap_starts(Hout, rows_fp)
    T_b, st_b = H.overlap_starts(Hout, rows_bp)
    nodes_f, iv_f = H.overlap_plan(geoms, T_f)
    nodes_b, iv_b = H.overlap_plan(geoms, T_b)
    # rows of x above/below the image a window may read (they are zero padding)
    L = max(iv_f.L, iv_b.L)
    top = max(0, -iv_f.c, -iv_b.c)
    bot = max(0, iv_f.at(st_f[-1]) + iv_f.L - Hin, iv_b.at(st_b[-1]) + iv_b.L - Hin)
    out_shape = geoms[-1].out_shape

    def forward(params, x, rng):
        xg = _grow(x, L)
        # made from x, not a constant: XLA would create every segment's output buffer at
        # program start and hold it through the earlier segments
        out = zeros_after(out_shape[:1] + (Hout,) + out_shape[2:], x.dtype, x)

        def body(out, o):
            xw = _read_window(xg, iv_f.at(o), iv_f.L, top, bot)
            y = _ov_seq(nodes_f, params, xw, o, rng)
            return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), o, axis=1), None

        out, _ = lax.scan(body, out, jnp.asarray(st_f, jnp.int32), unroll=unroll)
        return out

    def backward(params, x, rng, extra, g, want_dx):
        if want_dx and _ov_inplace(x.shape[1], iv_b.L, [iv_b.at(o) for o in st_b]):
            return _backward_inplace(params, x, rng, g)
        xg = _grow(x, L)
        # accumulators made from the cotangent, so they exist only in the backward pass
        dp0 = _zeros_tree_after(params, g)
        own0 = jnp.asarray([i * T_b for i in range(len(st_b))], jnp.int32)

        def body(carry, io):
            dp, dxg = carry
            o, own = io
            start = iv_b.at(o)
            xw = _read_window(xg, start, iv_b.L, top, bot)
            gy = lax.dynamic_slice_in_dim(g, o, T_b, axis=1)
            # the shifted last tile owns only the rows no earlier tile produced
            gy = _mask_rows(gy, o - own, T_b, 0.0).astype(x.dtype)
            if want_dx:
                dpi, dxw = _ov_vjp(nodes_b, params, xw, o, rng, gy, True)
                dxg = _add_window(dxg, dxw, start, top, bot)
            else:
                dpi, _ = _ov_vjp(nodes_b, params, xw, o, rng, gy, False)
            dp = jax.tree.map(jnp.add, dp, dpi)
            return (dp, dxg), None

        dxg = zeros_after(xg.shape, xg.dtype, g) if want_dx else None
        (dp, dxg), _ = lax.scan(body, (dp0, dxg), (jnp.asarray(st_b, jnp.int32), own0),
                                unroll=unroll)
        return dp, (None if dxg is None else _rows(dxg, 0, Hin))

    def _backward_inplace(params, x, rng, g):
        # The input cotangent is written over x itself: tiles run top to bottom, and once
        # tile k is done no later window reads the rows above window k+1, and no later tile
        # adds to them. Their cotangent is final, so it replaces x there; the rows shared
        # with the next window travel in `pend` (L rows, window coordinates). The sums are
        # formed in the same order as with a zero-initialised accumulator (bit for bit), and
        # no second map of x's size is alive (x's buffer becomes the loop carry).
        Lb = iv_b.L
        starts = [iv_b.at(o) for o in st_b]
        d = [b - a for a, b in itertools.pairwise(starts)] + [Lb]
        dp0 = _zeros_tree_after(params, g)
        pend0 = zeros_after(x.shape[:1] + (Lb,) + x.shape[2:], x.dtype, g)
        own0 = jnp.asarray([i * T_b for i in range(len(st_b))], jnp.int32)

        def body(carry, io):
            dp, buf, pend = carry
            o, own, dk = io
            start = iv_b.at(o)
            xw = _read_window(buf, start, Lb, top, bot)
            gy = lax.dynamic_slice_in_dim(g, o, T_b, axis=1)
            gy = _mask_rows(gy, o - own, T_b, 0.0).astype(x.dtype)
            dpi, dxw = _ov_vjp(nodes_b, params, xw, o, rng, gy, True)
            acc = pend + dxw.astype(x.dtype)
            buf = _put_window(buf, acc, start, dk, top, bot)
            pend = lax.dynamic_slice_in_dim(jnp.concatenate([acc, jnp.zeros_like(acc)], axis=1),
                                            dk, Lb, axis=1)
            dp = jax.tree.map(jnp.add, dp, dpi)
            return (dp, buf, pend), None

        xs = (jnp.asarray(st_b, jnp.int32), own0, jnp.asarray(d, jnp.int32))
        (dp, dx, _), _ = lax.scan(body, (dp0, x, pend0), xs, unroll=unroll)
        return dp, dx

    return _wrap(forward, lambda p, x, r: (forward(p, x, r), None), backward, params, x, rng)


def _ov_inplace(H, L, starts) -> bool:
    """Whether overlap's input cotangent can be written over x: the windows (``L`` rows
    at ``starts``) cover every row of x (a row no window reads has a zero cotangent, which
    an in-place write would leave as x) and x is at least one window tall."""
    return (H >= L and starts[0] <= 0 and starts[-1] + L >= H
            and all(0 < b - a <= L for a, b in itertools.pairwise(starts)))


def _vary_all(tree):
    """Every leaf of ``tree`` cast to vary over the union of the ``shard_map`` axes any
    leaf varies over (``lax.pcast(..., to="varying")``; the identity outside
    ``shard_map``). A replicated parameter beside a per-device batch then has the
    batch's type, and autodiff transposes the cast into a ``psum`` of its gradient, as
    it does for plain JAX ops."""
    leaves, tree_def = jax.tree.flatten(tree)
    axes = frozenset().union(*(varying_axes(v) for v in leaves))
    if not axes:
        return tree

    def one(v):
        want = tuple(sorted(axes - varying_axes(v)))
        return lax.pcast(v, want, to="varying") if want else v

    return jax.tree.unflatten(tree_def, [one(v) for v in leaves])


def _wrap(forward, forward_res, backward, params, x, rng):
    """custom_vjp around (forward, backward); the input cotangent is computed only when
    ``x`` is perturbed (``symbolic_zeros``); residuals are (params, x, rng) either way.
    Inside ``shard_map`` the three are first cast to one varying type (``_vary_all``),
    so the rules' scan carries and cotangents have the types of their primals."""
    params, x, rng = _vary_all((params, x, rng))
    flags = {}

    @jax.custom_vjp
    def seg(params, x, rng):
        return forward(params, x, rng)

    def seg_fwd(params, x, rng):
        flags["dx"] = bool(x.perturbed)
        params, x, rng = jax.tree.map(lambda t: t.value, (params, x, rng),
                                      is_leaf=lambda t: isinstance(t, CustomVJPPrimal))
        y, extra = forward_res(params, x, rng)
        return y, (params, x, rng, extra)

    def seg_bwd(res, g):
        params, x, rng, extra = res
        if _is_zero(g):
            return jax.tree.map(lambda _: None, params), None, None
        dp, dx = backward(params, x, rng, extra, g, flags.get("dx", True))
        return dp, dx, None

    seg.defvjp(seg_fwd, seg_bwd, symbolic_zeros=True)
    return seg(params, x, rng)


# ----------------------------------------------------------------------------- share tile


def _sh_seq(nodes, params, x, i, carries, new, rng):
    """One tile through a sequence of share-mode nodes. ``new`` receives updated carries."""
    for nd, p in zip(nodes, params):
        g = nd.geom
        if g.rowmap is None:
            yb = _sh_seq(nd.branch, p["branch"], x, i, carries, new, rng) if nd.branch else x
            if g.shortcut is None:
                ys = x
            else:
                ys = (_sh_seq(nd.shortcut, p["shortcut"], x, i, carries, new, rng)
                      if nd.shortcut else x)
            if nd.delay_b:
                yb = _delay(yb, carries, new, nd.slot_b, nd.delay_b)
            if nd.delay_s:
                ys = _delay(ys, carries, new, nd.slot_s, nd.delay_s)
            x = yb + ys
        elif g.spatial:
            rm = g.rowmap
            if nd.carry:
                cat = jnp.concatenate([carries[nd.slot].astype(x.dtype), x], axis=1)
                new[nd.slot] = _rows(cat, cat.shape[1] - nd.carry, nd.carry)
            else:
                cat = x
            win = _rows(cat, nd.woff, nd.win)
            x = _layer_rows(g, p, win, i * nd.T_in + nd.c_out * rm.stride - rm.lo, rng)
        else:
            x = _layer_rows(g, p, x, i * nd.T_in + nd.e_in, rng)
    return x


def _delay(y, carries, new, slot, d):
    cat = jnp.concatenate([carries[slot].astype(y.dtype), y], axis=1)
    new[slot] = _rows(cat, cat.shape[1] - d, d)
    return _rows(cat, 0, y.shape[1])


def _share_segment(geoms, params, x, rng, rows_fp, rows_bp, unroll):
    Hin = geoms[0].in_shape[1]
    out_shape = geoms[-1].out_shape
    Hout = out_shape[1]
    plan_f = H.share_plan(geoms, rows_fp)
    plan_b = plan_f if rows_bp == rows_fp else H.share_plan(geoms, rows_bp)

    def carries0(slots, dtype, after):
        return [zeros_after((s[0], h) + s[2:], dtype, after) for _, s, h in slots]

    def tile(nodes, params, carries, xn, i, rng):
        new = list(carries)
        y = _sh_seq(nodes, params, xn, i, carries, new, rng)
        return y, new

    def run(params, x, rng, plan, keep):
        nodes, slots, T, n, e_out, T_in = plan
        bot = max(0, n * T_in - Hin)
        xg = _grow(x, T_in)
        # the output stream lags by -e_out rows, so a tile (T rows) can be taller than the
        # whole output map (e.g. rows=2 behind a wide dilated VALID conv): write into a
        # buffer of at least T rows and drop the rows below H_out at the end.
        # (made from x, not a constant: see _overlap_segment)
        out = zeros_after(out_shape[:1] + (max(Hout, T),) + out_shape[2:], x.dtype, x)

        def body(c, i):
            carries, out = c
            xn = _read_window(xg, i * T_in, T_in, 0, bot)
            y, new = tile(nodes, params, carries, xn, i, rng)
            # each output row is written once: adding into zeros == writing, rows of the
            # first/last tile outside [0, H_out) are dropped
            out = _add_window(out, y, i * T + e_out, -e_out, T)
            return (new, out), (carries if keep else None)

        (_, out), saved = lax.scan(body, (carries0(slots, x.dtype, x), out),
                                   jnp.arange(n, dtype=jnp.int32), unroll=unroll)
        return _rows(out, 0, Hout), saved

    def forward_res(params, x, rng):
        if plan_b is plan_f:
            return run(params, x, rng, plan_f, True)
        return run(params, x, rng, plan_f, False)[0], None

    def backward(params, x, rng, saved, g, want_dx):
        if saved is None:  # N_bp != N_fp: one more forward to collect the boundary rows
            saved = run(params, x, rng, plan_b, True)[1]
        nodes, slots, T, n, e_out, T_in = plan_b
        bot = max(0, n * T_in - Hin)
        # In place: the tiles partition x's rows and run bottom to top, each reading and
        # then writing only its own rows, so the input cotangent can replace x row block by
        # row block (no second map of x's size; each row is written once, as the
        # zero-initialised accumulator would hold it).
        inplace = want_dx and Hin >= T_in
        xg = x if inplace else _grow(x, T_in)
        g = _grow(g, T)  # a tile can be taller than the output map (see run)
        dp0 = _zeros_tree_after(params, g)  # backward-only accumulators, as in overlap

        def body(c, inp):
            dp, dcar, dxg = c
            i, carries = inp
            xn = _read_window(dxg if inplace else xg, i * T_in, T_in, 0, bot)
            gy = _read_window(g, i * T + e_out, T, -e_out, T).astype(x.dtype)
            if want_dx:
                _, vjp = jax.vjp(lambda p, cs, xn: tile(nodes, p, cs, xn, i, rng),
                                 params, carries, xn)
                dpi, dcs, dxn = vjp((gy, dcar))
                if inplace:
                    dxg = _put_window(dxg, dxn, i * T_in, T_in, 0, bot)
                else:
                    dxg = _add_window(dxg, dxn, i * T_in, 0, bot)
            else:
                _, vjp = jax.vjp(lambda p, cs: tile(nodes, p, cs, xn, i, rng), params, carries)
                dpi, dcs = vjp((gy, dcar))
            dp = jax.tree.map(jnp.add, dp, dpi)
            return (dp, dcs, dxg), None

        if not want_dx:
            dxg = None
        elif inplace:
            dxg = x
        else:
            dxg = zeros_after(xg.shape, xg.dtype, g)
        (dp, _, dxg), _ = lax.scan(
            body, (dp0, carries0(slots, x.dtype, g), dxg),
            (jnp.arange(n, dtype=jnp.int32), saved), reverse=True, unroll=unroll)
        return dp, (None if dxg is None else _rows(dxg, 0, Hin))

    return _wrap(lambda p, x, r: run(p, x, r, plan_f, False)[0], forward_res, backward,
                 params, x, rng)


# ----------------------------------------------------------------------------- public


def check_tileable(layers: Sequence[Layer], where: str = "layers") -> None:
    for i, layer in enumerate(layers):
        _check_layer(layer, f"{where}[{i}]")
        if isinstance(layer, BatchNorm) and not layer.use_running_average:
            raise ValueError(
                f"{where}[{i}] is BatchNorm(use_running_average=False): train-mode BatchNorm "
                "needs statistics over the whole image and cannot be row-tiled exactly. "
                "Either use eval/frozen statistics (BatchNorm(use_running_average=True) or "
                "Affine), or split the stack: run the tiled parts with rowconv.apply and the "
                "train-mode BatchNorm between them untiled (or use rows=1).")
        if isinstance(layer, Residual):
            check_tileable(layer.branch, f"{where}[{i}].branch")
            if isinstance(layer.branch, (list, tuple)) and any(
                    isinstance(b, Checkpoint) for b in layer.branch):
                raise ValueError(f"{where}[{i}]: Checkpoint markers must be at the top level")
            if layer.shortcut is not None:
                check_tileable(layer.shortcut, f"{where}[{i}].shortcut")


def split_segments(layers: Sequence[Layer]) -> list[tuple[int, int]]:
    """[(start, stop)] index ranges of the segments between Checkpoint markers."""
    segs, start = [], 0
    for i, layer in enumerate(layers):
        if isinstance(layer, Checkpoint):
            if i > start:
                segs.append((start, i))
            start = i + 1
    if len(layers) > start:
        segs.append((start, len(layers)))
    return segs


def _per_segment(v, n, name, allow_none=False):
    """``v`` (an int, or one int per segment; None allowed for rows_bp) as a list of n."""
    if v is None and allow_none:
        return [None] * n
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"{name} has {len(v)} entries but the stack has {n} segments "
                             "(Checkpoint markers split it); pass an int or one entry per "
                             "segment")
        return [None if (u is None and allow_none) else H.as_rows(u, f"{name}[{j}]")
                for j, u in enumerate(v)]
    if hasattr(v, "ndim") and getattr(v, "ndim", None) == 0 and not isinstance(v, jax.Array):
        v = v.item() if not isinstance(v, bool) else v  # a 0-d numpy integer array
    return [H.as_rows(v, name)] * n


def check_input(x: Any, name: str = "x") -> None:
    """TypeError/ValueError unless ``x`` is a floating NHWC array."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an NHWC array, got {type(x).__name__}")
    if len(shape) != 4:
        raise ValueError(f"{name} must be an NHWC array (4 dims: batch, height, width, "
                         f"channels), got shape {tuple(shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array (float32, bfloat16, float16, or "
                        f"float64 under x64), got dtype {x.dtype}; cast it, e.g. "
                        f"{name}.astype(jnp.float32)")


def apply(layers: Sequence[Layer], params: Sequence[Any], x: jax.Array,
          rows: int | Sequence[int] = 1, mode: str = "overlap", *,
          rows_bp: int | Sequence[int] | None = None, rng: jax.Array | None = None,
          unroll: int = 1) -> jax.Array:
    """Run ``layers`` on ``x`` (NHWC) tile by tile; exact outputs and gradients.

    Args:
      layers: the stack (see ``rowconv.layers``); ``Checkpoint()`` markers cut it into
        segments tiled separately (the hybrid OverL-H / 2PS-H variants).
      params: from :func:`init` (a list aligned with ``layers``).
      x: input batch, NHWC.
      rows: N_fp, the number of row tiles in the forward pass (an int, or one per
        segment). ``rows=1`` runs the plain untiled stack.
      mode: 'overlap' (OverL: independent tiles with recomputed halos) or 'share'
        (2PS: boundary rows carried from tile to tile, nothing recomputed).
      rows_bp: N_bp, tiles in the backward pass (default: ``rows``).
      rng: PRNG key, needed by ``Dropout(deterministic=False)``.
      unroll: ``lax.scan`` unroll factor of the tile loops.

    Returns:
      The stack's output (NHWC), equal to ``rows=1`` for every ``rows``/``mode``;
      its gradients w.r.t. ``params`` and ``x`` equal the untiled stack's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem import rowconv
      >>> layers = [rowconv.Conv(4, 3), rowconv.Act(jax.nn.relu), rowconv.Pool("max", 2)]
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 8, 3))
      >>> params = rowconv.init(layers, jax.random.PRNGKey(1), x.shape)
      >>> y = rowconv.apply(layers, params, x, rows=4, mode="overlap")
      >>> y.shape
      (1, 8, 4, 4)
      >>> bool(jnp.allclose(y, rowconv.apply(layers, params, x), rtol=1e-5, atol=1e-6))
      True
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(unroll, bool) or not isinstance(unroll, numbers.Integral) or unroll < 1:
        raise ValueError(f"unroll must be an int >= 1, got {unroll!r}")
    check_input(x)
    layers = list(layers)
    if not isinstance(params, (list, tuple)) or len(params) != len(layers):
        n = len(params) if isinstance(params, (list, tuple)) else type(params).__name__
        raise ValueError(f"params has {n} entries for {len(layers)} layers; "
                         "use rowconv.init(layers, key, input_shape)")
    params = list(params)
    check_params(layers, params, x.shape)
    segs = split_segments(layers)
    r_fp = _per_segment(rows, len(segs), "rows")
    r_bp = _per_segment(rows_bp, len(segs), "rows_bp", allow_none=True)
    for s, (a, b) in enumerate(segs):
        nf = r_fp[s]
        nb = r_bp[s] if r_bp[s] is not None else nf
        seg_layers, seg_params = layers[a:b], params[a:b]
        if nf == 1 and nb == 1:
            for i, layer in enumerate(seg_layers):
                _check_layer(layer, f"layers[{a + i}]")
            x = apply_layers(seg_layers, seg_params, x, rng, start=a)
            continue
        check_tileable(seg_layers, "layers")
        geoms = H.geometry(seg_layers, x.shape, start=a)
        H._check_rows(geoms, nf, mode)
        H._check_rows(geoms, nb, mode)
        fn = _overlap_segment if mode == "overlap" else _share_segment
        x = fn(geoms, seg_params, x, rng, nf, nb, unroll)
    return x


def segment_rows(layers: Sequence[Layer], input_shape: Sequence[int], rows: int,
                 mode: str = "overlap") -> list[int]:
    """Per-segment row counts: ``rows`` clipped to what each segment allows (its output
    rows and its halo, see ``halo._max_rows``); segments are cut by Checkpoint markers."""
    rows = H.as_rows(rows)
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    layers = list(layers)
    shape = H.check_shape(input_shape)
    out = []
    for a, b in split_segments(layers):
        geoms = H.geometry(layers[a:b], shape, start=a)
        out.append(max(1, min(rows, H._max_rows(geoms, mode))))
        shape = geoms[-1].out_shape
    return out
