"""Budget-driven choice of mode and row counts (the paper's Sec. III-C / IV analysis).

Space model per tiled segment (bytes, f32 activations), following the paper's Eqs. (6)-(10):

* fixed: the segment's input and output maps (kept whole: they are the checkpoints),
  plus parameters and their gradients;
* per tile, backward (the larger phase, Eq. 8): every layer's input window is kept for
  the tile's vjp, ``sum_l B * L_in(l) * W_l * C_l * itemsize``;
* share (2PS) adds the carried boundary rows of every tile, ``n * sum_l carry_l * ...``
  (the paper's *sharing data*).

The estimate picks candidates; with ``verify=True`` (default) each pick is compiled and
its real compiled bytes (``jaxmem.measure.compiled_memory``) decide. Among configurations
that fit, the one with the fewest rows wins (least coordination), then the least
recomputed rows (overlap halos), then overlap before share.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxmem._prims.tree import walk

from . import halo as H
from .layers import Layer
from .tiled import MODES, split_segments


@dataclasses.dataclass
class Tiling:
    """Result of :func:`plan`: the tiling mode and row counts chosen for a budget.

    ``rows``/``rows_bp`` hold the forward/backward tile counts per segment (segments are cut
    at ``Checkpoint`` markers); ``compiled_bytes`` is None unless ``verify=True`` compiled it.
    """

    mode: str
    rows: list  # N_fp per segment
    rows_bp: list  # N_bp per segment
    estimated_bytes: int
    compiled_bytes: int | None
    recompute_fraction: float  # extra rows computed / rows of the untiled stack
    fits: bool
    target: str = "cpu"  # whose compiled bytes ``compiled_bytes`` are


def _row_bytes(shape, itemsize):
    return shape[0] * shape[2] * shape[3] * itemsize


def estimate(layers: Sequence[Layer], input_shape: Sequence[int], mode: str,
             rows: int | Sequence[int], itemsize: int = 4) -> tuple[int, float]:
    """(estimated bytes, recompute fraction) of a train step for per-segment ``rows``."""
    from .tiled import _per_segment
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    layers = list(layers)
    rows = _per_segment(rows, len(split_segments(layers)), "rows")
    shape = H.check_shape(input_shape)
    total_fixed = math.prod(shape) * itemsize
    peak_tile, extra, base = 0, 0, 0
    for s, (a, b) in enumerate(split_segments(layers)):
        geoms = H.geometry(layers[a:b], shape, start=a)
        out = geoms[-1].out_shape
        total_fixed += math.prod(out) * itemsize
        n = rows[s]
        full = sum(math.prod(nd.in_shape) * itemsize for nd in walk(geoms))
        base += sum(g.in_shape[1] for g in walk(geoms))
        if n == 1:
            peak_tile = max(peak_tile, full)
        elif mode == "overlap":
            T, starts = H.overlap_starts(out[1], n)
            nodes, _ = H.overlap_plan(geoms, T)
            tile = sum(nd.iv_in.L * _row_bytes(nd.geom.in_shape, itemsize) for nd in walk(nodes))
            peak_tile = max(peak_tile, tile)
            extra += sum(len(starts) * nd.iv_in.L - nd.geom.in_shape[1] for nd in walk(nodes))
        else:
            nodes, slots, T, nt, _, _ = H.share_plan(geoms, n)
            tile = sum((nd.win or nd.T_in) * _row_bytes(nd.geom.in_shape, itemsize)
                       for nd in walk(nodes))
            carry = sum(h * _row_bytes(sh, itemsize) for _, sh, h in slots) * nt
            peak_tile = max(peak_tile, tile + carry)
            extra += sum(nt * nd.T_in - nd.geom.in_shape[1] for nd in walk(nodes))
        shape = out
    # x2.5: the kept layer inputs plus activation residuals and live cotangents, a factor
    # calibrated on the VGG trunk against compiled bytes (plan() verifies by compiling)
    return int(total_fixed + 2.5 * peak_tile), extra / max(1, base)


def plan(layers: Sequence[Layer], input_shape: Sequence[int], budget_bytes: int,
         modes: str | Sequence[str] = MODES, max_rows: int = 64,
         verify: bool = True, params_bytes: int | None = None,
         target: str = "cpu") -> Tiling:
    """Pick mode and rows (per segment) whose train step fits ``budget_bytes``.

    ``target``: whose compiled bytes ``verify`` checks against, ``"cpu"`` or a GPU plan
    (``"h100"``, ... as :func:`jaxmem.measure.compiled_memory` takes it; compiled here
    without a GPU, needs the ``gpu-plan`` extra). XLA:GPU plans a tiled step differently
    from XLA:CPU (VGG-16 at 1024², 16 rows: 31.5 MiB on the H100 plan, 43.7 on CPU), so a
    tiling checked on one is not checked on the other. The estimate is the same for every
    target. Raises ValueError (naming the smallest reachable size) if nothing fits.
    """
    from jaxmem.measure.target import check_target

    from .tiled import segment_rows
    target = check_target(target, 1, "rowconv.plan")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real) \
            or not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be a number > 0, got {budget_bytes!r}")
    if isinstance(modes, str):
        modes = (modes,)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be drawn from {MODES}, got {m!r}")
    max_rows = H.as_rows(max_rows, "max_rows")
    input_shape = H.check_shape(input_shape)
    layers = list(layers)
    cands = []
    seen = set()
    n = 1
    while n <= max_rows:
        for m in modes:
            rows = segment_rows(layers, input_shape, n, m) if n > 1 else \
                [1] * len(split_segments(layers))
            key = (m, tuple(rows))
            if key in seen:
                continue
            seen.add(key)
            est, rec = estimate(layers, input_shape, m, rows)
            cands.append((max(rows), rec, MODES.index(m), m, rows, est))
        n *= 2
    cands.sort(key=lambda c: (c[0], c[1], c[2]))
    best_est = None
    for _, rec, _, m, rows, est in cands:
        best_est = est if best_est is None else min(best_est, est)
        if est > budget_bytes * (1.5 if verify else 1.0):
            continue
        cb = _compiled(layers, input_shape, m, rows, target) if verify else None
        size = cb if cb is not None else est
        if size <= budget_bytes:
            return Tiling(m, rows, rows, est, cb, rec, True, target)
    raise ValueError(
        f"no mode/rows up to max_rows={max_rows} fits budget_bytes={budget_bytes} "
        f"(smallest estimate {best_est} bytes); add rowconv.Checkpoint() markers, raise "
        "max_rows, or reduce the batch/image size")


def _compiled(layers, input_shape, mode, rows, target="cpu"):
    from jaxmem.measure import compiled_memory

    from . import apply, init
    params = jax.eval_shape(lambda: init(layers, jax.random.PRNGKey(0), input_shape))
    x = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)

    def step(p, x):
        return jax.grad(lambda p: jnp.mean(jnp.square(apply(layers, p, x, rows=rows,
                                                              mode=mode))))(p)

    return compiled_memory(step, params, x, target=target).total_bytes
