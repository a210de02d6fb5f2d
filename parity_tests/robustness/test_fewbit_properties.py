"""Property-based checks of jaxmem.fewbit against plain JAX and brute force.

* forward of every few-bit op == the exact activation (bit for bit);
* backward == ``dy * levels[bin(x)]`` with the bin counted by brute force from the table
  (``#{i : float32(x) >= float32(border_i)}``, of ``|x|`` for symmetric tables), in float32
  and cast to ``dy.dtype``;
* ``unpack(pack(c)) == c`` for every bit width and every shape, including size 0 and
  lengths that are not a multiple of the packing group;
* ``leaky_relu`` with a traced slope == ``jnp.where(x >= 0, x, slope * x)`` and its autodiff.

Shapes include size 0 and size 1; dtypes float32 / bfloat16 / float16 / float64 (x64).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmem import fewbit

SETTINGS = {"max_examples": 8, "deadline": None, "derandomize": True,
            "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}
DTYPES = ("float32", "bfloat16", "float16", "float64")
# The op-by-op (eager) examples compile every op for each new shape and dtype: fewer of them
EAGER_SETTINGS = {**SETTINGS, "max_examples": 5}



shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


def _inputs(shape, dtype, borders, seed, special=True):
    """Random values, some exactly on the borders, some non-finite (as ``dtype``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=3.0, size=shape)
    flat = x.reshape(-1)
    if flat.size and special:
        special = np.concatenate([np.asarray(borders, np.float64), -np.asarray(borders),
                                  [0.0, -0.0, np.inf, -np.inf, np.nan]])
        k = rng.integers(0, flat.size, size=min(flat.size, 6))
        flat[k] = rng.choice(special, size=k.size)
    return jnp.asarray(x, dtype=dtype)


def _brute_grad(x, dy, borders, levels, symmetric):
    xf = np.asarray(x.astype(jnp.float32))
    if symmetric:
        xf = np.abs(xf)
    b = np.asarray(borders, np.float32)
    code = np.zeros(xf.shape, np.int64)
    for i in range(xf.size):
        code.flat[i] = sum(1 for v in b if xf.flat[i] >= v)  # NaN compares false: bin 0
    q = np.asarray(levels, np.float32)[code]
    g = np.asarray(dy.astype(jnp.float32)) * q
    return jnp.asarray(g).astype(dy.dtype)


@st.composite
def tables(draw):
    bits = draw(st.integers(1, 4))
    k = 2**bits
    # no subnormal entries: XLA:CPU may flush them to zero (whether it does depends on the
    # process's floating-point mode), which is not a property of the few-bit rule
    fl = st.floats(-6, 6, allow_nan=False, allow_subnormal=False, width=32)
    borders = sorted(draw(st.lists(fl, min_size=k - 1, max_size=k - 1)))
    levels = draw(st.lists(st.floats(-3, 3, allow_nan=False, allow_subnormal=False, width=32),
                           min_size=k, max_size=k))
    return bits, borders, levels, draw(st.booleans())


FNS = {"tanh": jnp.tanh, "gelu": lambda x: jax.nn.gelu(x, approximate=False), "sin": jnp.sin}


@settings(**SETTINGS)
@given(table=tables(), shape=shapes, dtype=st.sampled_from(DTYPES),
       fn=st.sampled_from(sorted(FNS)), seed=st.integers(0, 2**16), jit=st.booleans())
def test_fewbit_op_forward_exact_backward_brute_force(x64, table, shape, dtype, fn, seed, jit):
    bits, borders, levels, symmetric = table
    with x64(dtype):
        op = fewbit.fewbit_op(FNS[fn], borders, levels, bits, symmetric=symmetric, name=fn)
        x = _inputs(shape, dtype, borders, seed)
        dy = jnp.asarray(np.random.default_rng(seed + 1).normal(size=shape), dtype)

        def vjp(x, dy):
            y, pull = jax.vjp(op, x)
            return y, pull(dy)[0]

        y, dx = (jax.jit(vjp) if jit else vjp)(x, dy)
        assert y.dtype == x.dtype and dx.dtype == x.dtype and y.shape == x.shape
        # the forward is the activation itself; XLA may fuse it with its neighbours under jit,
        # which changes its rounding by an ulp, so compare to 2 ulp of the dtype
        eps = float(jnp.finfo(x.dtype).eps)
        np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(FNS[fn](x), np.float64),
                                   rtol=2 * eps, atol=2 * eps)
        want = _brute_grad(x, dy, borders, levels, symmetric)
        np.testing.assert_array_equal(np.asarray(dx, np.float64), np.asarray(want, np.float64))


@settings(**EAGER_SETTINGS)
@given(name=st.sampled_from(sorted(fewbit.TABLE_ACTIVATIONS)), bits=st.integers(1, 4),
       shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_shipped_activation_matches_its_table(x64, name, bits, shape, dtype, seed):
    t = fewbit.load_table(name, bits)
    with x64(dtype):
        op = fewbit.activation(name, bits)
        x = _inputs(shape, dtype, t.borders, seed)
        dy = jnp.asarray(np.random.default_rng(seed + 1).normal(size=shape), dtype)
        y, pull = jax.vjp(op, x)
        np.testing.assert_array_equal(np.asarray(y, np.float64),
                                      np.asarray(fewbit.TABLE_ACTIVATIONS[name].fn(x), np.float64))
        want = _brute_grad(x, dy, t.borders, t.levels, t.symmetric)
        np.testing.assert_array_equal(np.asarray(pull(dy)[0], np.float64),
                                      np.asarray(want, np.float64))


@settings(**SETTINGS)
@given(bits=st.integers(1, 4), shape=shapes, seed=st.integers(0, 2**16), jit=st.booleans())
def test_pack_unpack_round_trip(bits, shape, seed, jit):
    c = np.random.default_rng(seed).integers(0, 2**bits, size=shape).astype(np.uint8)
    pk = (jax.jit(fewbit.pack, static_argnums=1) if jit else fewbit.pack)(jnp.asarray(c), bits)
    assert pk.dtype == jnp.uint8
    assert pk.shape == fewbit.packed_shape(shape, bits)
    size = int(np.prod(shape, dtype=np.int64))
    g, nb = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1)}[bits]
    assert pk.size == -(-size // g) * nb  # ceil(size * bits / 8) up to one group's padding
    back = fewbit.unpack(pk, bits, shape)
    assert back.shape == tuple(shape) and back.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(back), c)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_round_trip_every_length(bits):
    """Every length 0..2G+1 (all remainders of the group size G), as (n,) and (1, n)."""
    rng = np.random.default_rng(bits)
    g = {1: 8, 2: 4, 3: 8, 4: 2}[bits]
    cs = [rng.integers(0, 2**bits, size=shape).astype(np.uint8)
          for n in range(2 * g + 2) for shape in ((n,), (1, n))]
    # every length in one compiled program (the same pack / unpack per shape as op by op;
    # test_pack_unpack_round_trip runs them eagerly too)
    backs = jax.jit(lambda cs: [fewbit.unpack(fewbit.pack(c, bits), bits, c.shape)
                                for c in cs])([jnp.asarray(c) for c in cs])
    for back, c in zip(backs, cs):
        assert back.shape == c.shape
        np.testing.assert_array_equal(np.asarray(back), c)


@settings(**SETTINGS)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       slope=st.floats(-2, 2, allow_nan=False, allow_subnormal=False, width=32))
def test_leaky_relu_traced_slope_matches_plain_jax(x64, shape, dtype, seed, slope):
    with x64(dtype):
        # finite x: at x = +inf plain JAX's slope gradient is 0 * inf = NaN, ours is 0
        x = _inputs(shape, dtype, [0.0], seed, special=False)
        dy = jnp.asarray(np.random.default_rng(seed + 1).normal(size=shape), dtype)
        s = jnp.asarray(slope, jnp.float32)

        def ref(x, s):
            return jnp.where(x >= 0, x, s.astype(x.dtype) * x)

        def vjp(f, x, s):
            y, pull = jax.vjp(f, x, s)
            return (y,) + pull(dy)

        # ours and the reference in one compiled program
        (y, dx, ds), (y0, dx0, ds0) = jax.jit(
            lambda x, s: (vjp(fewbit.leaky_relu, x, s), vjp(ref, x, s)))(x, s)
        np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(y0, np.float64))
        np.testing.assert_array_equal(np.asarray(dx, np.float64), np.asarray(dx0, np.float64))
        tol = {"float32": 1e-5, "float64": 1e-12}.get(dtype, 2e-2)
        np.testing.assert_allclose(np.asarray(ds, np.float64), np.asarray(ds0, np.float64),
                                   rtol=tol, atol=tol * (1 + float(np.nansum(np.abs(
                                       np.asarray(ds0, np.float64))))))
        # the concrete-slope op is the same function
        yc, pull = jax.vjp(lambda x: fewbit.leaky_relu(x, float(s)), x)
        np.testing.assert_array_equal(np.asarray(yc, np.float64), np.asarray(y0, np.float64))
        if dtype == "float32":  # the cached op's backward runs in float32
            np.testing.assert_array_equal(np.asarray(pull(dy)[0], np.float64),
                                          np.asarray(dx0, np.float64))
