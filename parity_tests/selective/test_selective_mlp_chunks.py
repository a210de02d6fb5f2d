"""``jaxmem.selective.chunked_mlp``: ``f(x W1 + b1) W2`` with its backward pass a few rows at a
time gives the plain composition's values and gradients (float64 reference), under ``jit``,
``vmap``, ``grad``, ``lax.scan``, ``jax.checkpoint``, in bf16 / f16, with some inputs not
differentiated; keeps its input instead of its hidden activation; rejects bad arguments."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import compiled_memory
from jaxmem.selective import chunked_mlp

D, F = 16, 64
_RNG = np.random.default_rng()


def normal(shape, scale=1.0):
    """Fresh standard-normal float32 values (new on every run)."""
    return jnp.asarray((_RNG.standard_normal(shape) * scale).astype(np.float32))


def _args(lead=(3, 37), w1_axis=0, bias=True, dtype=jnp.float32):
    x = normal((*lead, D))
    w1 = normal((D, F) if w1_axis == 0 else (F, D), scale=D ** -0.5)
    b1 = normal((F,)) if bias else None
    w2 = normal((F, D), scale=F ** -0.5)
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(x), cast(w1), cast(b1), cast(w2)


def _plain(x, w1, b1, w2, w1_axis=0, f=jax.nn.gelu):
    h = x @ (w1 if w1_axis == 0 else w1.T)
    return f(h if b1 is None else h + b1) @ w2


def _loss(fn, g):
    return lambda *a: jnp.sum(fn(*a) * g)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("w1_axis", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [16, 111, 200])  # remainder of 15; one chunk; nothing chunked
def test_exact_against_float64(rows, bias, w1_axis):
    x, w1, b1, w2 = _args(w1_axis=w1_axis, bias=bias)
    g = normal((3, 37, D))
    args = (x, w1, w2) if b1 is None else (x, w1, w2, b1)

    def split(a):
        return a[0], a[1], (a[3] if len(a) == 4 else None), a[2]

    chunked = lambda *a: chunked_mlp(*split(a)[:3], split(a)[3], jax.nn.gelu, rows,
                                     w1_axis=w1_axis)
    plain = lambda *a: _plain(*split(a), w1_axis=w1_axis)
    argn = tuple(range(len(args)))
    v1, g1 = jax.jit(jax.value_and_grad(_loss(chunked, g), argn))(*args)
    v0, g0 = jax.jit(jax.value_and_grad(_loss(plain, g), argn))(*args)
    with jax.enable_x64(True):
        a64 = [np.asarray(a, np.float64) for a in args]
        g64 = jax.grad(_loss(plain, np.asarray(g, np.float64)), argn)(*a64)
    assert all(c.dtype == np.float64 for c in g64)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b, c in zip(g1, g0, g64):
        assert _rel(a, c) < 1e-5 and _rel(b, c) < 1e-5, (_rel(a, c), _rel(b, c))


def test_transformations():
    x, w1, b1, w2 = _args()
    f = lambda x, w1: chunked_mlp(x, w1, b1, w2, jnp.tanh, 32)
    p = lambda x, w1: _plain(x, w1, b1, w2, f=jnp.tanh)
    for make in (lambda fn: jax.vmap(jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), 1),
                                     (0, None)),
                 lambda fn: jax.grad(jax.checkpoint(lambda x, w: jnp.sum(fn(x, w) ** 2))),
                 lambda fn: jax.grad(lambda x, w: jnp.sum(
                     jax.lax.scan(lambda c, xi: (c + jnp.sum(fn(xi, w) ** 2), None),
                                  0.0, x)[0]), (0, 1)),
                 lambda fn: jax.grad(lambda x, w: jnp.sum(jax.grad(
                     lambda x, w: jnp.sum(fn(x, w) ** 2))(x, w) ** 2), 1)):
        got, want = jax.jit(make(f))(x, w1), jax.jit(make(p))(x, w1)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert _rel(a, b) < 1e-5


def test_only_some_inputs_differentiated():
    x, w1, b1, w2 = _args()
    f = lambda w2: jnp.sum(chunked_mlp(x, w1, b1, w2, jax.nn.gelu, 20) ** 2)
    p = lambda w2: jnp.sum(_plain(x, w1, b1, w2) ** 2)
    assert _rel(jax.jit(jax.grad(f))(w2), jax.jit(jax.grad(p))(w2)) < 1e-5
    fx = lambda x: jnp.sum(chunked_mlp(x, w1, b1, w2, jax.nn.gelu, 20) ** 2)
    px = lambda x: jnp.sum(_plain(x, w1, b1, w2) ** 2)
    assert _rel(jax.jit(jax.grad(fx))(x), jax.jit(jax.grad(px))(x)) < 1e-5


@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_half_precision(dtype, tol):
    # the chunks' weight gradients are summed in float32: within the dtype's rounding of the
    # plain half-precision gradients, both against the float32 ones
    args = _args(dtype=dtype)
    f = lambda *a: jnp.sum(chunked_mlp(*a, jax.nn.gelu, 16).astype(jnp.float32) ** 2)
    p = lambda *a: jnp.sum(_plain(*a).astype(jnp.float32) ** 2)
    argn = (0, 1, 2, 3)
    got = jax.jit(jax.grad(f, argn))(*args)
    half = jax.jit(jax.grad(p, argn))(*args)
    ref = jax.jit(jax.grad(p, argn))(*(a.astype(jnp.float32) for a in args))
    for a, b, c in zip(got, half, ref):
        assert a.dtype == dtype
        assert _rel(a, c) < tol
        assert _rel(a, c) < 2 * _rel(b, c) + tol / 4


def test_keeps_input_not_hidden_activation():
    # recomputed under jax.checkpoint (where the planner and nn.remat put it), the backward
    # pass forms (rows, F) blocks instead of (R, F) arrays: R = 2048 rows, F = 1024, 8 MiB each
    x = jax.ShapeDtypeStruct((2, 1024, 128), jnp.float32)
    w1 = jax.ShapeDtypeStruct((128, 1024), jnp.float32)
    w2 = jax.ShapeDtypeStruct((1024, 128), jnp.float32)

    def temp(fn):
        loss = jax.checkpoint(lambda x, w1, w2: jnp.sum(fn(x, w1, w2) ** 2))
        return compiled_memory(jax.grad(loss, (0, 1, 2)), x, w1, w2).temp_bytes

    whole = temp(lambda x, w1, w2: _plain(x, w1, None, w2))
    chunked = temp(lambda x, w1, w2: chunked_mlp(x, w1, None, w2, jax.nn.gelu, 256))
    hidden = 2 * 1024 * 1024 * 4
    assert whole >= 2 * hidden, whole / 2**20
    assert chunked <= whole - hidden, (chunked / 2**20, whole / 2**20)


@pytest.mark.parametrize("kwargs, match", [
    ({"rows": 0}, "rows must be an int >= 1"),
    ({"rows": True}, "rows must be an int >= 1"),
    ({"rows": 2.0}, "rows must be an int >= 1"),
    ({"w1_axis": 2}, "w1 must be a matrix contracted over axis 0 or 1"),
    ({"w1": jnp.ones((D, F, 1))}, "w1 must be a matrix"),
    ({"w1": jnp.ones((D + 1, F))}, "x's last axis must match w1's axis 0"),
    ({"b1": jnp.ones((F + 1,))}, r"b1 must be None or \(64,\)"),
    ({"w2": jnp.ones((F + 1, D))}, "w2's axis 0 must have 64 entries"),
])
def test_bad_arguments(kwargs, match):
    x, w1, b1, w2 = _args()
    call = {"x": x, "w1": w1, "b1": b1, "w2": w2, "activation": jax.nn.gelu, "rows": 8}
    call.update(kwargs)
    with pytest.raises(ValueError, match=match):
        chunked_mlp(**call)
