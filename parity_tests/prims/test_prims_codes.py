"""jaxmem._prims.codes: compare-and-sum bin codes (the few-bit ops' codes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import fewbit
from jaxmem._prims.bitpack import pack, unpack
from jaxmem._prims.codes import bin_codes, check_borders


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_codes_count_borders_in_float32(dtype):
    """codes == numpy count of borders <= float32(x) (of |x| if symmetric), for 1..4-bit
    tables, and they survive packing."""
    rng = np.random.default_rng(len(dtype))
    x = jnp.asarray(rng.normal(size=(3, 17)) * 2, dtype=dtype)
    xf = np.asarray(x.astype(jnp.float32))
    for bits in (1, 2, 3, 4):
        borders = np.sort(rng.normal(size=2**bits - 1)).astype(np.float32)
        for symmetric in (False, True):
            c = bin_codes(x, borders, symmetric=symmetric)
            assert c.dtype == jnp.uint8 and c.shape == x.shape
            ref = ((np.abs(xf) if symmetric else xf)[..., None] >= borders).sum(-1)
            np.testing.assert_array_equal(np.asarray(c), ref)
            np.testing.assert_array_equal(np.asarray(unpack(pack(c, bits), bits, x.shape)), ref)


def test_non_finite_and_ties():
    b = np.array([-1.0, 0.0, 1.0], np.float32)
    x = jnp.asarray([np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0, -1.0], jnp.float32)
    assert list(np.asarray(bin_codes(x, b))) == [0, 0, 3, 2, 2, 3, 1]
    assert list(np.asarray(bin_codes(x, b, symmetric=True))) == [0, 3, 3, 2, 2, 3, 3]
    # equal borders leave an empty bin
    assert list(np.asarray(bin_codes(jnp.asarray([0.5, 1.0, 2.0]), [1.0, 1.0]))) == [0, 2, 2]


def test_vmap_and_the_fewbit_name():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 9)), jnp.float32)
    b = [-0.5, 0.0, 0.5]
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda r: bin_codes(r, b))(x)),
                                  np.asarray(bin_codes(x, b)))
    assert fewbit.codes is bin_codes


@pytest.mark.parametrize("bad", [[np.nan, 1.0], [1.0, 0.0], [0.0, 1e39], [0.0, np.inf]])
def test_refuses_bad_borders(bad):
    with pytest.raises(ValueError, match="borders must be finite"):
        bin_codes(jnp.ones(3), bad)
    with pytest.raises(ValueError, match="borders must be finite"):
        check_borders(bad)


def test_refuses_bad_inputs():
    with pytest.raises(TypeError, match="x must be a floating array"):
        bin_codes(jnp.zeros(4, jnp.int32), [0.0])
    with pytest.raises(ValueError, match="at most 255 borders"):
        bin_codes(jnp.zeros(4), np.arange(256.0))
