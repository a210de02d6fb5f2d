"""Spatial rowconv benchmark: the VGG-16 trunk with the image height split over devices.

For 4 and 8 (host) devices, a train step ``grad(mean(trunk(x)**2))`` w.r.t. the parameters:

* single-device rowconv (OverL-H, 16 row tiles per segment) and the untiled stack;
* the all-gather approach: the same rowconv step under plain ``jit`` with ``x`` sharded
  ``PartitionSpec(None, 'rows')`` (XLA's partitioner gathers the image);
* ``rowconv.spatial.spatial_apply``: every device holds H/n rows, exchanges halo rows with its
  neighbours and tiles its own rows (1 tile, or 16 tiles per segment).

Reported: per-device compiled bytes (temp + output + argument - alias), the collectives of
the compiled program (count, bytes) next to the halo formula, and step-time ratios measured
side by side in one process. Writes ``benchmarks/results/distributed/rowconv_spatial.{md,json}``.

Run:  .venv/bin/python benchmarks/distributed/rowconv_spatial.py [--side 2048] [--no-time]
(the script re-executes itself with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""
from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.execv(sys.executable, [sys.executable] + sys.argv)

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem import rowconv as rc
from jaxmem.distributed import compiled_collectives
from jaxmem.measure import compiled_memory
from jaxmem.rowconv.spatial import spatial_apply, spatial_plan

HERE = os.path.dirname(os.path.abspath(__file__))
#: row groups: untiled and rowconv on one device, the all-gather rows, spatial_apply on a
#: one-device mesh (the same code as the spatial rows, no halo exchange), spatial rows
ONLY = ("untiled", "single", "allgather", "spatial1", "spatial")
OUT = os.path.join(HERE, "..", "results", "distributed")
MIB = 2.0 ** 20


def loss_of(apply_fn):
    def loss(params, x):
        return jnp.mean(jnp.square(apply_fn(params, x).astype(jnp.float32)))
    return jax.grad(loss)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=2048)
    ap.add_argument("--width", type=float, default=1 / 8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tiles", type=int, default=16)
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--md-only", action="store_true")
    ap.add_argument("--only", nargs="+", choices=ONLY, default=None,
                    help="measure only these rows and merge them into the existing json "
                         "(rows with the same config and devices are replaced; times of "
                         "other rows are kept; no timing unless --time)")
    ap.add_argument("--time", action="store_true",
                    help="with --only: also time the measured rows and the 1-device rowconv "
                         "side by side (their entries replace the stored ones)")
    ap.add_argument("--spatial-tiles", type=int, nargs="+", default=None,
                    help="tiles per device of the spatial rows (default: 1 and --tiles)")
    args = ap.parse_args()
    if args.md_only:
        return md_only()
    want = set(args.only or ONLY)
    if args.only and not args.time:
        args.no_time = True
    spatial_tiles = args.spatial_tiles or [1, args.tiles]

    layers = rc.trunks.vgg_layers(width=args.width, checkpoints_at_pools=True)
    shape = (args.batch, args.side, args.side, 3)
    params = rc.init(layers, jax.random.PRNGKey(0), shape)
    x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
    rows1 = rc.segment_rows(layers, shape, args.tiles, "overlap")
    dev0 = jax.devices()[0]
    rows, fns = [], {}

    def record(label, devices, step, p, xa, plan=None, local_rows=None):
        print(f"compiling {label}", flush=True)
        t0 = time.perf_counter()
        cm = compiled_memory(step, p, xa)
        col = compiled_collectives(jax.jit(step), p, xa)
        r = {"config": label, "devices": devices, "rows": str(local_rows),
             "compiled_bytes": cm.total_bytes, "temp_bytes": cm.temp_bytes,
             "collectives": col.counts, "collective_bytes": col.bytes,
             "compile_s": round(time.perf_counter() - t0, 1)}
        if plan is not None:
            cnt, nb = plan.permutes(batch=args.batch, itemsize=4, grad_input=False)
            r["predicted_permutes"] = cnt
            r["predicted_permute_bytes"] = nb
            r["halo_rows"] = [(s.top, s.bottom) for s in plan.segments]
            r["halo_bytes"] = sum(s.permute_bytes(args.batch, 4) for s in plan.segments)
        rows.append(r)
        print(f"  {cm.total_bytes / MIB:.1f} MiB, {col.counts}", flush=True)
        return r

    p0 = jax.device_put(params, dev0)
    x0 = jax.device_put(x, dev0)
    untiled = loss_of(lambda p, x: rc.apply(layers, p, x))
    single = loss_of(lambda p, x: rc.apply(layers, p, x, rows=rows1))
    if "untiled" in want:
        record("untiled (1 device)", 1, untiled, p0, x0)
    if "single" in want or not args.no_time:
        record(f"rowconv OverL-H N={args.tiles} (1 device)", 1, single, p0, x0,
               local_rows=rows1)
        fns["rowconv 1 device"] = (jax.jit(single), p0, x0)

    for n in ([1] if "spatial1" in want else []) + list(args.devices):
        mesh = Mesh(np.array(jax.devices()[:n]), ("rows",))
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "rows")))
        ps = jax.device_put(params, NamedSharding(mesh, P()))
        if n > 1 and "allgather" in want:
            record("all-gather: jit(rowconv), x height-sharded", n, single, ps, xs,
                   local_rows=rows1)
            fns[f"all-gather {n} dev"] = (jax.jit(single), ps, xs)
        if n > 1 and "spatial" not in want:
            continue
        plan = spatial_plan(layers, shape, n)
        for t in ([args.tiles] if n == 1 else spatial_tiles):
            lr = [min(t, s.local_out) for s in plan.segments]
            step = loss_of(lambda p, x, lr=lr, mesh=mesh: spatial_apply(
                layers, p, x, mesh=mesh, axis_name="rows", rows=lr))
            label = (f"spatial, {t} tile(s) per device" if n > 1 else
                     f"spatial_apply on a 1-device mesh, N={t} (same code, no halo)")
            record(label, n, step, ps, xs, plan if n > 1 else None, lr)
            fns[f"spatial {n} dev, {t} tiles"] = (jax.jit(step), ps, xs)

    param_bytes = sum(v.size * 4 for v in jax.tree.leaves(params))
    old_times = {}
    if args.only:  # merge into the stored rows
        with open(os.path.join(OUT, "rowconv_spatial.json")) as fh:
            stored = json.load(fh)
        new_keys = {(r["config"], r["devices"]) for r in rows}
        rows = [r for r in stored["rows"] if (r["config"], r["devices"]) not in new_keys] + rows
        order = {c: i for i, c in enumerate(ONLY)}
        rows.sort(key=lambda r: (r["devices"] if r["devices"] > 1 else 0,
                                 order.get(_group(r["config"]), 9), r["config"]))
        old_times = stored.get("times", {})
    add_targets(rows, param_bytes)

    times = old_times
    if not args.no_time:
        print("timing", flush=True)
        for f, p, xa in fns.values():
            jax.block_until_ready(f(p, xa))
        ts = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, (f, p, xa) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(p, xa))
                ts[k].append(time.perf_counter() - t0)
        base = min(ts["rowconv 1 device"])
        times = dict(times)
        times.update({k: {"time_s": min(v), "ratio_vs_single_rowconv": min(v) / base}
                      for k, v in ts.items()})
        for k, v in times.items():
            print(f"  {k}: {v['time_s']:.2f} s ({v['ratio_vs_single_rowconv']:.2f}x)")

    meta = {"side": args.side, "width": args.width, "batch": args.batch, "tiles": args.tiles,
            "layers": "rc.trunks.vgg_layers(width, checkpoints_at_pools=True)",
            "param_bytes": param_bytes, "jax": jax.__version__, "backend": jax.default_backend(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, 8 host devices"}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "rowconv_spatial.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows, "times": times}, fh, indent=1)
    write_md(meta, rows, times)


def _group(config):
    if config.startswith("untiled"):
        return "untiled"
    if config.startswith("rowconv"):
        return "single"
    if config.startswith("all-gather"):
        return "allgather"
    return "spatial"


def add_targets(rows, param_bytes):
    """Per-device targets: rowconv/n + halos; the same with the replicated parameter state
    left undivided (3 x param_bytes on every device: the parameters, their gradient and
    the device's partial gradient before the psum over the devices); and the spatial code
    on a one-device mesh / n + halos."""
    single = next(r for r in rows if r["config"].startswith("rowconv"))["compiled_bytes"]
    same = next((r["compiled_bytes"] for r in rows if r["config"].startswith("spatial_apply")),
                None)
    for r in rows:
        r["bytes_vs_single_rowconv"] = r["compiled_bytes"] / single
        if r["devices"] > 1 and "halo_bytes" in r:
            n, h = r["devices"], r["halo_bytes"]
            if same is not None:
                r["target_same_code_bytes"] = same / n + h
                r["meets_target_same_code"] = bool(
                    r["compiled_bytes"] <= r["target_same_code_bytes"])
            r["target_bytes"] = single / n + h
            r["meets_target"] = bool(r["compiled_bytes"] <= r["target_bytes"])
            r["target_replicated_params_bytes"] = (single - 3 * param_bytes) / n \
                + 3 * param_bytes + h
            r["meets_target_replicated_params"] = bool(
                r["compiled_bytes"] <= r["target_replicated_params_bytes"])


def _ok(flag):
    return "met" if flag else "missed"


def write_md(meta, rows, times):
    L = [(f"# Spatial rowconv: VGG-16 trunk at {meta['side']}x{meta['side']}, height split "
          "over devices"),
         "",
         (f"Width {meta['width']:g} of VGG-16's channels (CPU-scaled), batch {meta['batch']}, "
          f"segments cut after every pool (`{meta['layers']}`); train step = grad of "
          "mean(y^2) w.r.t. the parameters. Compiled bytes per device (temp + output + "
          f"argument - alias); jax {meta['jax']} on {meta['backend']} ({meta['machine']}). "
          f"Parameters: {meta['param_bytes'] / MIB:.2f} MiB, replicated on every device "
          "(and so are their gradients). Targets: `rowconv/n + halos` = 1-device rowconv "
          "bytes / devices + the halo rows a device receives (one direction); `params "
          "replicated`: the same with 3 x the parameter bytes left undivided (parameters, "
          "their gradient, and the device's partial weight gradient before its psum: the "
          "measured temp above rowconv temp / n is 0.94 MiB at 4 and 0.96 MiB at 8 devices, "
          "one parameter-sized buffer); last target: `spatial_apply` on a 1-device mesh "
          "(the same code, no exchange) / devices + halos."),
         "",
         ("| config | devices | tiles/segment | MiB per device | vs 1-device rowconv | "
          "target rowconv/n + halos | same, params replicated | spatial_apply 1-device/n "
          "+ halos | collective-permute (count, KiB) | predicted | all-gather | all-reduce "
          "| compile s |"),
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, b = r["collectives"], r["collective_bytes"]
        tgt = (f"{r['target_bytes'] / MIB:.1f} MiB ({_ok(r['meets_target'])})"
               if "target_bytes" in r else "")
        tgt2 = (f"{r['target_replicated_params_bytes'] / MIB:.1f} MiB "
                f"({_ok(r['meets_target_replicated_params'])})" if "target_bytes" in r else "")
        tgt3 = (f"{r['target_same_code_bytes'] / MIB:.1f} MiB "
                f"({_ok(r['meets_target_same_code'])})" if "target_same_code_bytes" in r else "")
        pred = (f"{r['predicted_permutes']}, {r['predicted_permute_bytes'] / 1024:.0f}"
                if "predicted_permutes" in r else "")
        L.append(f"| {r['config']} | {r['devices']} | {r['rows']} | "
                 f"{r['compiled_bytes'] / MIB:.1f} | {r['bytes_vs_single_rowconv']:.3f} | {tgt} | "
                 f"{tgt2} | {tgt3} | {c['collective-permute']}, {b['collective-permute'] / 1024:.0f} | "
                 f"{pred} | {c['all-gather']} ({b['all-gather'] / MIB:.1f} MiB) | "
                 f"{c['all-reduce']} ({b['all-reduce'] / 1024:.0f} KiB) | {r['compile_s']} |")
    if times:
        L += ["", ("Step time (min of repeats; each ratio is taken against the 1-device "
                   "rowconv step timed side by side in the same process, whose time is in the "
                   "third column: rows timed in different runs compare by ratio only; the 8 "
                   "host devices share the machine's cores, so this is the cost of the "
                   "partitioning, not a multi-device speed-up):"), "",
              "| step | time s | 1-device rowconv, same run, s | vs 1-device rowconv |",
              "|---|---|---|---|"]
        for k, v in times.items():
            base = v["time_s"] / v["ratio_vs_single_rowconv"]
            L.append(f"| {k} | {v['time_s']:.2f} | {base:.2f} | "
                     f"{v['ratio_vs_single_rowconv']:.2f}x |")
    L += ["", ("Where a spatial device's bytes go (buffers live at the compiled program's "
               "peak: `benchmarks/distributed/peak_buffers.py --devices 8 --tiles 16 "
               "--single`): the same blocks as 1-device rowconv divided by the devices (its "
               "input rows, each segment's output block kept for the backward, the "
               "backward's accumulator of one block, one sub-tile's activations), plus the "
               "replicated parameter state (parameters as argument, their gradient as output, "
               "the device's partial weight gradient before the psum in temp) and the halo "
               "rows. The backward's zero accumulators depend on the incoming cotangent and "
               "its window copies are built in the backward, so XLA neither creates them "
               "at the program start nor shares them with the forward (such buffers would "
               "stay alive through the whole forward: one extra block per segment)."),
          "", ("Halo formula (per device, per segment with input width W and C channels, "
               "batch B, 4-byte floats): one collective-permute per non-zero top / bottom "
               "halo, (top + bottom) * B * W * C * 4 bytes, forward; the backward repeats it "
               "for every segment whose input is differentiated (all but the first here: the "
               "image itself is not). `SpatialPlan.permutes` gives the predicted column."),
          "", ("Reproduce: `.venv/bin/python benchmarks/distributed/rowconv_spatial.py "
               f"--side {meta['side']}` (`--md-only` rewrites this table from the json)")]
    with open(os.path.join(OUT, "rowconv_spatial.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")


def md_only():
    with open(os.path.join(OUT, "rowconv_spatial.json")) as fh:
        data = json.load(fh)
    meta = data["meta"]
    if "param_bytes" not in meta:
        layers = rc.trunks.vgg_layers(width=meta["width"], checkpoints_at_pools=True)
        shape = (meta["batch"], meta["side"], meta["side"], 3)
        p = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
        meta["param_bytes"] = sum(v.size * 4 for v in jax.tree.leaves(p))
    add_targets(data["rows"], meta["param_bytes"])
    with open(os.path.join(OUT, "rowconv_spatial.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    write_md(meta, data["rows"], data["times"])


if __name__ == "__main__":
    main()
