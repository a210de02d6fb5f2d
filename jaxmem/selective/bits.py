"""Bit packing that survives XLA fusion.

A boolean mask kept for the backward pass costs 1 byte per element as ``bool``. Packing 8
booleans into one ``uint8`` cuts that to 1/8 byte per element. The packing must be a
*reduction*: an elementwise code (``x > 0``) is fused by XLA into its backward consumer, and
XLA then keeps the f32 input alive instead of the code (see docs/design.md). Summing shifted bits
over a trailing group axis of 8 is a reduce, so XLA materialises the packed bytes.

Math. For a flat boolean vector ``b`` padded with zeros to a multiple of ``8``::

    packed[i] = sum_{j=0}^{7} b[8 i + j] * 2**j          (uint8)
    b[8 i + j] = (packed[i] >> j) & 1

Multi-bit codes (``pack_codes``/``unpack_codes``) use the same layout with ``8 // nbits``
codes per byte, code ``j`` of a byte in bits ``[j*nbits, (j+1)*nbits)``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

__all__ = ["pack_bits", "pack_codes", "packed_size", "unpack_bits", "unpack_codes"]

_ALLOWED_NBITS = (1, 2, 4, 8)


def _check_nbits(nbits: int) -> None:
    if nbits not in _ALLOWED_NBITS:
        raise ValueError(f"nbits must be one of {_ALLOWED_NBITS}, got {nbits!r}")


def packed_size(num_elements: int, nbits: int = 1) -> int:
    """Number of uint8 bytes :func:`pack_codes` returns for ``num_elements`` codes."""
    _check_nbits(nbits)
    per_byte = 8 // nbits
    return -(-num_elements // per_byte)


def pack_codes(codes, nbits: int):
    """Pack unsigned integer codes ``0 <= c < 2**nbits`` into a flat ``uint8`` vector.

    Args:
      codes: integer (or bool) array of any shape; every value must fit in ``nbits`` bits.
        Values outside that range are masked to their low ``nbits`` bits.
      nbits: bits per code, one of 1, 2, 4, 8.

    Returns:
      ``uint8`` array of shape ``(packed_size(codes.size, nbits),)``.
    """
    _check_nbits(nbits)
    codes = jnp.asarray(codes)
    if not (jnp.issubdtype(codes.dtype, jnp.integer) or codes.dtype == jnp.bool_):
        raise TypeError(f"codes must be an integer or bool array, got dtype {codes.dtype}")
    per_byte = 8 // nbits
    flat = codes.reshape(-1).astype(jnp.uint8)
    if nbits < 8:
        flat = flat & jnp.uint8((1 << nbits) - 1)
    n = flat.shape[0]
    nbytes = packed_size(n, nbits)
    pad = nbytes * per_byte - n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    groups = flat.reshape(nbytes, per_byte)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(nbits))
    # A reduction over the trailing group axis: XLA materialises the packed bytes.
    # Bits of different codes never overlap, so the sum equals the bitwise or.
    return jnp.sum(groups << shifts, axis=-1, dtype=jnp.uint8)


def unpack_codes(packed, nbits: int, shape: Sequence[int]):
    """Inverse of :func:`pack_codes`: ``uint8`` codes of the given ``shape``."""
    _check_nbits(nbits)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8 or packed.ndim != 1:
        raise TypeError(
            f"packed must be a 1-D uint8 array, got shape {packed.shape} dtype {packed.dtype}"
        )
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if packed.shape[0] != packed_size(n, nbits):
        raise ValueError(
            f"packed has {packed.shape[0]} bytes but shape {shape} with nbits={nbits} needs "
            f"{packed_size(n, nbits)}"
        )
    per_byte = 8 // nbits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(nbits)
    mask = jnp.uint8((1 << nbits) - 1) if nbits < 8 else jnp.uint8(0xFF)
    codes = (packed[:, None] >> shifts) & mask
    return lax.slice_in_dim(codes.reshape(-1), 0, n).reshape(shape)


def pack_bits(bool_array):
    """Pack a boolean array into ``ceil(size / 8)`` uint8 bytes (1 bit per element)."""
    bool_array = jnp.asarray(bool_array)
    if bool_array.dtype != jnp.bool_:
        raise TypeError(f"bool_array must have dtype bool, got {bool_array.dtype}")
    return pack_codes(bool_array, 1)


def unpack_bits(packed, shape: Sequence[int]):
    """Inverse of :func:`pack_bits`: a boolean array of ``shape``."""
    return unpack_codes(packed, 1, shape).astype(jnp.bool_)
