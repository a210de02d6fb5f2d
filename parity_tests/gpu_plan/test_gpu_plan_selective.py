"""jaxmem.selective on the H100 plan: the ReLU's 1-bit mask costs 1/8 B per element per layer
(an elementwise ``x > 0`` mask does not: XLA:GPU fuses it away and keeps more), and a frozen
conv / dense layer stores no input while a trained one stores it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _gp_util import mlp_per_elem, plan, rand
from jax import lax

import jaxmem.selective as S
from jaxmem.measure import slope


@jax.custom_vjp
def _relu_bool_mask(x):
    return jnp.maximum(x, 0.0)


def _relu_bool_fwd(x):
    return jnp.maximum(x, 0.0), x > 0  # the mask kept as an elementwise bool


def _relu_bool_bwd(mask, g):
    return (jnp.where(mask, g, jnp.zeros_like(g)),)


_relu_bool_mask.defvjp(_relu_bool_fwd, _relu_bool_bwd)


@pytest.fixture(scope="module")
def relu_mlp():
    """B per hidden element per layer of a frozen MLP with each ReLU (compiled once)."""
    return {"jaxmem": mlp_per_elem(S.relu), "bool mask": mlp_per_elem(_relu_bool_mask),
            "jax": mlp_per_elem(jax.nn.relu)}


def test_relu_mask_is_one_bit(relu_mlp):
    assert relu_mlp["jaxmem"] == 1 / 8, relu_mlp


def test_elementwise_bool_mask_is_not_kept_packed(relu_mlp):
    """The same backward with ``x > 0`` as residual: XLA:GPU fuses the compare into the
    backward and keeps what it reads instead (the check above can fail). At this shape that
    is the Triton split-K dot's unreduced ``f32[8, b, h]`` partial sums, 32 B per element
    per layer (buffer assignment), as for plain ``jax.nn.relu``."""
    assert relu_mlp["bool mask"] >= 1.0, relu_mlp
    assert relu_mlp["jax"] >= 1.0, relu_mlp


# ------------------------------------------------------------------- frozen conv / dense
SHAPE = (8, 32, 32, 8)
E = 8 * 32 * 32 * 8
KERNEL = 3 * 3 * 8 * 8 * 4 / E  # one kernel copy per element


def _lax_conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _conv_slope(layer, argnums, depth=2):
    """temp + output bytes per element per added layer of ``layer`` chained, gradient w.r.t.
    the input (``argnums=0``: every kernel frozen) or the kernels (``argnums=1``)."""
    x = rand(0, SHAPE)

    def measure(d):
        ws = [rand(10 + i, (3, 3, 8, 8), 0.2) for i in range(d)]

        def loss(x, ws):
            for w in ws:
                x = layer(x, w)
            return jnp.sum(x * x)

        c = plan(jax.grad(loss, argnums), x, ws)
        return c.temp_bytes + c.output_bytes

    return slope(measure, depth) / E


@pytest.fixture(scope="module")
def conv():
    return {"frozen": _conv_slope(S.conv, 0), "trained": _conv_slope(S.conv, 1),
            "frozen relu": _conv_slope(lambda x, w: S.relu(S.conv(x, w)), 0),
            "jax frozen relu": _conv_slope(lambda x, w: jax.nn.relu(_lax_conv(x, w)), 0)}


def test_frozen_conv_stores_no_input(conv):
    """Kernels frozen: nothing input-sized per layer (at most a kernel copy); trained: the
    input (4 B per element) for the kernel gradient, so the check can fail."""
    assert conv["frozen"] <= KERNEL + 0.01, conv
    assert conv["trained"] >= 4.0, conv


def test_frozen_conv_relu_keeps_only_the_mask(conv):
    assert conv["frozen relu"] <= 1 / 8 + KERNEL + 0.01, conv
    assert conv["jax frozen relu"] >= 1.0, conv


def _dense_slope(argnums, b=128, h=512, depth=2):
    x = rand(1, (b, h))

    def measure(d):
        ws = [rand(20 + i, (h, h), h ** -0.5) for i in range(d)]

        def loss(x, ws):
            for w in ws:
                x = S.relu(S.dense(x, w))
            return jnp.sum(x)

        c = plan(jax.grad(loss, argnums), x, ws)
        return c.temp_bytes + c.output_bytes - (x.nbytes if argnums == 0 else 0)

    return slope(measure, depth) / (b * h)


def test_frozen_dense_stores_no_input():
    """Frozen: the 1-bit mask only; trained: the weight gradient (h*h*4 B per layer = 16 B
    per element here), each layer input dying where its layer's weight gradient is formed.
    On one device jaxmem's bilinear backward returns the input and the weight gradient from
    one barrier (``ties.together``; measured 16.13). Left unordered, XLA:GPU put the weight
    gradients at the end of the backward, where the inputs were still alive (20.00)."""
    frozen, trained = _dense_slope(0), _dense_slope(1)
    assert frozen == 1 / 8, (frozen, trained)
    assert 16.0 <= trained < 16.0 + 0.5, (frozen, trained)
