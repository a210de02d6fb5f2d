"""Which buffers are live at the peak of a compiled program (per device).

:func:`peak_buffers` compiles ``fn`` for ``args`` and reads its buffer assignment and live
ranges with :func:`jaxmem.measure.live_peak_of_lowered`: the values of the temp allocation
live together at its peak, largest first, so a per-device figure can be explained buffer by
buffer (e.g. which residual is replicated, which tile is larger).

Usage: ``from peak_buffers import peak_buffers`` inside a benchmark, or run the module for
the spatial rowconv configurations::

    python benchmarks/distributed/peak_buffers.py --side 2048 --devices 8 --tiles 16
"""
from __future__ import annotations

import os
import sys


def peak_buffers(fn, *args):
    """The :class:`jaxmem.measure.LivePeak` of ``fn`` compiled for ``args`` on this host's
    devices (``fn`` jitted unless it is already)."""
    import jax

    from jaxmem.measure import live_peak_of_lowered

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return live_peak_of_lowered(jitted.lower(*args))


def report(label, peak, top=25):
    print(f"== {label}: temp {peak.temp_bytes / 2**20:.2f} MiB, "
          f"{peak.live_bytes / 2**20:.2f} MiB live at the peak "
          f"({len(peak.buffers)} buffers)", flush=True)
    for b in peak.buffers[:top]:
        print(f"   {b.bytes / 2**20:8.2f} MiB  {b.name:40s} {b.shape}", flush=True)


def _main():
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
        os.execv(sys.executable, [sys.executable] + sys.argv)
    import argparse

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxmem import rowconv as rc
    from jaxmem.rowconv.spatial import spatial_apply, spatial_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=2048)
    ap.add_argument("--width", type=float, default=1 / 8)
    ap.add_argument("--devices", type=int, nargs="*", default=[8])
    ap.add_argument("--tiles", type=int, nargs="+", default=[16])
    ap.add_argument("--single", action="store_true", help="also the 1-device rowconv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    layers = rc.trunks.vgg_layers(width=args.width, checkpoints_at_pools=True)
    shape = (1, args.side, args.side, 3)
    params = rc.init(layers, jax.random.PRNGKey(0), shape)
    x = jnp.zeros(shape, jnp.float32)

    def grad_of(apply_fn):
        return jax.grad(lambda p, x: jnp.mean(jnp.square(apply_fn(p, x))))

    if args.single:
        for t in args.tiles:
            rows = rc.segment_rows(layers, shape, t, "overlap")
            g = grad_of(lambda p, x, rows=rows: rc.apply(layers, p, x, rows=rows))
            report(f"1 device rowconv N={t}", peak_buffers(g, params, x), args.top)
    for n in args.devices:
        mesh = Mesh(np.array(jax.devices()[:n]), ("rows",))
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "rows")))
        ps = jax.device_put(params, NamedSharding(mesh, P()))
        plan = spatial_plan(layers, shape, n)
        for t in args.tiles:
            lr = [min(t, s.local_out) for s in plan.segments]
            g = grad_of(lambda p, x, lr=lr, mesh=mesh: spatial_apply(
                layers, p, x, mesh=mesh, axis_name="rows", rows=lr))
            report(f"spatial {n} devices rows={lr}", peak_buffers(g, ps, xs), args.top)


if __name__ == "__main__":
    _main()
