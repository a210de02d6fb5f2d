"""Dense ``b``-bit packing of integer codes into ``uint8`` (b = 1, 2, 3, 4, 8).

Layout.  Codes are taken ``G`` at a time and each group is stored in ``B`` bytes with
``G * b == 8 * B``; within a group the codes form a little-endian word::

    word = sum_{j < G} code_j << (b * j),   byte_k = (word >> 8 k) & 0xff   (k < B)

=====  ===  ===  ==============================================
  b     G    B   byte layout
=====  ===  ===  ==============================================
  1     8    1   code j in bit j
  2     4    1   code j in bits 2j..2j+1
  3     8    3   24-bit word, stored as 3 bytes (LSB first)
  4     2    1   code j in bits 4j..4j+3
  8     1    1   the code itself
=====  ===  ===  ==============================================

Groups run along the last axis when its size is a positive multiple of ``G`` (the leading
axes, and their sharding, are kept: packed shape ``shape[:-1] + (shape[-1] // G * B,)``),
otherwise over the row-major flattened codes padded with zero codes to a multiple of ``G``
(packed shape ``(ceil(size / G) * B,)``).  Both give the same byte stream: the packed bytes
in row-major order are the groups of the flattened codes in order, so ``pack(c).ravel()``
does not depend on the layout chosen.  ``unpack(packed, b, shape)`` infers it from ``shape``.

Each byte is formed by a *reduction* (a sum of disjoint shifted bits over the trailing group
axis).  That is what makes XLA store the packed bytes: an elementwise code (``x > 0``) is fused
into its backward consumer and XLA keeps the float input alive instead, whereas a reduction
output is materialised.  (A reduction over a non-trailing axis kept the unreduced bytes on
XLA:GPU at 3 bits; the trailing-axis reduction is packed on CPU and GPU.)
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._prims.checks import check_bits

__all__ = ["BITS", "GROUP", "GROUP_BYTES", "pack", "packed_shape", "packed_size", "unpack"]

#: bit widths the packer supports
BITS = (1, 2, 3, 4, 8)
#: codes per group and bytes per group for each bit width
GROUP = {1: 8, 2: 4, 3: 8, 4: 2, 8: 1}
GROUP_BYTES = {1: 1, 2: 1, 3: 3, 4: 1, 8: 1}


def _check_shape(shape, name: str = "shape") -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints >= 0, got {shape!r}") from None
    out = []
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"{name} must be a sequence of ints >= 0, got {shape!r}")
        out.append(int(d))
    return tuple(out)


def _along_last(shape: tuple[int, ...], bits: int) -> bool:
    return len(shape) >= 1 and shape[-1] > 0 and shape[-1] % GROUP[bits] == 0


def packed_size(num_elements: int, bits: int = 1) -> int:
    """Number of bytes that ``num_elements`` codes of ``bits`` bits pack into (either
    layout): ``ceil(num_elements / G) * B``."""
    bits = check_bits(bits, BITS)
    if isinstance(num_elements, bool) or not isinstance(num_elements, (int, np.integer)) \
            or num_elements < 0:
        raise ValueError(f"num_elements must be an int >= 0, got {num_elements!r}")
    return -(-int(num_elements) // GROUP[bits]) * GROUP_BYTES[bits]


def packed_shape(shape: Sequence[int], bits: int) -> tuple[int, ...]:
    """Shape of ``pack(codes, bits)`` for codes of ``shape`` (see the module docstring)."""
    bits = check_bits(bits, BITS)
    shape = _check_shape(shape)
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    if _along_last(shape, bits):
        return shape[:-1] + (shape[-1] // g * nb,)
    return (packed_size(math.prod(shape), bits),)


def _byte_shifts(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(bit offset of code j, bit offset of byte k): byte k of code j's contribution is
    ``((c_j << bits*j) >> 8k) & 0xff``.  Shapes ``(B, G)`` and ``(B, 1)``."""
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    code_shift = np.broadcast_to(bits * np.arange(g, dtype=np.uint32), (nb, g))
    byte_shift = (8 * np.arange(nb, dtype=np.uint32))[:, None]
    return code_shift, byte_shift


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack integer (or bool) codes ``0 <= c < 2**bits`` densely into ``uint8``.

    Codes out of range are masked to their low ``bits`` bits.  Returns an array of
    ``packed_shape(codes.shape, bits)``.
    """
    bits = check_bits(bits, BITS)
    c = jnp.asarray(codes)
    if not (jnp.issubdtype(c.dtype, jnp.integer) or c.dtype == jnp.bool_):
        raise TypeError(f"codes must be an integer or bool array, got dtype {c.dtype}")
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
    code_shift, byte_shift = _byte_shifts(bits)
    # contrib[..., k, j]: byte k of code j at its offset in the group word.  Bits of different
    # codes never overlap, so the sum over j (the trailing axis) is their bitwise or.
    contrib = ((grouped[..., None, :] << code_shift) >> byte_shift) & jnp.uint32(0xFF)
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-1, dtype=jnp.uint8)  # the reduction
    return packed.reshape(packed_shape(shape, bits))


def unpack(packed: jax.Array, bits: int, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`pack`: the ``uint8`` codes of ``shape``."""
    bits = check_bits(bits, BITS)
    shape = _check_shape(shape)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    expect = packed_shape(shape, bits)
    if packed.shape != expect:
        raise ValueError(
            f"packed has shape {packed.shape}, expected {expect} for {bits}-bit codes of "
            f"shape {shape}")
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    bytes_ = packed.reshape(packed.shape[:-1] + (packed.shape[-1] // nb, nb)).astype(jnp.uint32)
    word = bytes_[..., 0]
    for k in range(1, nb):
        word = word | (bytes_[..., k] << jnp.uint32(8 * k))
    shifts = jnp.asarray(bits * np.arange(g, dtype=np.uint32))
    c = ((word[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)).astype(jnp.uint8)
    if _along_last(shape, bits):
        return c.reshape(shape)
    return c.reshape(-1)[:math.prod(shape)].reshape(shape)
