"""Torch twin of ``jaxmem.fewbit.pack``: codes and the same dense byte stream.

Codes: ``c = Σ_i [float32(x) >= float32(borders_i)]`` (of ``|x|`` when symmetric), uint8.
Layout: row-major groups of ``G`` codes in ``B`` bytes (1-bit: 8 codes/byte, 2-bit: 4,
3-bit: 8 codes in 3 bytes as a little-endian 24-bit word, 4-bit: 2), the flattened tensor
padded with zero codes to a multiple of ``G``.  The byte stream equals
``np.asarray(jaxmem.fewbit.pack(c, bits)).reshape(-1)`` (JAX may keep a leading shape; the
bytes are the same).
"""
from __future__ import annotations

import torch

__all__ = ["GROUP", "GROUP_BYTES", "codes", "pack", "unpack"]

GROUP = {1: 8, 2: 4, 3: 8, 4: 2}
GROUP_BYTES = {1: 1, 2: 1, 3: 3, 4: 1}


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 4:
        raise ValueError(f"bits must be an integer in 1..4, got {bits!r}")
    return bits


def codes(x: torch.Tensor, borders: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    """uint8 bin index of every element (compare-and-sum in float32)."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    xf = x.detach().to(torch.float32)
    if symmetric:
        xf = xf.abs()
    b = borders.to(device=x.device, dtype=torch.float32).contiguous()
    # bucketize(right=True) = #{i : b_i <= x} = compare-and-sum; NaN compares false -> 0
    c = torch.bucketize(xf, b, right=True).to(torch.uint8)
    return c.masked_fill_(torch.isnan(xf), 0)


def pack(c: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 tensor of ``ceil(numel / G) * B`` bytes."""
    bits = _check_bits(bits)
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    flat = c.reshape(-1).to(torch.int32) & ((1 << bits) - 1)
    pad = (-flat.numel()) % g
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    grp = flat.view(-1, g)
    shifts = torch.arange(g, device=c.device, dtype=torch.int32) * bits
    word = (grp << shifts).sum(-1, dtype=torch.int32)
    if nb == 1:
        return word.to(torch.uint8)
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(nb)], dim=-1)
    return out.to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes of ``shape``."""
    bits = _check_bits(bits)
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    by = packed.reshape(-1, nb).to(torch.int32)
    word = by[:, 0]
    for b in range(1, nb):
        word = word | (by[:, b] << (8 * b))
    shifts = torch.arange(g, device=packed.device, dtype=torch.int32) * bits
    c = (word[:, None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:n].to(torch.uint8).reshape(shape)
