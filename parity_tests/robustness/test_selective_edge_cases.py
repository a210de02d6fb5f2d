"""jaxmem.selective: second derivatives of max pooling, zero-size arrays, Flax's pooling
defaults, negative pooling padding and argument validation."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from jax import lax

import jaxmem
import jaxmem.selective as S


def rnd(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _close(a, b, tol=1e-5):
    assert_tree_close(a, b, rtol=tol, atol=tol, same_dtype=True)


# ------------------------------------------------------------ max pool, second order
def _second_order(pool):
    """Second derivatives through ``pool``: d2/ds2 of a scalar path and a grad-of-grad
    (Hessian-vector style) w.r.t. the input, both under ``jit``."""
    x = rnd(0, (2, 6, 5, 3))
    v = rnd(1, x.shape)

    def f(x):
        return jnp.sum(pool(x) ** 3)

    def scalar(s):
        return f(x * s)

    def hvp(x):
        return jnp.sum(jax.grad(f)(x) * v)

    return (jax.jit(jax.grad(jax.grad(scalar)))(1.3), jax.jit(jax.grad(hvp))(x))


@pytest.mark.parametrize("cfg", [((2, 2), (1, 1), "SAME"), ((3, 3), (2, 2), ((1, 1), (1, 1)))])
def test_max_pool_grad_of_grad_under_jit_matches_flax(cfg):
    window, strides, padding = cfg
    got = _second_order(lambda x: S.max_pool(x, window, strides, padding))
    want = _second_order(lambda x: nn.max_pool(x, window, strides, padding))
    assert float(jnp.abs(want[0])) > 0 and float(jnp.max(jnp.abs(want[1]))) > 0
    _close(got, want, 1e-4)


def test_transformed_flax_max_pool_grad_of_grad_under_jit():
    pool = lambda x: nn.max_pool(x, (2, 2), (2, 2))  # noqa: E731
    want = _second_order(pool)
    got = _second_order(jaxmem.transform(pool, attention=False))
    jaxpr = str(jax.make_jaxpr(jaxmem.transform(lambda x: nn.max_pool(x, (2, 2))))(
        jnp.ones((1, 4, 4, 1))))
    assert "name=_max_pool" in jaxpr  # the selective pool did run
    _close(got, want, 1e-4)


# ------------------------------------------------------------------ max pool, Flax rules
def test_max_pool_default_strides_are_one_like_flax():
    x = rnd(2, (2, 5, 5, 3))
    want = jax.jit(jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2)) ** 2)))(x)
    for fn in (lambda x: S.max_pool(x, (2, 2)), lambda x: S.max_pool(x, (2, 2), ())):
        _close(fn(x), nn.max_pool(x, (2, 2)))
        _close(jax.jit(jax.grad(lambda x, fn=fn: jnp.sum(fn(x) ** 2)))(x), want)
    # the transformed nn.max_pool keeps Flax's default
    got = jax.jit(jax.grad(jaxmem.transform(lambda x: jnp.sum(nn.max_pool(x, (2, 2)) ** 2))))(x)
    _close(got, want)


@pytest.mark.parametrize("padding", [((-1, 0), (0, -1)), ((1, -1), (-2, 2)), ((-1, -1), (0, 0))])
def test_max_pool_negative_padding_crops_like_flax(padding):
    """Values equal Flax's; gradients equal plain JAX's of the explicit pad/crop then a VALID
    pool (plain JAX's own gradient of ``nn.max_pool`` with a negative padding fails)."""
    x = rnd(3, (2, 5, 6, 2))
    _close(S.max_pool(x, (2, 2), (1, 2), padding), nn.max_pool(x, (2, 2), (1, 2), padding))
    cfg = ((0, 0, 0),) + tuple((lo, hi, 0) for lo, hi in padding) + ((0, 0, 0),)
    sel = lambda x: jnp.sum(S.max_pool(x, (2, 2), (1, 2), padding) ** 2)
    ref = lambda x: jnp.sum(nn.max_pool(lax.pad(x, -jnp.inf, cfg), (2, 2), (1, 2)) ** 2)
    _close(jax.jit(jax.value_and_grad(sel))(x), jax.jit(jax.value_and_grad(ref))(x))


def test_max_pool_empty_output_backward():
    """A window larger than the (padded) input gives an empty output and a zero gradient."""
    x = rnd(4, (2, 3, 3, 2))
    for args in (((4, 4), None, "VALID"), ((1, 1), None, ((0, -3), (0, 0)))):
        y = S.max_pool(x, *args)
        assert y.shape == nn.max_pool(x, *args).shape and y.size == 0
        g = jax.jit(jax.grad(lambda x, a=args: jnp.sum(S.max_pool(x, *a))))(x)
        np.testing.assert_array_equal(np.asarray(g), np.zeros(x.shape, np.float32))


# ---------------------------------------------------------------------- zero-size arrays

@pytest.mark.parametrize("shape,kernel,padding", [
    ((0, 5, 5, 3), (3, 3), "SAME"),      # batch 0
    ((2, 2, 2, 3), (3, 3), "VALID"),     # empty output
    ((2, 4, 4, 3), (2, 2), "SAME"),      # strided (phase input gradient), below: batch 0
    ((0, 4, 4, 3), (3, 3), "SAME"),
])
def test_conv_backward_with_zero_size(shape, kernel, padding):
    x, w, b = rnd(5, shape), rnd(6, (*kernel, 3, 4)), rnd(7, (4,))
    strides = (2, 2) if shape[1] == 4 else (1, 1)
    sel = lambda x, w, b: jnp.sum(S.conv(x, w, b, strides=strides, padding=padding) ** 2)
    ref = lambda x, w, b: jnp.sum((lax.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC")) + b) ** 2)
    grads = lambda f: jax.jit(lambda *a: [jax.grad(f, n)(*a) for n in ((0,), (1,), (0, 1, 2))])
    _close(grads(sel)(x, w, b), grads(ref)(x, w, b))


@pytest.mark.parametrize("fn,ref", [
    (lambda x, s, b: S.layer_norm(x, s, b),
     lambda x, s, b: nn.LayerNorm().apply({"params": {"scale": s, "bias": b}}, x)),
    (lambda x, s, b: S.group_norm(x, s, b, num_groups=2),
     lambda x, s, b: nn.GroupNorm(num_groups=2).apply({"params": {"scale": s, "bias": b}}, x)),
    (lambda x, s, b: S.rms_norm(x, s) + b,
     lambda x, s, b: nn.RMSNorm().apply({"params": {"scale": s}}, x) + b),
])
def test_norm_backward_with_batch_zero(fn, ref):
    x, s, b = jnp.zeros((0, 3, 4)), rnd(8, (4,)), rnd(9, (4,))
    grads = lambda f: jax.jit(lambda *a: [jax.grad(lambda *c: jnp.sum(f(*c)), n)(*a)
                                          for n in ((0,), (1,), (0, 1, 2))])
    _close(grads(fn)(x, s, b), grads(ref)(x, s, b))


# --------------------------------------------------------------------- argument checks
X4, W4 = jnp.ones((1, 5, 5, 4)), jnp.ones((3, 3, 4, 6))
DN = ("NHWC", "HWIO", "NHWC")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: S.conv(X4, W4, strides=0), ValueError, r"conv: strides .* positive .* got 0"),
    (lambda: S.conv(X4, W4, strides=-1), ValueError, r"conv: strides .* got -1"),
    (lambda: S.conv(X4, W4, strides=(1, 0)), ValueError, r"strides .* got \(1, 0\)"),
    (lambda: S.conv(X4, W4, strides=(1,)), ValueError, r"strides .* sequence of 2"),
    (lambda: S.conv(X4, W4, dilation=0), ValueError, r"conv: dilation .* got 0"),
    (lambda: S.conv(X4, W4, input_dilation=-2), ValueError, r"conv: input_dilation .* got -2"),
    (lambda: S.conv(X4, W4, feature_group_count=0), ValueError,
     r"conv: feature_group_count must be a positive int, got 0"),
    (lambda: S.conv(X4, jnp.ones((3, 3, 2, 6)), feature_group_count=2.0), ValueError,
     r"feature_group_count .* got 2.0"),
    (lambda: S.conv(X4, jnp.ones((3, 3, 1, 6)), feature_group_count=4), ValueError,
     r"feature_group_count=4 must divide the output channels"),
    (lambda: S.conv(X4, W4, padding=(1.5, 1)), ValueError, r"conv: each padding entry"),
    (lambda: S.conv(X4, W4, padding=True), ValueError, r"conv: padding"),
    (lambda: S.conv_general_dilated(X4, W4, (0, 1), "SAME", dimension_numbers=DN), ValueError,
     r"conv_general_dilated: window_strides .* got \(0, 1\)"),
    (lambda: S.conv_general_dilated(X4, W4, (1, 1), "SAME", rhs_dilation=(0, 1),
                                    dimension_numbers=DN), ValueError, r"rhs_dilation"),
    (lambda: S.conv_general_dilated(X4, W4, (1, 1), "SAME", lhs_dilation=(1, -1),
                                    dimension_numbers=DN), ValueError, r"lhs_dilation"),
    (lambda: S.conv_general_dilated(X4, W4, (1, 1), "SAME", dimension_numbers=DN,
                                    batch_group_count=0), ValueError, r"batch_group_count"),
    (lambda: S.conv_general_dilated(X4, W4, (1, 1), "SAME", dimension_numbers=DN,
                                    feature_group_count=-1), ValueError,
     r"feature_group_count"),
    (lambda: S.conv_transpose(X4, W4, strides=0), ValueError,
     r"conv_transpose: strides .* got 0"),
    (lambda: S.conv_transpose(X4, W4, dilation=(2, 0)), ValueError,
     r"conv_transpose: dilation .* got \(2, 0\)"),
    (lambda: S.conv_transpose(X4, W4, padding="FULL"), ValueError, r"conv_transpose: padding"),
    (lambda: S.max_pool(X4, (0, 2)), ValueError, r"max_pool: window_shape .* got \(0, 2\)"),
    (lambda: S.max_pool(X4, (2, 2), (2, -1)), ValueError, r"max_pool: strides .* got"),
    (lambda: S.max_pool(X4, (2, 2), padding=((1, 1),)), ValueError, r"max_pool: padding"),
    (lambda: S.max_pool(X4, (2, 2), padding=((0.5, 1), (1, 1))), ValueError,
     r"max_pool: padding"),
    (lambda: S.max_pool(X4, (1, 1), padding=((-3, -3), (0, 0))), ValueError,
     r"max_pool: padding .* crops more than the spatial size"),
    (lambda: S.layer_norm(X4, eps=-1.0), ValueError, r"layer_norm: eps .* got -1.0"),
    (lambda: S.layer_norm(X4, eps=float("nan")), ValueError, r"layer_norm: eps .* got nan"),
    (lambda: S.rms_norm(X4, eps=float("inf")), ValueError, r"rms_norm: eps .* got inf"),
    (lambda: S.group_norm(X4, num_groups=2, eps=-1e-3), ValueError, r"group_norm: eps"),
    (lambda: S.group_norm(X4, num_groups=0), ValueError, r"num_groups .* got 0"),
    (lambda: S.group_norm(X4, num_groups=2.0), ValueError, r"num_groups .* got 2.0"),
    (lambda: S.rms_norm(X4, axis=7), ValueError, r"rms_norm: axis .* got"),
    (lambda: S.normalize(X4, axes=(1,), feature_axes=(3,), eps=-1), ValueError,
     r"normalize: eps"),
    (lambda: S.dropout(jax.random.key(0), X4, True), ValueError, r"dropout: rate .* got True"),
    (lambda: jax.jit(lambda d: S.dropout(jax.random.key(0), X4, 0.5, deterministic=d))(True),
     TypeError, r"dropout: deterministic must be a Python bool"),
    (lambda: S.leaky_relu(X4, True), TypeError, r"leaky_relu: negative_slope"),
])
def test_bad_arguments_raise_named_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_numpy_integer_arguments_are_accepted():
    x, w = rnd(10, (1, 6, 6, 4)), rnd(11, (3, 3, 2, 6))
    a = S.conv(x, w, strides=np.int64(2), feature_group_count=np.int32(2),
               padding=[(np.int64(1), 1), 1])
    b = lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=DN,
                                 feature_group_count=2)
    _close(a, b)
    _close(S.leaky_relu(x, np.float32(0.2)), jax.nn.leaky_relu(x, 0.2))
