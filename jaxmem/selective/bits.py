"""Bit packing that survives XLA fusion, as a flat byte vector.

A boolean mask kept for the backward pass costs 1 byte per element as ``bool``; packed, 1/8
byte.  The packing is a *reduction* (a sum of shifted bits over a trailing group axis), so
XLA materialises the packed bytes instead of fusing the code into its backward consumer
and keeping the float input alive.

Math. For a flat boolean vector ``b`` padded with zeros to a multiple of ``8``::

    packed[i] = sum_{j=0}^{7} b[8 i + j] * 2**j          (uint8)
    b[8 i + j] = (packed[i] >> j) & 1

Multi-bit codes (``pack_codes``/``unpack_codes``) use the same layout with ``8 // nbits``
codes per byte, code ``j`` of a byte in bits ``[j*nbits, (j+1)*nbits)`` (3-bit codes: 8 codes
in 3 bytes).  These are the flat spelling of the one packer, :mod:`jaxmem._prims.bitpack`
(``jaxmem.fewbit.pack`` is the same byte stream, shaped along the last axis).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxmem._prims import bitpack
from jaxmem._prims.bitpack import BITS, packed_size
from jaxmem._prims.checks import check_bits

__all__ = ["pack_bits", "pack_codes", "packed_size", "unpack_bits", "unpack_codes"]


def pack_codes(codes: jax.Array, nbits: int) -> jax.Array:
    """Pack unsigned integer codes ``0 <= c < 2**nbits`` into a flat ``uint8`` vector.

    Args:
      codes: integer (or bool) array of any shape; values outside ``[0, 2**nbits)`` are
        masked to their low ``nbits`` bits.
      nbits: bits per code, one of 1, 2, 3, 4, 8.

    Returns:
      ``uint8`` array of shape ``(packed_size(codes.size, nbits),)``.
    """
    codes = jnp.asarray(codes)
    return bitpack.pack(codes.reshape(-1), check_bits(nbits, BITS, "nbits"))


def unpack_codes(packed: jax.Array, nbits: int, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`pack_codes`: ``uint8`` codes of the given ``shape``."""
    nbits = check_bits(nbits, BITS, "nbits")
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8 or packed.ndim != 1:
        raise TypeError(
            f"packed must be a 1-D uint8 array, got shape {packed.shape} dtype {packed.dtype}")
    shape = tuple(int(s) for s in shape)
    return bitpack.unpack(packed, nbits, (math.prod(shape),)).reshape(shape)


def pack_bits(bool_array: jax.Array) -> jax.Array:
    """Pack a boolean array into ``ceil(size / 8)`` uint8 bytes (1 bit per element)."""
    bool_array = jnp.asarray(bool_array)
    if bool_array.dtype != jnp.bool_:
        raise TypeError(f"bool_array must have dtype bool, got {bool_array.dtype}")
    return pack_codes(bool_array, 1)


def unpack_bits(packed: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`pack_bits`: a boolean array of ``shape``."""
    return unpack_codes(packed, 1, shape).astype(jnp.bool_)
