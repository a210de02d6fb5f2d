"""Elementwise activation subgraphs, however spelled: the ReLU family becomes the exact 1-bit
mask (values and gradients equal, one packed bit per element stored), smooth ones keep
only their input without ``fewbit`` (exact; ``parity_tests/transform/test_transform_smooth.py``)
and a ``b``-bit code with it (forward exact; gradient the fitted table's, i.e. what
``jaxmem.fewbit`` gives for the same function)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

MASKED = {
    "jax.nn.relu": jax.nn.relu,
    "max(x, 0)": lambda x: jnp.maximum(x, 0.0),
    "max(0, x) spelled with where": lambda x: jnp.where(x > 0, x, 0.0),
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.2),
    "leaky via max": lambda x: jnp.maximum(x, 0.1 * x),
    "relu6": jax.nn.relu6,
    "hard_tanh": jax.nn.hard_tanh,
    "clip": lambda x: jnp.clip(x, -2.0, 3.0),
}


@pytest.mark.parametrize("name", list(MASKED))
def test_piecewise_linear_becomes_an_exact_one_bit_mask(name):
    act = MASKED[name]
    w = normal((32, 64), scale=0.3)
    x = normal((16, 32), scale=3.0)

    def f(w, x):
        return jnp.sum(act(x @ w) ** 2)

    g = transform(f)
    rows = g.report(w, x).by_kind("activation")
    assert len(rows) == 1 and rows[0].converted and "1-bit mask" in rows[0].became, rows
    close(*jax.jit(lambda *a: (jax.grad(g, (0, 1))(*a), jax.grad(f, (0, 1))(*a)))(w, x))
    # what autodiff keeps for the activation: a packed uint8 mask, 1/8 B per element
    res = residual_bytes(g, w, x, argnums=0)
    masks = [e for e in res.entries if e.dtype == np.uint8]
    assert masks and sum(e.nbytes for e in masks) <= 16 * 64 // 8 + 8
    big = [e for e in res.entries if e.shape == (16, 64)]
    assert [e.dtype for e in big] == [np.float32]     # only the square's input, y = f(z)
    assert res.total_bytes < residual_bytes(f, w, x, argnums=0).total_bytes


def test_mask_keeps_the_subgraphs_own_derivative_at_the_kink():
    x = jnp.array([-1.0, 0.0, 0.0, 2.0])
    f = lambda x: jnp.sum(jax.nn.relu(x) * 3.0)
    close(jax.grad(transform(f))(x), jax.grad(f)(x), rtol=0, atol=0)


SMOOTH = {
    "gelu tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu erf (hand written)": lambda x: x * 0.5 * (1.0 + jax.lax.erf(x / np.sqrt(2.0))),
    "silu": lambda x: x * jax.nn.sigmoid(x),
}


@pytest.mark.parametrize("name", list(SMOOTH))
def test_smooth_keeps_its_input_without_fewbit(name):
    act = SMOOTH[name]
    x, w = normal((8, 24), scale=2.0), normal((24, 4))
    f = lambda x, w: jnp.sum(act(x) @ w)
    g = transform(f)
    rows = g.report(x, w).by_kind("activation")
    assert [r.converted for r in rows] == [True] and rows[0].became.startswith("exact")
    close(*jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(f)(*a)))(x, w))


def test_a_smooth_function_keeping_one_array_stays():
    x, z = normal((8, 24)), normal((8, 24))
    f = lambda x, z: jnp.sum(jnp.exp(x) * z)      # autodiff keeps exp(x) only
    rows = transform(f).report(x, z).by_kind("activation")
    assert [r.converted for r in rows] == [False] and "keeps 1" in rows[0].reason


def test_norm_statistics_and_losses_are_no_activations():
    x = normal((8, 24), scale=2.0)

    def f(x):  # a hand-written RMSNorm and a squared loss: their smooth parts stay exact
        y = x * jax.lax.rsqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-6)
        return jnp.mean(y ** 2)

    # norms=False: the RMSNorm's insides reach the activation matcher (with norms on they
    # are one normalisation, parity_tests/transform/test_transform_norms.py)
    g = transform(f, fewbit=2, norms=False)
    rows = g.report(x).by_kind("activation")
    assert rows and not any(r.converted for r in rows)
    assert any("reduced statistics" in r.reason for r in rows)
    assert any("output is reduced" in r.reason for r in rows)
    close(*jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(f)(*a)))(x))


def test_fewbit_fits_a_table_for_that_function():
    act = SMOOTH["gelu tanh"]
    w = normal((32, 64), scale=0.3)
    x = normal((16, 32), scale=2.0)

    def f(w, x):
        return jnp.sum(act(x @ w) * 0.5)

    g = transform(f, fewbit=3)
    row, = g.report(w, x).by_kind("activation")
    assert row.converted and row.became.startswith("3-bit")
    close(*jax.jit(lambda *a: (g(*a), f(*a)))(w, x), rtol=1e-6)
    # dL/dz = 0.5 * q(z) for z = x @ w: at most 2**3 distinct values (the table's levels)
    z = x @ w
    dz = jax.jit(jax.grad(lambda z: jnp.sum(transform(act, fewbit=3)(z) * 0.5)))(z)
    assert 2 < np.unique(np.asarray(dz)).size <= 8
    exact = jax.jit(jax.grad(f))(w, x)
    err = float(jnp.linalg.norm(jax.jit(jax.grad(g))(w, x) - exact) / jnp.linalg.norm(exact))
    assert 0 < err < 0.1
    r_exact = residual_bytes(transform(f), w, x, argnums=0).activation_bytes
    r_fewbit = residual_bytes(g, w, x, argnums=0).activation_bytes
    assert r_fewbit < r_exact


def test_interior_values_used_elsewhere_are_not_swallowed():
    x = normal((4, 16))

    def f(x):
        s = jax.nn.sigmoid(x)          # used twice: inside x * s and returned
        return jnp.sum(x * s) + jnp.sum(s ** 2)

    g = transform(f)
    close(*jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(f)(*a)))(x))


def test_a_linear_chain_is_not_reported():
    x = normal((4, 8))
    rows = transform(lambda x: jnp.sum(x * 2.0 - 1.0)).report(x)
    assert not rows.by_kind("activation")
