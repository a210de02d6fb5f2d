"""jaxmem._prims.mask: the exact 1-bit-mask activations (relu, relu6, hard_tanh, leaky_relu,
mask_op) shared by jaxmem.selective and jaxmem.fewbit: values and gradients equal to jax.nn's
bit for bit (kinks, dtypes, non-finite cotangents), one packed bit per element, and the
transformations."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import fewbit
from jaxmem import selective as S
from jaxmem._compat import saved_residuals
from jaxmem._prims import mask as M
from jaxmem.measure import residual_bytes

KINKS = [0.0, -0.0, 6.0, -1.0, 1.0, 3.0, -3.0, 7.0]
SLOPES = [0.01, 0.3, -2.0]
CASES = ([(n, getattr(M, n), getattr(jax.nn, n)) for n in ("relu", "relu6", "hard_tanh")]
         + [(f"leaky_relu({s})", (lambda x, s=s: M.leaky_relu(x, s)),
             (lambda x, s=s: jax.nn.leaky_relu(x, s))) for s in SLOPES])


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 4
    x.reshape(-1)[:len(KINKS)] = KINKS
    return jnp.asarray(x, dtype), jnp.asarray(rng.normal(size=shape), dtype)


def _value_and_vjp(f, x, dy):
    y, pull = jax.vjp(f, x)
    return y, pull(dy)[0]


def _all_cases(pick):
    """Values and input gradients of every case in one jitted function (one compile)."""
    return jax.jit(lambda x, dy: [_value_and_vjp(c[pick], x, dy) for c in CASES])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_values_and_gradients_equal_jax_nn(dtype):
    x, dy = _data((5, 13), dtype)
    for (name, _, _), (y, g), (y0, g0) in zip(CASES, _all_cases(1)(x, dy), _all_cases(2)(x, dy)):
        assert y.dtype == g.dtype == jnp.dtype(dtype), name
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32),
                                      err_msg=name)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g0, np.float32),
                                      err_msg=name)


def test_float64(x64):
    with x64("float64"):
        x, dy = _data((4, 9), "float64")
        for (name, _, _), (y, g), (y0, g0) in zip(CASES, _all_cases(1)(x, dy),
                                                  _all_cases(2)(x, dy)):
            assert g.dtype == jnp.float64, name
            np.testing.assert_array_equal(np.asarray(y), np.asarray(y0), err_msg=name)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(g0), err_msg=name)


def test_non_finite_cotangent_where_the_slope_is_zero():
    """dy = inf/NaN where the slope is 0 gives 0, as jax.nn's derivatives (not 0 * inf)."""
    x = jnp.asarray([-2.0, -1.0, 0.5, 7.0])
    dy = jnp.asarray([np.inf, np.nan, 1.0, -np.inf])
    pairs = [(S.relu, jax.nn.relu), (S.relu6, jax.nn.relu6),
             (S.hard_tanh, jax.nn.hard_tanh), (lambda x: fewbit.leaky_relu(x, 0.0),
                                                    lambda x: jax.nn.leaky_relu(x, 0.0))]
    got = jax.jit(lambda x, dy: [_value_and_vjp(f, x, dy)[1] for f, _ in pairs])(x, dy)
    want = jax.jit(lambda x, dy: [_value_and_vjp(r, x, dy)[1] for _, r in pairs])(x, dy)
    for g, g0 in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fewbit_leaky_relu_low_precision_gradient_is_jax_nn(dtype):
    """dy * slope is rounded as jax.nn.leaky_relu's derivative rounds it (in dy's dtype)."""
    x, dy = _data((64,), dtype, seed=3)
    _, g = jax.jit(lambda x, dy: _value_and_vjp(lambda x: fewbit.leaky_relu(x, 0.1), x, dy))(
        x, dy)
    _, g0 = jax.jit(lambda x, dy: _value_and_vjp(lambda x: jax.nn.leaky_relu(x, 0.1), x, dy))(
        x, dy)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g0, np.float32))


def test_one_implementation_behind_both_parts():
    assert S.relu is M.relu and S.relu6 is M.relu6 and S.hard_tanh is M.hard_tanh
    assert fewbit.leaky_relu is M.leaky_relu and fewbit.mask_op is M.mask_op
    for name in ("relu", "relu6", "hard_tanh"):
        assert fewbit.activation(name, 2) is M.named(name)
    x, dy = _data((3, 8), "float32")
    np.testing.assert_array_equal(
        np.asarray(_value_and_vjp(lambda x: S.leaky_relu(x, 0.2), x, dy)[1]),
        np.asarray(_value_and_vjp(lambda x: fewbit.leaky_relu(x, 0.2), x, dy)[1]))


@pytest.mark.parametrize("name", ["relu", "relu6", "hard_tanh", "leaky_relu"])
def test_residual_is_one_packed_bit_per_element_and_tagged(name):
    x = jax.random.normal(jax.random.key(0), (37, 11))
    f = getattr(M, name)
    rep = residual_bytes(lambda x: jnp.sum(f(x * 2.0)), x)
    assert rep.activation_bytes == math.ceil(x.size / 8), str(rep)
    names = [s for _, s in saved_residuals(lambda x: jnp.sum(f(x * 2.0)), x)]
    assert any(f"jaxmem.selective.{name}.mask" in s for s in names), names
    # the input is not differentiated: nothing is stored for it
    w = jnp.float32(1.5)
    rep_w = residual_bytes(lambda x, w: jnp.sum(f(x * 2.0) * w), x, w, argnums=1)
    assert not any(e.dtype == jnp.uint8 for e in rep_w.entries), str(rep_w)


def test_transformations():
    """vmap, lax.scan under jax.checkpoint, and grad of grad, against jax.nn (one jit a side)."""
    x, dy = _data((4, 6), "float32")

    def suite(f):
        per_row = jax.vmap(jax.grad(lambda v: f(v).sum()))(x)

        def loss(x):
            h, _ = jax.lax.scan(lambda h, _: (f(h) * 1.5, None), x, None, length=3)
            return jnp.sum(h * dy)

        scanned = jax.grad(jax.checkpoint(loss))(x)
        hvp = jax.grad(lambda x: jnp.sum(jax.grad(lambda v: jnp.sum(f(v) * v))(x)))(x)
        return per_row, scanned, hvp

    got = jax.jit(lambda: [suite(c[1]) for c in CASES])()
    want = jax.jit(lambda: [suite(c[2]) for c in CASES])()
    for (name, _, _), a, b in zip(CASES, got, want):
        for u, v in zip(a, b):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-12,
                                       err_msg=name)


def test_array_slope_matches_plain_jax():
    x, dy = _data((3, 7), "float32", seed=5)
    s = jnp.asarray([0.1, -0.5, 2.0])[:, None]

    def both(f):
        y, pull = jax.vjp(f, x, s)
        return (y,) + pull(dy)

    ours = jax.jit(lambda: both(M.leaky_relu))()
    ref = jax.jit(lambda: both(lambda x, s: jnp.where(x >= 0, x, s * x)))()
    for a, b in zip(ours[:2], ref[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(ours[2]), np.asarray(ref[2]), rtol=1e-6)
    # differentiated w.r.t. x only: one packed bit per element (+ the scalar slope)
    xs = jax.random.normal(jax.random.key(1), (64, 64))
    rep = residual_bytes(lambda x, s: M.leaky_relu(x, s).sum(), xs, jnp.float32(0.1), argnums=0)
    assert rep.activation_bytes <= xs.size // 8 + 64, str(rep)


def test_mask_op_any_two_slopes():
    op = M.mask_op(jnp.abs, lambda x: x >= 0, -1.0, 1.0, name="abs")
    x, dy = _data((2, 9), "float32", seed=2)
    y, g = _value_and_vjp(op, x, dy)
    np.testing.assert_array_equal(np.asarray(y), np.abs(np.asarray(x)))
    np.testing.assert_array_equal(np.asarray(g), np.where(np.asarray(x) >= 0, 1.0, -1.0)
                                  * np.asarray(dy))
    pred = jnp.isfinite
    assert M.mask_op(jnp.abs, pred, 0.5, 2.0) is M.mask_op(jnp.abs, pred, 0.5, 2.0)  # cached
    assert list(op.levels) == [-1.0, 1.0] and op.bits == 1 and op.__name__ == "abs"


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.relu(jnp.ones(3, jnp.int32)), TypeError, "relu: x must be a floating-point"),
    (lambda: S.relu6(jnp.ones(3, jnp.bool_)), TypeError, "relu6: x must be a floating"),
    (lambda: M.leaky_relu(jnp.ones(3), True), TypeError, "negative_slope must be a float"),
    (lambda: M.leaky_relu(jnp.ones(3), float("nan")), ValueError, "negative_slope must be finite"),
    (lambda: M.leaky_relu(jnp.ones(3), 1e39), ValueError, "negative_slope must be finite"),
    (lambda: M.leaky_relu(jnp.ones(3), jnp.ones(4)), ValueError, "does not broadcast"),
    (lambda: M.leaky_relu(jnp.ones(3), jnp.ones(3, jnp.bool_)), TypeError, "must be real"),
    (lambda: S.leaky_relu(jnp.ones(3), jnp.float32(0.1)), TypeError, "Python float"),
    (lambda: M.mask_op(jnp.abs, None, 0.0, 1.0), TypeError, "callables"),
    (lambda: M.mask_op(jnp.abs, jnp.isfinite, np.nan, 1.0), ValueError, "low must be finite"),
    (lambda: M.mask_op(jnp.abs, jnp.isfinite, 0.0, "1"), TypeError, "high must be a float"),
])
def test_refusals(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
