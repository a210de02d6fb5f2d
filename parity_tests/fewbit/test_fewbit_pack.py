"""jaxmem.fewbit.pack / unpack / codes: round trips, density, layout, errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem import fewbit
from jaxmem.fewbit.pack import GROUP, GROUP_BYTES

_pack = jax.jit(fewbit.pack, static_argnums=1)
_unpack = jax.jit(fewbit.unpack, static_argnums=(1, 2))

shapes = st.lists(st.integers(0, 13), min_size=0, max_size=3).map(tuple)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, bits=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(["uint8", "int32", "uint32"]))
def test_roundtrip_any_shape(shape, bits, seed, dtype):
    c = np.random.default_rng(seed).integers(0, 2**bits, size=shape).astype(dtype)
    p = _pack(jnp.asarray(c), bits)
    assert p.dtype == jnp.uint8
    size = int(np.prod(shape, dtype=np.int64))
    # true density: ceil(size * bits / 8) bytes, up to one group of padding
    assert p.size * 8 >= size * bits
    assert p.size <= -(-size * bits // 8) + GROUP_BYTES[bits]
    u = _unpack(p, bits, tuple(shape))
    assert u.shape == tuple(shape) and u.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(u), c.astype(np.uint8))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), bits=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
def test_codes_of_floats_roundtrip(n, bits, seed, dtype):
    """codes(x) of bf16/f16/f32 inputs == numpy count of borders <= float32(x), and survive
    pack/unpack."""
    rng = np.random.default_rng(seed)
    borders = np.sort(rng.normal(size=2**bits - 1)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(3, n)) * 2, dtype=dtype)
    c = jax.jit(lambda x: fewbit.codes(x, borders))(x)
    xf = np.asarray(x.astype(jnp.float32))
    ref = (xf[..., None] >= borders).sum(-1)
    np.testing.assert_array_equal(np.asarray(c), ref)
    np.testing.assert_array_equal(np.asarray(_unpack(_pack(c, bits), bits, x.shape)), ref)


def test_layout_is_documented_bit_order():
    """3-bit: 8 codes -> 24-bit little-endian word -> 3 bytes; 1/2/4-bit: code j at bits*j."""
    c = np.arange(8, dtype=np.uint8)
    p = np.asarray(fewbit.pack(jnp.asarray(c), 3))
    word = sum(int(v) << (3 * j) for j, v in enumerate(c))
    assert list(p) == [word & 255, (word >> 8) & 255, (word >> 16) & 255]
    for bits in (1, 2, 4):
        c = np.random.default_rng(bits).integers(0, 2**bits, size=GROUP[bits]).astype(np.uint8)
        p = np.asarray(fewbit.pack(jnp.asarray(c), bits))
        assert int(p[0]) == sum(int(v) << (bits * j) for j, v in enumerate(c))


def test_last_axis_layout_keeps_leading_shape_and_bytes():
    c = np.random.default_rng(0).integers(0, 8, size=(4, 16)).astype(np.uint8)
    p = fewbit.pack(jnp.asarray(c), 3)
    assert p.shape == (4, 6)
    flat = fewbit.pack(jnp.asarray(c.reshape(-1)), 3)
    np.testing.assert_array_equal(np.asarray(p).reshape(-1), np.asarray(flat))


def test_one_bit_layout_shared_with_selective():
    bits_mod = pytest.importorskip("jaxmem.selective.bits")
    m = np.random.default_rng(1).integers(0, 2, size=(5, 11)).astype(bool)
    np.testing.assert_array_equal(np.asarray(fewbit.pack(jnp.asarray(m, jnp.uint8), 1)),
                                  np.asarray(bits_mod.pack_bits(jnp.asarray(m))))


def test_pack_under_jit_and_vmap():
    c = jnp.asarray(np.random.default_rng(2).integers(0, 16, size=(3, 5, 7)), jnp.uint8)
    p = jax.jit(lambda c: fewbit.pack(c, 4))(c)
    np.testing.assert_array_equal(np.asarray(fewbit.unpack(p, 4, c.shape)), np.asarray(c))
    pv = jax.vmap(lambda c: fewbit.pack(c, 4))(c)
    uv = jax.vmap(lambda p: fewbit.unpack(p, 4, c.shape[1:]))(pv)
    np.testing.assert_array_equal(np.asarray(uv), np.asarray(c))


def test_non_finite_codes():
    b = np.array([-1.0, 0.0, 1.0], np.float32)
    x = jnp.asarray([np.nan, -np.inf, np.inf, -0.0, 0.0], jnp.float32)
    assert list(np.asarray(fewbit.codes(x, b))) == [0, 0, 3, 2, 2]
    assert list(np.asarray(fewbit.codes(x, b, symmetric=True))) == [0, 3, 3, 2, 2]


@pytest.mark.parametrize("bits", [0, 5, -1, 1.5, True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        fewbit.pack(jnp.zeros(8, jnp.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        fewbit.unpack(jnp.zeros(1, jnp.uint8), bits, (8,))


def test_bad_inputs():
    with pytest.raises(TypeError, match="integer"):
        fewbit.pack(jnp.zeros(8, jnp.float32), 2)
    with pytest.raises(ValueError, match="shape"):
        fewbit.unpack(jnp.zeros(3, jnp.uint8), 2, (8,))
    with pytest.raises(TypeError, match="uint8"):
        fewbit.unpack(jnp.zeros(2, jnp.int32), 2, (8,))
    with pytest.raises(TypeError, match="floating"):
        fewbit.codes(jnp.zeros(4, jnp.int32), [0.0])
