"""Which buffers are live at the peak of a compiled program (per device).

XLA's dump of the compiled module (``compiler_options={"xla_dump_to": dir}``) holds a
``*-live-range.txt`` file: the instruction sequence, every buffer's live range and the list
of buffers live at the peak with their sizes. :func:`peak_buffers` compiles ``fn`` for
``args`` with that dump and returns the list, largest first, so a per-device figure can be
explained buffer by buffer (e.g. which residual is replicated, which tile is larger).

Usage: ``from peak_buffers import peak_buffers`` inside a benchmark, or run the module for
the spatial rowconv configurations::

    python benchmarks/distributed/peak_buffers.py --side 2048 --devices 8 --tiles 16
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile

_LIVE = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative: (\d+) bytes\)")


def parse_live_range(text: str) -> list[tuple[str, int]]:
    """``(buffer, bytes)`` of the 'Live ranges at N (peak)' section, largest first."""
    out, on = [], False
    for line in text.splitlines():
        if line.strip().startswith("Live ranges at") and "(peak)" in line:
            on = True
            continue
        if on:
            m = _LIVE.match(line)
            if not m:
                break
            out.append((m.group(1), int(m.group(2))))
    return sorted(out, key=lambda t: -t[1])


def peak_buffers(fn, *args, dump_dir: str | None = None):
    """``(compiled, [(buffer, bytes), ...])``: the buffers live at the compiled program's
    peak, largest first (entry computation; the peak XLA's heap simulator reports)."""
    import jax

    d = dump_dir or tempfile.mkdtemp(prefix="xla_dump_")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args).compile(compiler_options={"xla_dump_to": d})
    files = sorted(glob.glob(os.path.join(d, "*after_optimizations-live-range.txt")),
                   key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no live-range dump in {d}")
    with open(files[-1]) as fh:
        return compiled, parse_live_range(fh.read())


def hlo_shapes(compiled) -> dict:
    """``{instruction name: result type}`` of the compiled entry computation."""
    out = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def report(label, compiled, bufs, top=25):
    shapes = hlo_shapes(compiled)
    tot = sum(b for _, b in bufs)
    print(f"== {label}: {len(bufs)} buffers live at the peak, {tot / 2**20:.2f} MiB", flush=True)
    for name, b in bufs[:top]:
        base = name.split("{")[0]
        print(f"   {b / 2**20:8.2f} MiB  {name:40s} {shapes.get(base, '')}", flush=True)


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
            c, b = peak_buffers(g, params, x)
            m = c.memory_analysis()
            report(f"1 device rowconv N={t} temp {m.temp_size_in_bytes / 2**20:.2f} MiB",
                   c, b, args.top)
    for n in args.devices:
        mesh = Mesh(np.array(jax.devices()[:n]), ("rows",))
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "rows")))
        ps = jax.device_put(params, NamedSharding(mesh, P()))
        plan = spatial_plan(layers, shape, n)
        for t in args.tiles:
            lr = [min(t, s.local_out) for s in plan.segments]
            g = grad_of(lambda p, x, lr=lr, mesh=mesh: spatial_apply(
                layers, p, x, mesh=mesh, axis_name="rows", rows=lr))
            c, b = peak_buffers(g, ps, xs)
            m = c.memory_analysis()
            report(f"spatial {n} devices rows={lr} temp {m.temp_size_in_bytes / 2**20:.2f} MiB",
                   c, b, args.top)


if __name__ == "__main__":
    _main()
