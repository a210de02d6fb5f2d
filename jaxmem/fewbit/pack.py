"""Bin codes and their dense b-bit packing (b = 1, 2, 3, 4).

Codes.  ``codes(x, borders)`` is compare-and-sum, ``c = Σ_i [float32(x) >= borders_i]``
(of ``|x|`` when ``symmetric``), a ``uint8`` in ``0 .. len(borders)``.  No
``jnp.searchsorted``: in XLA:CPU it kept float32 temporaries of the input alive.

Layout.  Codes are grouped ``G`` at a time and each group is stored in ``B`` bytes with
``G * bits == 8 * B``:

=====  ===  ===  =====================================================
 bits   G    B   byte layout (little-endian bit order within the group)
=====  ===  ===  =====================================================
   1    8    1   code j in bit j
   2    4    1   code j in bits 2j..2j+1
   3    8    3   24-bit word Σ_j code_j << 3j, stored as 3 bytes (LSB first)
   4    2    1   code j in bits 4j..4j+3
=====  ===  ===  =====================================================

Grouping runs along the last axis when its size is a multiple of ``G`` (keeps the leading
axes - and their sharding - intact; packed shape ``shape[:-1] + (shape[-1] // G * B,)``),
otherwise over the flattened array padded with zero codes to a multiple of ``G`` (packed
shape ``(ceil(size / G) * B,)``).  Either way the storage is ``ceil(size*bits/8)`` bytes up
to at most ``B`` bytes of padding per tensor.  ``unpack(packed, bits, shape)`` infers the
layout from ``shape``.

Each packed byte is formed by a *reduction* (a sum of disjoint shifted bits over the group
axis, the trailing one).  This matters: XLA fuses a purely elementwise compression into its
backward consumer and then keeps the float input alive instead; a reduction output is
materialised.  (A reduction over a non-trailing axis was not enough on XLA:GPU at 3 bits: it
kept the unreduced bytes, 3 B/element; the trailing layout is packed on CPU and GPU.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GROUP", "GROUP_BYTES", "codes", "pack", "packed_shape", "unpack"]

#: codes per group and bytes per group for each bit width
GROUP = {1: 8, 2: 4, 3: 8, 4: 2}
GROUP_BYTES = {1: 1, 2: 1, 3: 3, 4: 1}


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 4:
        raise ValueError(f"bits must be an integer in 1..4, got {bits!r}")
    return int(bits)


def codes(x: jax.Array, borders, *, symmetric: bool = False) -> jax.Array:
    """Bin index ``Σ_i [x >= borders_i]`` of every element (compare in float32), uint8.

    ``NaN`` compares false everywhere (code 0); ``+inf`` gets the top code, ``-inf`` code 0.
    ``borders`` must be finite in float32 and ascending (ValueError otherwise).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array (float32, bfloat16, float16), got {x.dtype}")
    xf = x.astype(jnp.float32)
    if symmetric:
        xf = jnp.abs(xf)
    with np.errstate(over="ignore"):
        b = np.asarray(borders, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(b)) or np.any(np.diff(b) < 0):
        raise ValueError(f"borders must be finite (in float32) and sorted ascending, got "
                         f"{np.asarray(borders).tolist()!r}")
    if b.size > 255:
        raise ValueError(f"at most 255 borders fit a uint8 code, got {b.size}")
    c = jnp.zeros(x.shape, jnp.uint8)
    for v in b:  # compare-and-sum: fused elementwise, no float temporaries survive
        c = c + (xf >= v).astype(jnp.uint8)
    return c


def _along_last(shape: tuple[int, ...], bits: int) -> bool:
    return len(shape) >= 1 and shape[-1] > 0 and shape[-1] % GROUP[bits] == 0


def packed_shape(shape, bits: int) -> tuple[int, ...]:
    """Shape of ``pack(codes, bits)`` for codes of ``shape``."""
    bits = _check_bits(bits)
    shape = tuple(int(s) for s in shape)
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    if _along_last(shape, bits):
        return shape[:-1] + (shape[-1] // g * nb,)
    size = int(np.prod(shape, dtype=np.int64))
    return (-(-size // g) * nb,)


def _byte_table(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(shift, byte) per (code j, byte b): contribution ((c_j << bits*j) >> 8b) & 0xff."""
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    j = np.arange(g)[:, None]
    b = np.arange(nb)[None, :]
    return (bits * j).astype(np.uint32), (8 * b).astype(np.uint32)


def pack(c: jax.Array, bits: int) -> jax.Array:
    """Pack integer codes in ``[0, 2**bits)`` densely, ``bits`` bits per element (uint8).

    Codes out of range are masked to their low ``bits`` bits.
    """
    bits = _check_bits(bits)
    c = jnp.asarray(c)
    if not jnp.issubdtype(c.dtype, jnp.integer):
        raise TypeError(f"codes must be an integer array, got {c.dtype}")
    shape = c.shape
    g = GROUP[bits]
    c = c.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    if _along_last(shape, bits):
        grouped = c.reshape(shape[:-1] + (shape[-1] // g, g))
    else:
        flat = c.reshape(-1)
        pad = (-flat.shape[0]) % g
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad,), jnp.uint32)])
        grouped = flat.reshape(-1, g)
    shift, byte = _byte_table(bits)
    # contrib[..., b, j] = byte b of code j placed at bit offset bits*j within the group word;
    # the reduction runs over the *trailing* axis: XLA:GPU kept the unreduced [..., G, B]
    # bytes (3 B/element at 3 bits) when it ran over axis -2 (benchmarks/gpu/fewbit_packing.py)
    contrib = ((grouped[..., None, :] << shift.T) >> byte.T) & jnp.uint32(0xFF)
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-1, dtype=jnp.uint8)  # the reduction
    out_shape = packed_shape(shape, bits)
    return packed.reshape(out_shape)


def unpack(packed: jax.Array, bits: int, shape) -> jax.Array:
    """Inverse of :func:`pack`: uint8 codes of ``shape``."""
    bits = _check_bits(bits)
    shape = tuple(int(s) for s in shape)
    packed = jnp.asarray(packed)
    expect = packed_shape(shape, bits)
    if packed.shape != expect:
        raise ValueError(
            f"packed has shape {packed.shape}, expected {expect} for {bits}-bit codes of "
            f"shape {shape}"
        )
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    mask = jnp.uint32((1 << bits) - 1)
    bytes_ = packed.reshape(packed.shape[:-1] + (packed.shape[-1] // nb, nb)).astype(jnp.uint32)
    word = bytes_[..., 0]
    for b in range(1, nb):
        word = word | (bytes_[..., b] << jnp.uint32(8 * b))
    shifts = jnp.asarray(np.arange(g, dtype=np.uint32) * bits)
    c = ((word[..., None] >> shifts) & mask).astype(jnp.uint8)
    if _along_last(shape, bits):
        return c.reshape(shape)
    size = int(np.prod(shape, dtype=np.int64))
    return c.reshape(-1)[:size].reshape(shape)
