"""`jaxmem bench` section for rowconv: compiled bytes and step-time ratio vs row tiles.

A training step is ``grad(mean(trunk(x)**2))`` w.r.t. all parameters of a conv trunk.
Compiled bytes come from ``jaxmem.measure.compiled_memory`` (temp + output + argument);
time is the ratio to the untiled step measured side by side (interleaved repeats, min).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmem import rowconv as rc
from jaxmem.bench import Section
from jaxmem.bench.targets import (
    GemmLog,
    check_targets,
    grouped_columns,
    prefix,
    resolve_preset,
    target_meta,
    target_notes,
)
from jaxmem.measure import compiled_memory


def make_step(layers, rows, mode, rows_bp=None, unroll=1):
    def loss(params, x):
        y = rc.apply(layers, params, x, rows=rows, mode=mode, rows_bp=rows_bp, unroll=unroll)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.grad(loss)


def setup(layers, shape, seed=0):
    params = rc.init(layers, jax.random.PRNGKey(seed), shape)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), shape, jnp.float32)
    return params, x


def compiled_bytes(layers, shape, rows, mode, rows_bp=None, params=None, x=None,
                   target="cpu"):
    if params is None:
        params, x = setup(layers, shape)
    return compiled_memory(make_step(layers, rows, mode, rows_bp), params, x, target=target)


def time_ratios(fns: dict, args, repeats=3):
    """min step time of each fn, measured interleaved; the first key is the baseline."""
    for f in fns.values():
        jax.block_until_ready(f(*args))
    ts = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[k].append(time.perf_counter() - t0)
    base = min(ts[next(iter(fns))])
    return {k: (min(v), min(v) / base) for k, v in ts.items()}


def sweep(layers, shape, configs, repeats=3, progress=None, hybrid_layers=None,
          targets=("cpu",), log: GemmLog | None = None):
    """Rows for each (label, mode, rows, rows_bp, hybrid) config; config 0 is the baseline.

    Compiled bytes on every target of ``targets`` (``<prefix>compiled_bytes``,
    ``<prefix>temp_bytes``, ``<prefix>bytes_ratio``); the time ratio on this CPU."""
    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    params, x = setup(layers, shape)
    fns, rows_out = {}, []
    for label, mode, rows, rows_bp, hybrid in configs:
        ls = hybrid_layers if hybrid else layers
        if rows != 1:
            rows = rc.segment_rows(ls, shape, rows, mode)
            if rows_bp is not None:
                rows_bp = rc.segment_rows(ls, shape, rows_bp, mode)
        if progress:
            progress(f"rowconv: compiling {label}")
        step = make_step(ls, rows, mode, rows_bp)
        row = {"config": label, "mode": mode if rows != 1 else "untiled",
               "rows": str(rows), "rows_bp": str(rows_bp or rows)}
        for tgt in targets:  # CPU last: jax.jit(step) below reuses its compile
            cm = log.compiled(step, params if not hybrid else _hparams(ls, layers, params), x,
                              target=tgt, what=label)
            row[f"{prefix(tgt)}compiled_bytes"] = cm.total_bytes
            row[f"{prefix(tgt)}temp_bytes"] = cm.temp_bytes
        fns[label] = (jax.jit(step), hybrid)
        rows_out.append(row)
    hp = _hparams(hybrid_layers, layers, params) if hybrid_layers is not None else None
    calls = {k: (lambda f=f, h=h: f(hp if h else params, x)) for k, (f, h) in fns.items()}
    if progress:
        progress("rowconv: timing")
    tr = time_ratios({k: (lambda c=c: c()) for k, c in calls.items()}, (), repeats)
    for tgt in targets:
        base = rows_out[0][f"{prefix(tgt)}compiled_bytes"]
        for r in rows_out:
            r[f"{prefix(tgt)}bytes_ratio"] = base / r[f"{prefix(tgt)}compiled_bytes"]
    for r in rows_out:
        r["time_s"], r["time_ratio"] = tr[r["config"]]
    return rows_out


def _hparams(hlayers, layers, params):
    """Params of ``layers`` re-aligned to ``hlayers`` (same layers plus Checkpoint markers)."""
    out, it = [], iter(params)
    for layer in hlayers:
        out.append({} if isinstance(layer, rc.Checkpoint) else next(it))
    return out


#: per preset: image side, plain tilings and hybrid tilings (Checkpoint after every pool) as
#: (mode, N) pairs, timing repeats. At 256x256 plain ``overlap`` tiles clip to 1 row (the
#: halo of the whole trunk is too tall), so the default runs 2PS only among the plain ones.
_BOTH = ("overlap", "share")
PRESET_SIZES = {
    "quick": {"side": 256, "plain": [(m, 2) for m in _BOTH],
              "hybrid": [(m, 8) for m in _BOTH], "repeats": 2},
    "default": {"side": 256, "plain": [("share", 4)], "hybrid": [("overlap", 8)],
                "repeats": 3},
    "full": {"side": 512, "plain": [(m, n) for n in (2, 4) for m in _BOTH],
             "hybrid": [(m, n) for n in (4, 8, 16) for m in _BOTH], "repeats": 3},
}
_LABEL = {"overlap": "OverL", "share": "2PS"}


def run(quick: bool = False, models=None, progress: Callable[[str], None] | None = None, *,
        preset: str | None = None, targets=("cpu",)) -> Section:
    """VGG-16 trunk (width 1/8) train step vs row tiles, compiled bytes on every target of
    ``targets``. ``preset`` (default: ``"quick"`` if ``quick`` else ``"full"``;
    :data:`PRESET_SIZES`): ``"quick"`` 256x256, N=2 and hybrid N=8; ``"default"``
    (``jaxmem bench``) 256x256, 2PS N=4 and OverL-H N=8; ``"full"`` (``jaxmem bench --full``)
    512x512, N=2, 4 and hybrid N=4, 8, 16."""
    preset = resolve_preset(quick, preset)
    targets = check_targets(targets)
    P = PRESET_SIZES[preset]
    log = GemmLog()
    width = 1 / 8
    side = P["side"]
    shape = (1, side, side, 3)
    layers = rc.trunks.vgg_layers(width=width)
    hlayers = rc.trunks.vgg_layers(width=width, checkpoints_at_pools=True)
    configs = [("untiled", "overlap", 1, None, False)]
    configs += [(f"{_LABEL[m]} N={n}", m, n, None, False) for m, n in P["plain"]]
    configs += [(f"{_LABEL[m]}-H N={n}", m, n, None, True) for m, n in P["hybrid"]]
    rows = sweep(layers, shape, configs, repeats=P["repeats"], progress=progress,
                 hybrid_layers=hlayers, targets=targets, log=log)
    units = {"time_ratio": "x"}
    for t in targets:
        units.update({f"{prefix(t)}compiled_bytes": "B", f"{prefix(t)}bytes_ratio": "x"})
    return Section(
        name="rowconv",
        title=f"rowconv: VGG-16 trunk (width {width}) at {side}x{side}, train step vs row tiles",
        columns=(["config", "rows"] + grouped_columns(targets, ["compiled_bytes", "bytes_ratio"])
                 + ["time_ratio"]),
        rows=rows,
        units=units,
        notes=[
            "compiled bytes = temp + output + argument of the jitted grad step "
            "(jaxmem.measure.compiled_memory); bytes_ratio = untiled / tiled",
            "time_ratio = tiled step time / untiled, min of interleaved repeats in one process "
            "(CPU)",
            "OverL = mode='overlap', 2PS = mode='share'; -H = Checkpoint after every pool; "
            "rows are clipped per segment to what its halo allows (rowconv.segment_rows)",
            f"preset {preset}: {side}x{side}, batch 1, {len(configs) - 1} tilings, "
            f"{P['repeats']} timing repeats; full sweep: .venv/bin/python "
            "benchmarks/rowconv/bench_trunks.py",
            *target_notes(targets, log, cpu_only="time ratios"),
        ],
        meta={"shape": shape, "width": width, "preset": preset, "quick": preset == "quick",
              **target_meta(targets, log)},
    )
