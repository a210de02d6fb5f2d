"""jaxmem._prims.bitpack, the one packer of the library: round trips for every width, the
byte layout (the stream saved codes are read back from), shapes, dtypes, transformations,
errors, and that XLA stores the packed bytes (compiled-bytes slope)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem import fewbit
from jaxmem import selective as S
from jaxmem._prims import bitpack
from jaxmem._prims.bitpack import BITS, GROUP, GROUP_BYTES, pack, packed_shape, packed_size, unpack
from jaxmem.selective import bits as sbits

shapes = st.lists(st.integers(0, 11), min_size=0, max_size=3).map(tuple)


def _reference_stream(flat_codes: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout in plain Python: groups of G codes, little-endian words of
    8 * B bits, stored byte by byte (LSB first), zero codes padding the last group."""
    g, nb = GROUP[bits], GROUP_BYTES[bits]
    c = [int(v) & ((1 << bits) - 1) for v in flat_codes.reshape(-1)]
    c += [0] * ((-len(c)) % g)
    out = []
    for i in range(0, len(c), g):
        word = sum(v << (bits * j) for j, v in enumerate(c[i:i + g]))
        out += [(word >> (8 * k)) & 0xFF for k in range(nb)]
    return np.asarray(out, np.uint8)


def _codes(shape, bits, seed, dtype="uint8"):
    return np.random.default_rng(seed).integers(0, 2**bits, size=shape).astype(dtype)


_round_trip = jax.jit(lambda c, bits: (pack(c, bits), unpack(pack(c, bits), bits, c.shape)),
                      static_argnums=1)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=shapes, bits=st.sampled_from(BITS), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(["uint8", "int32", "uint32", "int8"]))
def test_round_trip_and_stream_every_width(shape, bits, seed, dtype):
    # pack and unpack in one compiled program per example (op by op, each new shape compiles
    # every op; the eager spellings run in the tests below)
    c = _codes(shape, bits, seed, "uint8").astype(dtype)
    p, u = _round_trip(jnp.asarray(c), bits)
    assert p.dtype == jnp.uint8 and p.shape == packed_shape(shape, bits)
    size = math.prod(shape)
    assert p.size == packed_size(size, bits)
    assert p.size * 8 >= size * bits and p.size <= -(-size * bits // 8) + GROUP_BYTES[bits]
    np.testing.assert_array_equal(np.asarray(p).reshape(-1), _reference_stream(c, bits))
    assert u.shape == tuple(shape) and u.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(u), c.astype(np.uint8))


@pytest.mark.parametrize("bits", BITS)
def test_edge_sizes(bits):
    """Empty, scalar, one element, odd sizes, and a last axis that is a multiple of G."""
    for shape in [(0,), (3, 0), (0, 8), (), (1,), (7,), (3, 5), (2, 3, 16)]:
        c = _codes(shape, bits, seed=bits)
        p, u = _round_trip(jnp.asarray(c), bits)
        assert p.shape == packed_shape(shape, bits)
        np.testing.assert_array_equal(np.asarray(p).reshape(-1), _reference_stream(c, bits))
        np.testing.assert_array_equal(np.asarray(u), c)


def test_one_bit_stream_is_numpy_packbits_little():
    b = np.random.default_rng(0).random((5, 13)) > 0.5
    ref = np.packbits(b.reshape(-1), bitorder="little")
    np.testing.assert_array_equal(np.asarray(pack(jnp.asarray(b), 1)), ref)
    np.testing.assert_array_equal(np.asarray(S.pack_bits(jnp.asarray(b))), ref)


def test_documented_bit_order():
    """3 bits: 8 codes -> a 24-bit little-endian word -> 3 bytes; else code j at bits*j."""
    c = np.arange(8, dtype=np.uint8)
    word = sum(int(v) << (3 * j) for j, v in enumerate(c))
    assert list(np.asarray(pack(jnp.asarray(c), 3))) == [word & 255, (word >> 8) & 255,
                                                        word >> 16]
    for bits in (1, 2, 4, 8):
        c = _codes((GROUP[bits],), bits, seed=bits)
        assert int(pack(jnp.asarray(c), bits)[0]) == sum(int(v) << (bits * j)
                                                          for j, v in enumerate(c))


def test_last_axis_layout_keeps_leading_axes_and_the_stream():
    c = _codes((4, 16), 3, seed=0)
    p = pack(jnp.asarray(c), 3)
    assert p.shape == (4, 6)
    np.testing.assert_array_equal(np.asarray(p).reshape(-1),
                                  np.asarray(pack(jnp.asarray(c.reshape(-1)), 3)))
    assert packed_shape((4, 15), 3) == (24,)  # not a multiple of G: flattened, padded


@pytest.mark.parametrize("nbits", BITS)
def test_part_spellings_are_one_stream(nbits):
    """selective's flat pack_codes, fewbit's pack and the primitive write the same bytes."""
    c = _codes((3, 7), nbits, seed=nbits)
    flat = sbits.pack_codes(jnp.asarray(c), nbits)
    assert flat.shape == (packed_size(21, nbits),)
    np.testing.assert_array_equal(np.asarray(flat), _reference_stream(c, nbits))
    np.testing.assert_array_equal(np.asarray(sbits.unpack_codes(flat, nbits, (3, 7))), c)
    assert fewbit.pack is pack and fewbit.unpack is unpack
    assert fewbit.packed_shape is packed_shape and sbits.packed_size is packed_size
    b = c % 2 == 1
    np.testing.assert_array_equal(np.asarray(S.unpack_bits(S.pack_bits(jnp.asarray(b)), b.shape)),
                                  b)


def test_bool_and_wide_codes():
    b = np.random.default_rng(1).random((2, 9)) > 0.3
    np.testing.assert_array_equal(np.asarray(pack(jnp.asarray(b), 1)),
                                  np.asarray(pack(jnp.asarray(b.astype(np.uint8)), 1)))
    # out-of-range codes keep their low bits
    c = np.array([5, 17, 255, 256], np.int32)
    np.testing.assert_array_equal(np.asarray(unpack(pack(jnp.asarray(c), 2), 2, (4,))),
                                  c & 3)


def test_jit_vmap_scan():
    c = jnp.asarray(_codes((3, 5, 7), 4, seed=2))
    p = jax.jit(pack, static_argnums=1)(c, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(unpack, static_argnums=(1, 2))(
        p, 4, c.shape)), np.asarray(c))
    pv = jax.vmap(lambda c: pack(c, 3))(c)
    uv = jax.vmap(lambda p: unpack(p, 3, c.shape[1:]))(pv)
    np.testing.assert_array_equal(np.asarray(uv), np.asarray(c) & 7)
    np.testing.assert_array_equal(np.asarray(pv[1]), np.asarray(pack(c[1], 3)))

    def body(carry, ci):
        return carry, unpack(pack(ci, 4), 4, ci.shape)

    _, us = jax.lax.scan(body, 0, c)
    np.testing.assert_array_equal(np.asarray(us), np.asarray(c))


@pytest.mark.parametrize("bits", [0, 5, 7, -1, 1.5, True, "2", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4, 8\)"):
        pack(jnp.zeros(8, jnp.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack(jnp.zeros(1, jnp.uint8), bits, (8,))
    with pytest.raises(ValueError, match="nbits"):
        sbits.pack_codes(jnp.zeros(8, jnp.uint8), bits)


def test_bad_inputs():
    with pytest.raises(TypeError, match="integer or bool"):
        pack(jnp.zeros(8, jnp.float32), 2)
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        unpack(jnp.zeros(3, jnp.uint8), 2, (8,))
    with pytest.raises(TypeError, match="uint8"):
        unpack(jnp.zeros(2, jnp.int32), 2, (8,))
    with pytest.raises(ValueError, match="shape"):
        unpack(jnp.zeros(2, jnp.uint8), 2, (8, -1))
    with pytest.raises(ValueError, match="num_elements"):
        packed_size(-1, 1)
    with pytest.raises(TypeError, match="bool"):
        S.pack_bits(jnp.zeros(3))
    with pytest.raises(TypeError, match="1-D uint8"):
        S.unpack_bits(jnp.zeros((2, 1), jnp.uint8), (16,))
    with pytest.raises(ValueError, match="expected"):
        S.unpack_bits(jnp.zeros(2, jnp.uint8), (30,))


# ------------------------------------------------------- XLA stores the packed bytes
def _coded(bits, store_packed):
    """``y = x`` whose backward keeps a ``bits``-bit code of ``x`` (dx = dy * (1 + code))."""
    borders = np.linspace(-1.0, 1.0, 2**bits - 1, dtype=np.float32)

    def code(x):
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in borders:  # compare-and-sum: elementwise, fusible
            c = c + (x >= v).astype(jnp.uint8)
        return c

    @jax.custom_vjp
    def f(x):
        return x

    def fwd(x):
        return x, pack(code(x), bits) if store_packed else code(x)

    def bwd(res, dy):
        c = unpack(res, bits, dy.shape) if store_packed else res
        return (dy * (1 + c.astype(dy.dtype)),)

    f.defvjp(fwd, bwd)
    return f


def _bytes_per_layer(op, b, h):
    from jaxmem.measure import compiled_memory, slope
    x = jnp.ones((b, h), jnp.float32)

    def loss_for(depth):
        ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h),
                          jnp.float32) for i in range(depth)]

        def loss(x):  # frozen weights: only the codes are needed for the input gradient
            for w in ws:
                x = op(x @ w)
            return jnp.sum(x)

        return loss

    return slope(lambda d: compiled_memory(jax.grad(loss_for(d)), x).total_bytes, 2)


@pytest.mark.xla_cpu  # asserts XLA:CPU's plan (XLA:GPU: benchmarks/gpu)
@pytest.mark.parametrize("bits,b,h", [(1, 32, 256), (3, 32, 256), (1, 31, 250), (3, 31, 250)])
def test_packing_is_materialised(bits, b, h):
    """Per added layer XLA keeps the packed bytes (bits/8 B per element, + padding), where the
    same code left elementwise is fused away and the float input kept instead."""
    packed = _bytes_per_layer(_coded(bits, True), b, h)
    aligned = -(-packed_size(b * h, bits) // 64) * 64  # XLA:CPU buffers are 64-byte aligned
    assert packed == aligned, (packed, packed_size(b * h, bits))
    unpacked = _bytes_per_layer(_coded(bits, False), b, h)
    assert unpacked >= b * h, unpacked  # >= 1 B per element without the packing reduction


def test_module_names_its_layout():
    assert set(GROUP) == set(GROUP_BYTES) == set(BITS)
    for b in BITS:
        assert GROUP[b] * b == 8 * GROUP_BYTES[b]
    assert "reduction" in bitpack.__doc__


@pytest.mark.parametrize("shape,blocks", [((4, 16), 1), ((3, 12), 1), ((2, 24), 3),
                                          ((2, 20), 2), ((0, 8), 1), ((7,), 1)])
def test_one_bit_pack_is_packbits_in_every_layout(shape, blocks):
    """1-bit pack = np.packbits / jnp.packbits (little) of each group run: along the last
    axis, per block, or over the flattened codes; out-of-range codes keep their low bit."""
    c = np.random.default_rng(1).integers(0, 256, shape).astype(np.uint8)
    low = c & 1
    if blocks > 1:
        runs = low.reshape(shape[:-1] + (blocks, -1))
    else:
        runs = low if shape[-1] % 8 == 0 else low.reshape(-1)

    @jax.jit  # one compiled program (op by op, every op compiles for each new shape)
    def run(c, runs):
        got = pack(c, 1, blocks)
        return got, jnp.packbits(runs, axis=-1, bitorder="little"), unpack(got, 1, shape, blocks)

    got, jref, back = (np.asarray(a) for a in run(jnp.asarray(c), jnp.asarray(runs)))
    assert got.shape == packed_shape(shape, 1, blocks)
    ref = np.packbits(runs, axis=-1, bitorder="little")
    np.testing.assert_array_equal(got.reshape(-1), ref.reshape(-1))
    np.testing.assert_array_equal(got.reshape(-1), jref.reshape(-1))
    np.testing.assert_array_equal(back, low)
