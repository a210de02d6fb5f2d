"""Which few-bit residual layouts does XLA keep packed? Compiled bytes per element per layer
of a frozen-weight GELU MLP (gradient w.r.t. the input), on the default backend.

    python benchmarks/gpu/fewbit_packing.py            # prints JSON rows

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

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import fewbit

P = importlib.import_module("jaxmem.fewbit.pack")  # the module (jaxmem.fewbit.pack is also a function)
from jaxmem.fewbit.ops import _backward
from jaxmem.measure import compiled_memory


def pack_axis2(c, bits):
    """The axis -2 layout: contrib[..., j, b] summed over the code axis j (axis -2)."""
    shape = c.shape
    g = P.GROUP[bits]
    c = c.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    grouped = c.reshape(shape[:-1] + (shape[-1] // g, g))
    shift, byte = P._byte_table(bits)  # (g, 1), (1, nb)
    contrib = ((grouped[..., :, None] << shift) >> byte) & jnp.uint32(0xFF)  # [..., g, nb]
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-2, dtype=jnp.uint8)
    return packed.reshape(P.packed_shape(shape, bits))


def pack_flat(c, bits):
    from jaxmem.selective.bits import pack_codes
    nb = {1: 1, 2: 2, 4: 4}[bits]
    return pack_codes(c, nb)


def unpack_flat(r, bits, shape):
    from jaxmem.selective.bits import unpack_codes
    return unpack_codes(r, {1: 1, 2: 2, 4: 4}[bits], shape)


def make(variant, bits):
    b = np.asarray(fewbit.activation("gelu", bits=bits).borders, np.float32)
    lv = np.asarray(fewbit.activation("gelu", bits=bits).levels, np.float32)

    def code(x):
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in b:
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
        return (_backward(dy, unpacker(res, bits, dy.shape), lv),)

    op.defvjp(fwd, bwd)
    return op


def per_elem(act, b=128, h=512, depth=2):
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h), jnp.float32)
          for i in range(2 * depth)]

    def mlp(d):
        def loss(x):
            for w in ws[:d]:
                x = act(x @ w)
            return jnp.sum(x)
        return loss

    x = jnp.ones((b, h), jnp.float32)
    lo = compiled_memory(jax.grad(mlp(depth)), x).total_bytes
    hi = compiled_memory(jax.grad(mlp(2 * depth)), x).total_bytes
    return (hi - lo) / depth / (b * h)


def main():
    rows = [{"backend": jax.default_backend(), "variant": "jax default", "bits": None,
             "per_elem": per_elem(lambda x: jax.nn.gelu(x, approximate=False))}]
    for variant in ("axis-2", "current", "barrier", "flat"):
        for bits in (1, 2, 3, 4):
            if variant == "flat" and bits == 3:
                continue
            try:
                v = per_elem(make(variant, bits))
            except Exception as e:  # noqa: BLE001
                v = repr(e)[:120]
            rows.append({"backend": jax.default_backend(), "variant": variant, "bits": bits,
                         "per_elem": v})
            print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
