"""Which few-bit residual layouts does XLA keep packed? Compiled bytes per element per layer
of a frozen-weight GELU MLP (gradient w.r.t. the input), on the default backend.

    python benchmarks/gpu/fewbit_packing.py            # prints JSON rows

Variants of the forward rule's residual (same codes, same backward):
  current      jaxmem.fewbit.pack (group reduction over axis -2 of [..., G, B])
  barrier      the packed bytes through lax.optimization_barrier
  trailing     bytes formed by a reduction over the trailing axis ([..., B, G] -> sum(-1))
  flat         selective.bits-style: flatten, (n/G, G) groups, trailing reduction (1/2/4 bits)
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


def pack_trailing(c, bits):
    shape = c.shape
    g, _nb = P.GROUP[bits], P.GROUP_BYTES[bits]
    c = c.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    grouped = c.reshape(shape[:-1] + (shape[-1] // g, g))
    shift, byte = P._byte_table(bits)  # (g,1), (1,nb)
    contrib = ((grouped[..., None, :] << shift.T) >> byte.T) & jnp.uint32(0xFF)  # [..., nb, g]
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-1, dtype=jnp.uint8)
    return packed.reshape(P.packed_shape(shape, bits))


def pack_flat(c, bits):
    from jaxmem.selective.bits import pack_codes
    nb = {1: 1, 2: 2, 4: 4}[bits]
    return pack_codes(c, nb)


def unpack_flat(r, bits, shape):
    from jaxmem.selective.bits import unpack_codes
    return unpack_codes(r, {1: 1, 2: 2, 4: 4}[bits], shape)


def make(variant, bits):
    ref = fewbit.gelu
    b = np.asarray(fewbit.activation("gelu", bits=bits).borders, np.float32)
    lv = np.asarray(fewbit.activation("gelu", bits=bits).levels, np.float32)

    def code(x):
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in b:
            c = c + (x.astype(jnp.float32) >= v).astype(jnp.uint8)
        return c

    packer = {"current": P.pack, "barrier": lambda c, k: jax.lax.optimization_barrier(P.pack(c, k)),
              "trailing": pack_trailing, "flat": pack_flat}[variant]
    unpacker = unpack_flat if variant == "flat" else P.unpack

    @jax.custom_vjp
    def op(x):
        return jax.nn.gelu(x, approximate=False)

    def fwd(x):
        return jax.nn.gelu(x, approximate=False), packer(code(x), bits)

    def bwd(res, dy):
        return (_backward(dy, unpacker(res, bits, dy.shape), lv),)

    op.defvjp(fwd, bwd)
    del ref
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
    for variant in ("current", "barrier", "trailing", "flat"):
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
