"""Bin codes and their dense b-bit packing, as the few-bit ops use them.

Codes.  ``codes(x, borders)`` is compare-and-sum, ``c = Σ_i [float32(x) >= borders_i]``
(of ``|x|`` when ``symmetric``), a ``uint8`` in ``0 .. len(borders)``.

Packing.  ``pack(c, bits)`` stores ``bits`` bits per code (1, 2, 3, 4; also 8): groups of
``G`` codes in ``B`` bytes with ``G * bits == 8 * B`` (3-bit codes: 8 codes in 3 bytes), along
the last axis when its size is a multiple of ``G``, else over the flattened codes.
``unpack(packed, bits, shape)`` inverts it.  The byte stream is the one of
``jaxmem.selective.pack_bits`` / ``pack_codes``: one packer serves both parts.

These names are the few-bit spelling of the shared primitives: the layout contract and its
math are documented in :mod:`jaxmem._prims.bitpack` and :mod:`jaxmem._prims.codes`.
"""
from __future__ import annotations

from jaxmem._prims.bitpack import GROUP, GROUP_BYTES, pack, packed_shape, unpack
from jaxmem._prims.checks import check_bits as _check_bits  # noqa: F401  (bits 1..4)
from jaxmem._prims.codes import bin_codes as codes

__all__ = ["GROUP", "GROUP_BYTES", "codes", "pack", "packed_shape", "unpack"]
