"""dot_general / conv_general_dilated, however called (``@``, ``jnp.einsum``,
``lax.dot_general``, a user's Conv1D), become jaxmem.selective's bilinear ops: the same
values and gradients, and a frozen weight keeps no input."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal


def _net(w1, w2, x):
    h = jnp.tanh(jnp.einsum("bi,io->bo", x, w1))
    return jnp.sum(lax.dot_general(h, w2, (((1,), (0,)), ((), ()))) ** 2)


def test_products_are_converted_and_exact():
    w1, w2, x = normal((16, 32), scale=0.3), normal((32, 8), scale=0.3), normal((4, 16))
    g = transform(_net)
    rows = g.report(w1, w2, x).by_kind("dot")
    assert len(rows) == 2 and all(r.converted for r in rows)
    assert all(r.became == "jaxmem.selective.dot_general" for r in rows)
    close(jax.jit(jax.grad(g, (0, 1, 2)))(w1, w2, x), jax.jit(jax.grad(_net, (0, 1, 2)))(
        w1, w2, x))


def test_frozen_weight_keeps_no_input():
    w1, w2, x = normal((16, 32), scale=0.3), normal((32, 8), scale=0.3), normal((64, 16))
    # only w2 is trained: the first layer's weight is frozen, its input x is not needed
    res = residual_bytes(transform(_net), w1, w2, x, argnums=1)
    kept = [e for e in res.entries if "dense.input" in e.source]
    assert [e.shape for e in kept] == [(64, 32)]          # the second layer's input only
    assert not [e for e in res.entries if e.shape == (64, 16)]   # x itself is not kept
    # training w1 instead: the first layer's input x is kept, the second's is not
    res = residual_bytes(transform(_net), w1, w2, x, argnums=0)
    kept = [e.shape for e in res.entries if "dense.input" in e.source]
    assert kept == [(64, 16)]


def test_conv_is_converted_and_exact():
    w = normal((3, 3, 4, 8), scale=0.3)
    x = normal((2, 9, 9, 4))

    def f(w, x):
        y = lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jax.nn.relu(y) ** 2)

    g = transform(f)
    rows = g.report(w, x)
    assert [r.converted for r in rows.by_kind("conv")] == [True]
    close(jax.jit(jax.grad(g, (0, 1)))(w, x), jax.jit(jax.grad(f, (0, 1)))(w, x))


def test_integer_products_are_reported_not_converted():
    a = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    rows = transform(lambda a: a @ a.T).report(a).by_kind("dot")
    assert [r.converted for r in rows] == [False] and "integer" in rows[0].reason
