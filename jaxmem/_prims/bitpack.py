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

Blocked layout (``blocks=k > 1``).  The trailing axis of width ``W`` (``W % k == 0``) is cut
into ``k`` equal blocks of ``w = W / k`` codes; each block is padded with zero codes to whole
groups and packed on its own, blocks in order::

    packed shape  shape[:-1] + (k * ceil(w / G) * B,)
    block i       codes[..., i*w:(i+1)*w]  ->  bytes [..., i*n:(i+1)*n],  n = ceil(w / G) * B

Block boundaries fall on byte boundaries, so when the trailing axis is split over ``s``
devices with ``s | k``, each device packs and unpacks its own shard: no byte straddles a
shard boundary and XLA needs no collective for the residual.  When ``w % G == 0`` the blocked
layout *is* the ``k = 1`` layout (same shape, same bytes).  Otherwise the padding costs
``prod(shape[:-1]) * (k * ceil(w / G) * B - W * bits / 8)`` bytes, less than ``B`` bytes
per block per row (:func:`padding_bytes`).  :func:`shard_blocks` picks ``k`` from the mesh in
context (``jax.set_mesh``; ``k = 1`` outside a mesh) and :func:`shard_axes` narrows the mesh
axes it considers (read when a function is traced: a function ``jax.jit`` has already traced
under the same mesh keeps its layout).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._prims.checks import as_int, check_bits

__all__ = ["BITS", "GROUP", "GROUP_BYTES", "pack", "packed_shape", "packed_size", "padding_bytes",
           "shard_axes", "shard_blocks", "unpack"]

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


def _check_blocks(blocks, shape: tuple[int, ...]) -> int:
    """``blocks`` as an int ``>= 1`` that divides the trailing axis of ``shape``."""
    k = as_int(blocks)
    if k is None or k < 1:
        raise ValueError(f"blocks must be an int >= 1, got {blocks!r}")
    if k > 1:
        if not shape:
            raise ValueError(f"blocks={k} needs codes with at least one axis, got shape {shape}")
        if shape[-1] % k:
            raise ValueError(
                f"blocks={k} must divide the trailing axis of shape {shape} (size {shape[-1]}); "
                f"allowed: a divisor of {shape[-1]}")
    return k


def _block_groups(shape: tuple[int, ...], bits: int, k: int) -> int:
    """Groups per block: ``ceil(w / G)`` with ``w = shape[-1] / k``."""
    return -(-(shape[-1] // k) // GROUP[bits])


def packed_shape(shape: Sequence[int], bits: int, blocks: int = 1) -> tuple[int, ...]:
    """Shape of ``pack(codes, bits, blocks)`` for codes of ``shape`` (see the module docstring):
    ``shape[:-1] + (blocks * ceil(shape[-1] / (blocks * G)) * B,)`` for ``blocks > 1``."""
    bits = check_bits(bits, BITS)
    shape = _check_shape(shape)
    k = _check_blocks(blocks, shape)
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    if k > 1:
        return shape[:-1] + (k * _block_groups(shape, bits, k) * nb,)
    if _along_last(shape, bits):
        return shape[:-1] + (shape[-1] // g * nb,)
    return (packed_size(math.prod(shape), bits),)


def padding_bytes(shape: Sequence[int], bits: int, blocks: int = 1) -> int:
    """Bytes of ``pack(codes, bits, blocks)`` beyond the dense ``ceil(size * bits / 8)``.

    ``blocks = 1``: less than ``B`` (the last group's pad).  ``blocks = k > 1``:
    ``rows * k * ceil(w / G) * B - ceil(rows * W * bits / 8)`` with ``rows = prod(shape[:-1])``,
    ``w = W / k``: zero when ``w % G == 0``, else less than ``rows * k * B``.
    """
    bits = check_bits(bits, BITS)
    shape = _check_shape(shape)
    stored = math.prod(packed_shape(shape, bits, blocks))
    return stored - -(-math.prod(shape) * bits // 8)


_SHARD_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "jaxmem_shard_axes", default=None)


@contextlib.contextmanager
def shard_axes(*names: str) -> Iterator[None]:
    """Within the block, :func:`shard_blocks` considers only the mesh axes ``names`` (those
    the trailing feature axis may be split over, e.g. ``shard_axes("model")`` for tensor
    parallelism); ``shard_axes()`` with no names keeps the ``blocks = 1`` layout."""
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"shard_axes: names must be mesh axis names (str), got {n!r}")
    token = _SHARD_AXES.set(tuple(names))
    try:
        yield
    finally:
        _SHARD_AXES.reset(token)


def shard_axes_in_context() -> tuple[str, ...] | None:
    """The names :func:`shard_axes` set in context (``None`` outside any such block)."""
    return _SHARD_AXES.get()


def _context_axis_sizes() -> tuple[int, ...]:
    """Sizes (> 1) of the axes of the abstract mesh in context that a traced array's trailing
    axis may be split over: every axis not in manual mode (inside ``shard_map`` the arrays are
    already per-device), restricted to :func:`shard_axes` when set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    only = _SHARD_AXES.get()
    manual = jax.sharding.AxisType.Manual
    sizes = []
    for name, kind in zip(mesh.axis_names, mesh.axis_types):
        size = int(mesh.shape[name])
        if size > 1 and kind != manual and (only is None or name in only):
            sizes.append(size)
    return tuple(sizes)


def shard_blocks(width: int, bits: int, axis_sizes: Sequence[int] | None = None) -> int:
    """The ``blocks`` that keeps every shard of a trailing axis of ``width`` codes on whole
    bytes, for any split of that axis over a product of mesh axes.

    A split over ``s`` devices (``s`` a product of some of ``axis_sizes``, ``width % s == 0``)
    straddles a byte iff ``(width / s) % G != 0``; ``k`` is the least common multiple of
    those ``s`` (``1`` when there are none), so ``k | width`` and every such split cuts at a
    block boundary.  ``axis_sizes`` defaults to the mesh in context (``jax.set_mesh``; no
    mesh: ``1``), see :func:`shard_axes`.
    """
    bits = check_bits(bits, BITS)
    w = as_int(width)
    if w is None or w < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    if axis_sizes is None:
        axis_sizes = _context_axis_sizes()
    sizes = []
    for a in axis_sizes:
        s = as_int(a)
        if s is None or s < 1:
            raise ValueError(f"axis_sizes must be ints >= 1, got {tuple(axis_sizes)!r}")
        sizes.append(s)
    g, k = GROUP[bits], 1
    for r in range(1, len(sizes) + 1):
        for combo in itertools.combinations(sizes, r):
            s = math.prod(combo)
            if w % s == 0 and (w // s) % g:
                k = math.lcm(k, s)
    return k


def _byte_shifts(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(bit offset of code j, bit offset of byte k): byte k of code j's contribution is
    ``((c_j << bits*j) >> 8k) & 0xff``.  Shapes ``(B, G)`` and ``(B, 1)``."""
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    code_shift = np.broadcast_to(bits * np.arange(g, dtype=np.uint32), (nb, g))
    byte_shift = (8 * np.arange(nb, dtype=np.uint32))[:, None]
    return code_shift, byte_shift


def pack(codes: jax.Array, bits: int, blocks: int = 1) -> jax.Array:
    """Pack integer (or bool) codes ``0 <= c < 2**bits`` densely into ``uint8``.

    Codes out of range are masked to their low ``bits`` bits.  ``blocks = k > 1`` packs each
    of ``k`` equal blocks of the trailing axis on its own (the blocked layout of the module
    docstring).  Returns an array of ``packed_shape(codes.shape, bits, blocks)``.
    """
    bits = check_bits(bits, BITS)
    c = jnp.asarray(codes)
    if not (jnp.issubdtype(c.dtype, jnp.integer) or c.dtype == jnp.bool_):
        raise TypeError(f"codes must be an integer or bool array, got dtype {c.dtype}")
    shape = c.shape
    k = _check_blocks(blocks, shape)
    g = GROUP[bits]
    c = c.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    if k > 1:
        w, ng = shape[-1] // k, _block_groups(shape, bits, k)
        c = c.reshape(shape[:-1] + (k, w))
        if ng * g != w:
            c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, ng * g - w)])
        grouped = c.reshape(shape[:-1] + (k, ng, g))
    elif _along_last(shape, bits):
        grouped = c.reshape(shape[:-1] + (shape[-1] // g, g))
    else:
        flat = c.reshape(-1)
        pad = (-flat.shape[0]) % g
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad,), jnp.uint32)])
        grouped = flat.reshape(-1, g)
    code_shift, byte_shift = _byte_shifts(bits)
    # contrib[..., k, j]: byte k of code j at its offset in the group word.  Bits of different
    # codes never overlap, so the sum over j (the trailing axis) is their bitwise or.  For
    # bits=1 the bytes equal jnp.packbits(..., axis=-1, bitorder="little"), but that reduces
    # in uint32 and XLA keeps the uint32 sums (4x the packed bytes): the uint8 sum stays.
    contrib = ((grouped[..., None, :] << code_shift) >> byte_shift) & jnp.uint32(0xFF)
    packed = jnp.sum(contrib.astype(jnp.uint8), axis=-1, dtype=jnp.uint8)  # the reduction
    return packed.reshape(packed_shape(shape, bits, k))


def unpack(packed: jax.Array, bits: int, shape: Sequence[int], blocks: int = 1) -> jax.Array:
    """Inverse of :func:`pack` (with the same ``blocks``): the ``uint8`` codes of ``shape``."""
    bits = check_bits(bits, BITS)
    shape = _check_shape(shape)
    k = _check_blocks(blocks, shape)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    expect = packed_shape(shape, bits, k)
    if packed.shape != expect:
        raise ValueError(
            f"packed has shape {packed.shape}, expected {expect} for {bits}-bit codes of "
            f"shape {shape}" + (f" in {k} blocks" if k > 1 else ""))
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    bytes_ = packed.reshape(packed.shape[:-1] + (packed.shape[-1] // nb, nb)).astype(jnp.uint32)
    word = bytes_[..., 0]
    for i in range(1, nb):
        word = word | (bytes_[..., i] << jnp.uint32(8 * i))
    shifts = jnp.asarray(bits * np.arange(g, dtype=np.uint32))
    c = ((word[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)).astype(jnp.uint8)
    if k > 1:
        w, ng = shape[-1] // k, _block_groups(shape, bits, k)
        return c.reshape(shape[:-1] + (k, ng * g))[..., :w].reshape(shape)
    if _along_last(shape, bits):
        return c.reshape(shape)
    return c.reshape(-1)[:math.prod(shape)].reshape(shape)
