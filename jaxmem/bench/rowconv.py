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


def compiled_bytes(layers, shape, rows, mode, rows_bp=None, params=None, x=None):
    if params is None:
        params, x = setup(layers, shape)
    return compiled_memory(make_step(layers, rows, mode, rows_bp), params, x)


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


def sweep(layers, shape, configs, repeats=3, progress=None, hybrid_layers=None):
    """Rows for each (label, mode, rows, rows_bp, hybrid) config; config 0 is the baseline."""
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
        cm = compiled_memory(step, params if not hybrid else _hparams(ls, layers, params), x)
        fns[label] = (jax.jit(step), hybrid)
        rows_out.append({"config": label, "mode": mode if rows != 1 else "untiled",
                         "rows": str(rows), "rows_bp": str(rows_bp or rows),
                         "compiled_bytes": cm.total_bytes, "temp_bytes": cm.temp_bytes})
    hp = _hparams(hybrid_layers, layers, params) if hybrid_layers is not None else None
    calls = {k: (lambda f=f, h=h: f(hp if h else params, x)) for k, (f, h) in fns.items()}
    if progress:
        progress("rowconv: timing")
    tr = time_ratios({k: (lambda c=c: c()) for k, c in calls.items()}, (), repeats)
    base = rows_out[0]["compiled_bytes"]
    for r in rows_out:
        r["time_s"], r["time_ratio"] = tr[r["config"]]
        r["bytes_ratio"] = base / r["compiled_bytes"]
    return rows_out


def _hparams(hlayers, layers, params):
    """Params of ``layers`` re-aligned to ``hlayers`` (same layers plus Checkpoint markers)."""
    out, it = [], iter(params)
    for layer in hlayers:
        out.append({} if isinstance(layer, rc.Checkpoint) else next(it))
    return out


def run(quick: bool = False, models=None, progress: Callable[[str], None] | None = None
        ) -> Section:
    width = 1 / 8
    side = 256 if quick else 512
    shape = (1, side, side, 3)
    layers = rc.trunks.vgg_layers(width=width)
    hlayers = rc.trunks.vgg_layers(width=width, checkpoints_at_pools=True)
    configs = [("untiled", "overlap", 1, None, False)]
    plain_ns = (2,) if quick else (2, 4)
    for n in plain_ns:
        configs.append((f"OverL N={n}", "overlap", n, None, False))
        configs.append((f"2PS N={n}", "share", n, None, False))
    for n in ((8,) if quick else (4, 8, 16)):
        configs.append((f"OverL-H N={n}", "overlap", n, None, True))
        configs.append((f"2PS-H N={n}", "share", n, None, True))
    rows = sweep(layers, shape, configs, repeats=2 if quick else 3, progress=progress,
                 hybrid_layers=hlayers)
    return Section(
        name="rowconv",
        title=f"rowconv: VGG-16 trunk (width {width}) at {side}x{side}, train step vs row tiles",
        columns=["config", "rows", "compiled_bytes", "bytes_ratio", "time_ratio"],
        rows=rows,
        units={"compiled_bytes": "B", "bytes_ratio": "x", "time_ratio": "x"},
        notes=[
            "compiled bytes = temp + output + argument of the jitted grad step "
            "(jaxmem.measure.compiled_memory); bytes_ratio = untiled / tiled",
            "time_ratio = tiled step time / untiled, min of interleaved repeats in one process",
            "OverL = mode='overlap', 2PS = mode='share'; -H = Checkpoint after every pool; "
            "rows are clipped per segment to what its halo allows (rowconv.segment_rows)",
            "full sweep: .venv/bin/python benchmarks/rowconv/bench_trunks.py",
        ],
        meta={"shape": shape, "width": width, "jax": jax.__version__},
    )
