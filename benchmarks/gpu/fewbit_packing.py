"""Which few-bit residual layouts does XLA keep packed? Compiled bytes per element per layer
of a frozen-weight GELU MLP (gradient w.r.t. the input).

    python benchmarks/gpu/fewbit_packing.py [OUT.json]          # the default backend
    python benchmarks/gpu/fewbit_packing.py --target h100 \\
        --out benchmarks/results/gpu_plan/fewbit_packing.json    # XLA:GPU's plan, no GPU

``--target default`` (the default) compiles for JAX's default device: run it on a machine
with a GPU to measure that GPU (``benchmarks/gpu/run_suite.sh``, ``FEWBIT=1``). ``--target
h100`` (or any GPU target of :data:`jaxmem.measure.TARGETS`) compiles for that GPU on any
machine with :func:`jaxmem.measure.compiled_memory`'s ``target=`` (the ``gpu-plan`` plugin;
no autotuning, so the figures are XLA:GPU's plan with default GEMM tiles). ``--out X.json``
also writes ``X.md``, a table of the same rows.

Per element = (bytes at depth 2L - bytes at depth L) / L / (batch * hidden), total compiled
bytes, L = 2, batch 128, hidden 512.

Variants of the forward rule's residual (same codes, same bytes, same backward):
  axis-2       bytes formed by a reduction over axis -2 of [..., G, B] (the layout XLA:GPU does
               not keep packed at 3 bits)
  current      jaxmem.fewbit.pack: reduction over the trailing axis of [..., B, G]
  barrier      the axis -2 bytes through lax.optimization_barrier
  flat         selective.bits-style: flatten, (n/G, G) groups, trailing reduction (1/2/4 bits)

The committed runs predate the rename: in ``run2_fewbit_packing.json`` "current" is today's
"axis-2"; "trailing" in run2/run3 is today's "current" (run3's "current" already was).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import fewbit
from jaxmem.fewbit.ops import _backward
from jaxmem.measure import TARGETS, compiled_memory

P = importlib.import_module("jaxmem.fewbit.pack")  # the module (jaxmem.fewbit.pack is also a function)
VARIANTS = ("axis-2", "current", "barrier", "flat")


def pack_axis2(c, bits):
    """The axis -2 layout: ``contrib[..., j, k]`` (byte k of code j) summed over the code
    axis j (axis -2). Same byte stream as :func:`jaxmem.fewbit.pack`."""
    shape = c.shape
    g, nb = P.GROUP[bits], P.GROUP_BYTES[bits]
    c = c.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    grouped = c.reshape(shape[:-1] + (shape[-1] // g, g))
    code_shift = (bits * np.arange(g, dtype=np.uint32))[:, None]  # (g, 1)
    byte_shift = (8 * np.arange(nb, dtype=np.uint32))[None, :]  # (1, nb)
    contrib = ((grouped[..., :, None] << code_shift) >> byte_shift) & jnp.uint32(0xFF)
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-2, dtype=jnp.uint8)  # [..., nb]
    return packed.reshape(P.packed_shape(shape, bits))


def pack_flat(c, bits):
    from jaxmem.selective.bits import pack_codes
    return pack_codes(c, bits)


def unpack_flat(r, bits, shape):
    from jaxmem.selective.bits import unpack_codes
    return unpack_codes(r, bits, shape)


def make(variant, bits):
    """GELU with an exact forward and a ``bits``-bit backward whose residual is packed by
    ``variant``."""
    act = fewbit.activation("gelu", bits=bits)
    borders = np.asarray(act.borders, np.float32)
    levels = np.asarray(act.levels, np.float32)

    def code(x):
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in borders:
            c = c + (x.astype(jnp.float32) >= v).astype(jnp.uint8)
        return c

    packer = {"axis-2": pack_axis2, "current": P.pack,
              "barrier": lambda c, k: jax.lax.optimization_barrier(pack_axis2(c, k)),
              "flat": pack_flat}[variant]
    unpacker = unpack_flat if variant == "flat" else P.unpack

    @jax.custom_vjp
    def op(x):
        return jax.nn.gelu(x, approximate=False)

    def fwd(x):
        return jax.nn.gelu(x, approximate=False), packer(code(x), bits)

    def bwd(res, dy):
        return (_backward(dy, unpacker(res, bits, dy.shape), levels),)

    op.defvjp(fwd, bwd)
    return op


def per_elem(act, target="default", b=128, h=512, depth=2):
    """Total compiled bytes per hidden element per added layer (slope over depth, 2 depths)."""
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h), jnp.float32)
          for i in range(2 * depth)]

    def mlp(d):
        def loss(x):
            for w in ws[:d]:
                x = act(x @ w)
            return jnp.sum(x)
        return loss

    x = jnp.asarray(np.random.default_rng(99).normal(size=(b, h)), jnp.float32)
    kw = {} if target == "default" else {"target": target}
    lo = compiled_memory(jax.grad(mlp(depth)), x, **kw).total_bytes
    hi = compiled_memory(jax.grad(mlp(2 * depth)), x, **kw).total_bytes
    return (hi - lo) / depth / (b * h)


def rows(target="default"):
    """One row per (variant, bits), after the JAX default GELU row."""
    backend = jax.default_backend() if target == "default" else f"{target} plan"
    out = [{"backend": backend, "variant": "jax default", "bits": None,
            "per_elem": per_elem(lambda x: jax.nn.gelu(x, approximate=False), target)}]
    print(json.dumps(out[-1]), flush=True)
    for variant in VARIANTS:
        for bits in (1, 2, 3, 4):
            if variant == "flat" and bits == 3:
                continue
            try:
                v = per_elem(make(variant, bits), target)
            except Exception as e:  # noqa: BLE001  (a layout XLA cannot compile is a result)
                v = repr(e)[:120]
            out.append({"backend": backend, "variant": variant, "bits": bits, "per_elem": v})
            print(json.dumps(out[-1]), flush=True)
    return out


def markdown(rs, target):
    """The rows as a Markdown table (B per hidden element per layer)."""
    where = ("JAX's default device" if target == "default"
             else f"XLA:GPU's plan for `{target}` compiled without a GPU (jax {jax.__version__}; "
                  "no autotuning: default Triton GEMM tiles, cuBLAS/cuDNN workspaces not "
                  "counted)")
    cmd = "python benchmarks/gpu/fewbit_packing.py" + \
        ("" if target == "default" else f" --target {target}") + \
        " --out benchmarks/results/gpu_plan/fewbit_packing.json"
    lines = [f"# Few-bit residual layouts: compiled bytes per element per layer ({rs[0]['backend']})",
             "",
             (f"Frozen GELU MLP (batch 128, hidden 512), gradient w.r.t. the input; slope of total "
             f"compiled bytes between depth 2 and 4, per hidden element. Compiled for {where}."),
             "", f"Regenerate: `{cmd}`", "",
             "| variant | 1 bit | 2 bits | 3 bits | 4 bits |", "|---|---|---|---|---|"]
    lines.append(f"| JAX default (f32 GELU) | {rs[0]['per_elem']:g} | | | |")
    for variant in VARIANTS:
        cells = []
        for bits in (1, 2, 3, 4):
            v = [r["per_elem"] for r in rs if r["variant"] == variant and r["bits"] == bits]
            cells.append("" if not v else (f"{v[0]:g}" if isinstance(v[0], float) else v[0]))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", ("axis-2: bytes formed by a reduction over axis -2 of `[..., G, B]`; current: "
              "`jaxmem.fewbit.pack` (trailing-axis reduction); barrier: the axis -2 bytes through "
              "`lax.optimization_barrier`; flat: `jaxmem.selective.pack_codes` (flattened codes)."),
              "The dense packing is bits/8 B per element (0.125 / 0.25 / 0.375 / 0.5).",
              ("On the H100 plan the JAX default's 32 B are the Triton split-K dot's 8 "
               "unreduced f32 partial sums of the pre-activation, kept for the backward "
               "(buffer assignment).") if target != "default" else ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_pos", nargs="?", default=None, metavar="OUT.json",
                    help="write the rows as JSON here (same as --out)")
    ap.add_argument("--target", default="default", choices=("default", *TARGETS),
                    help="'default': JAX's default device; a GPU name: XLA:GPU's plan for it "
                         "compiled here without a GPU; 'cpu': this CPU")
    ap.add_argument("--out", default=None, help="write the rows as JSON (and a .md beside it)")
    a = ap.parse_args(argv)
    out = a.out or a.out_pos
    rs = rows(a.target)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(rs, f, indent=1)
            f.write("\n")
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(markdown(rs, a.target))


if __name__ == "__main__":
    main()
