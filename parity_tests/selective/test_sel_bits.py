"""jaxmem.selective.bits: packing round trips and errors."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.selective.bits import pack_bits, pack_codes, packed_size, unpack_bits, unpack_codes


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_pack_bits_round_trip(shape, seed):
    b = np.random.default_rng(seed).random(shape) > 0.5
    p = pack_bits(jnp.asarray(b))
    assert p.dtype == jnp.uint8 and p.shape == (math.ceil(b.size / 8),)
    np.testing.assert_array_equal(unpack_bits(p, shape), b)
    # layout: bit j of byte i is element 8 i + j
    flat = np.concatenate([b.reshape(-1), np.zeros((-b.size) % 8, bool)])
    np.testing.assert_array_equal(p, np.packbits(flat.reshape(-1, 8), axis=1,
                                                 bitorder="little").reshape(-1))


@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_pack_codes_round_trip(nbits):
    c = np.random.default_rng(nbits).integers(0, 2**nbits, size=(3, 7))
    p = pack_codes(jnp.asarray(c), nbits)
    assert p.shape == (packed_size(21, nbits),)
    np.testing.assert_array_equal(unpack_codes(p, nbits, (3, 7)), c)


def test_errors():
    with pytest.raises(ValueError, match="nbits"):
        pack_codes(jnp.zeros(3, jnp.int32), 3)
    with pytest.raises(TypeError, match="bool"):
        pack_bits(jnp.zeros(3))
    with pytest.raises(ValueError, match="needs"):
        unpack_bits(jnp.zeros(2, jnp.uint8), (30,))
