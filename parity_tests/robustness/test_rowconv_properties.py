"""Property-based checks of jaxmem.rowconv: tiled == untiled, outputs and gradients.

Random conv stacks (convs with random kernels, strides, dilations and paddings, pools,
activations, affine layers, residual blocks) on random NHWC shapes (batch 0 and size-1
height/width included), any tile count the stack admits, both modes, a separate backward
tile count: ``rowconv.apply(rows=n)`` must equal ``rows=1`` (the plain stack) in its output
and in the gradients with respect to the parameters and the input (float64: 1e-10;
float32: 1e-5).  Non-elementwise ``Act`` functions are refused; elementwise ones pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close, scaled_atol
from _rc_params import random_params
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxmem import rowconv as rc

SETTINGS = {"max_examples": 8, "deadline": None, "derandomize": True,
            "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.filter_too_much]}



ACTS = (jax.nn.relu, jax.nn.gelu, jnp.tanh, jax.nn.silu, jax.nn.leaky_relu)
rc.Act(jax.nn.relu)  # builds the table of known activations outside the strategies
PADS = ("SAME", "VALID", 0, 1, ((0, 2), (1, 0)), ((2, 1), (0, 1)))


@st.composite
def conv(draw, c):
    f = draw(st.integers(1, 3))
    return rc.Conv(f, (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                   strides=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                   kernel_dilation=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                   padding=draw(st.sampled_from(PADS)), use_bias=draw(st.booleans())), f


@st.composite
def stacks(draw):
    c = draw(st.integers(1, 3))
    shape = (draw(st.sampled_from([0, 1, 2])), draw(st.integers(1, 14)),
             draw(st.integers(1, 5)), c)
    layers = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["conv", "conv", "pool", "act", "affine", "residual"]))
        if kind == "conv":
            layer, c = draw(conv(c))
        elif kind == "pool":
            w = (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
            layer = rc.Pool(draw(st.sampled_from(["max", "avg"])), w,
                            draw(st.sampled_from([None, 1, (2, 1)])),
                            draw(st.sampled_from(["VALID", "SAME", ((1, 0), (0, 1))])))
        elif kind == "act":
            layer = rc.Act(draw(st.sampled_from(ACTS)))
        elif kind == "affine":
            layer = rc.Affine(c)
        else:
            k = draw(st.integers(1, 3))
            branch = [rc.Conv(c, k, padding="SAME"), rc.Act(draw(st.sampled_from(ACTS)))]
            layer = rc.Residual(branch, draw(st.sampled_from([None, [rc.Affine(c)]])))
        layers.append(layer)
    try:
        out = rc.output_shape(layers, shape)
    except ValueError:  # an empty output map: not a stack
        assume(False)
    return layers, shape, out


def _normal(shape, seed, dtype):
    return jnp.asarray(np.asarray(np.random.default_rng(seed).normal(size=shape),
                                  jnp.dtype(dtype)))


def _run(layers, params, x, rows, mode, rows_bp):
    def loss(p, x):
        y = rc.apply(layers, p, x, rows=rows, mode=mode, rows_bp=rows_bp)
        w = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37)
        return jnp.sum(y * w), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    return y, g


@settings(**SETTINGS)
@given(stack=stacks(), mode=st.sampled_from(["overlap", "share"]),
       dtype=st.sampled_from(["float64", "float32"]), data=st.data())
def test_tiled_equals_untiled_outputs_and_gradients(x64, stack, mode, dtype, data):
    layers, shape, out = stack
    top = rc.segment_rows(layers, shape, 64, mode)[0]
    assume(top > 1)
    rows = data.draw(st.integers(2, top), label="rows")
    rows_bp = data.draw(st.sampled_from([None, 1, top]), label="rows_bp")
    with x64(dtype):
        params = random_params(layers, shape, rows, dtype, noise=0.3, positive_var=False)
        x = _normal(shape, 3, dtype)
        y1, g1 = _run(layers, params, x, 1, mode, None)
        yn, gn = _run(layers, params, x, rows, mode, rows_bp)
        assert yn.shape == y1.shape == out and yn.dtype == x.dtype
        tol = 1e-10 if dtype == "float64" else 1e-5
        assert_tree_close((yn, gn), (y1, g1), rtol=tol, atol=scaled_atol(tol, plus=1.0))


@pytest.mark.parametrize("dtype,mode", [("bfloat16", "overlap"), ("float16", "share")])
def test_tiled_half_precision_close_to_untiled(dtype, mode):
    layers = [rc.Conv(3, 3), rc.Act(jax.nn.relu), rc.Pool("max", 2), rc.Conv(2, 3),
              rc.Act(jax.nn.gelu)]
    shape = (1, 12, 4, 2)
    params = random_params(layers, shape, 0, dtype, noise=0.3, positive_var=False)
    x = _normal(shape, 1, dtype)
    y1, g1 = _run(layers, params, x, 1, mode, None)
    rows = rc.segment_rows(layers, shape, 3, mode)[0]
    assert rows > 1
    yn, gn = _run(layers, params, x, rows, mode, None)
    assert yn.dtype == x.dtype
    assert_tree_close((yn, gn), (y1, g1), rtol=0, atol=scaled_atol(3e-2, plus=1.0))


NON_ELEMENTWISE = (
    lambda a: (lambda x: x / (1e-3 + jnp.sqrt(jnp.mean(x * x, axis=a, keepdims=True)))),
    lambda a: (lambda x: jnp.cumsum(x, axis=a)),
    lambda a: (lambda x: jnp.flip(x, axis=a)),
    lambda a: (lambda x: x - jnp.max(x, axis=a, keepdims=True)),
    lambda a: (lambda x: jnp.roll(x, 1, axis=a)),
)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(make=st.sampled_from(NON_ELEMENTWISE), axis=st.sampled_from([0, 1, 2, 3, (1, 2)]))
def test_act_refuses_non_elementwise(make, axis):
    if make is NON_ELEMENTWISE[4] and isinstance(axis, tuple):
        axis = 1
    with pytest.raises(ValueError, match="not elementwise|could not be applied"):
        rc.Act(make(axis))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(a=st.floats(0.1, 3), b=st.floats(-2, 2), fn=st.sampled_from(ACTS + (jnp.sin,)))
def test_act_accepts_elementwise_compositions(a, b, fn):
    f = jax.jit(lambda x: a * fn(x + b) - b)
    layer = rc.Act(f)  # probed (an unknown callable) and accepted
    x = jnp.linspace(-3, 3, 2 * 6 * 3 * 2).reshape(2, 6, 3, 2)
    y = rc.apply([layer], [{}], x, rows=3)
    np.testing.assert_allclose(np.asarray(y), np.asarray(f(x)), rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(v=st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=2),
                   st.integers(-3, 0), st.just(None), st.lists(st.floats(), max_size=2)))
def test_rows_of_the_wrong_kind_are_refused(v):
    layers = [rc.Conv(2, 3), rc.Act(jax.nn.relu)]
    params = rc.init(layers, jax.random.PRNGKey(0), (1, 8, 4, 2))
    with pytest.raises((TypeError, ValueError), match="rows"):
        rc.apply(layers, params, jnp.ones((1, 8, 4, 2)), rows=v)
