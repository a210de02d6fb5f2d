"""Bias adds of products (``x @ w + b`` broadcast over the leading axes: Flax ``Dense`` /
``Conv`` biases) become :func:`jaxmem.selective.bias_add`: the
same values and gradients (bit for bit: the same additions, the same sums), nothing kept,
and on XLA:CPU the same compiled program size (the reordering only acts on XLA:GPU:
``parity_tests/gpu_plan/test_gpu_plan_bias.py``).  A constant bias, a bias as large as the
output, a broadcast value used elsewhere, or a bias added to anything but a product (a
position embedding, a residual stream) stays as it was."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import compiled_memory, residual_bytes
from jaxmem.selective import bias_add
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, key, normal


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        pos = self.param("pos", nn.initializers.normal(0.5), (1,) + x.shape[1:])
        h = nn.Dense(24)(x + pos)
        h = nn.gelu(h)
        return nn.Dense(x.shape[-1])(h)


def _loss(model):
    return lambda p, x: jnp.sum(jnp.sin(model.apply({"params": p}, x)) ** 2)


def _perturbed(p):
    """Flax initialises biases to zero: draw every parameter afresh."""
    return jax.tree_util.tree_map(lambda a: normal(a.shape, a.dtype, 0.5), p)


def test_dense_biases_are_exact_and_the_embedding_is_left():
    model = _Mlp()
    x = normal((4, 6, 8))
    p = _perturbed(jax.jit(model.init)(key(), x)["params"])
    f = _loss(model)
    g = transform(f)
    got, want = jax.jit(lambda p, x: (jax.value_and_grad(g, (0, 1))(p, x),
                                      jax.value_and_grad(f, (0, 1))(p, x)))(p, x)
    # the same additions and sums in the same order: equal to rounding (XLA may fuse the
    # two sides' reductions differently)
    close(got, want, rtol=1e-6, atol=1e-6)
    rows = g.report(p, x).by_kind("bias")
    assert [r.converted for r in rows] == [True, True], rows
    assert sorted(r.matched.rsplit("+ ", 1)[1] for r in rows) == ["f32[24]", "f32[8]"], rows
    # nothing kept for the adds, either way
    kept = [residual_bytes(fn, p, x).activation_bytes for fn in (f, g)]
    assert kept[1] <= kept[0], kept


def test_bias_add_function_under_transformations():
    """``jaxmem.selective.bias_add`` itself: values and gradients of ``a + b`` under ``jit``,
    ``vmap``, grad-of-grad, ``lax.scan`` and ``jax.checkpoint``; bf16 and f16 inputs;
    a frozen bias (no bias gradient asked) and a frozen input."""
    a, b = normal((5, 7)), normal((7,))

    def ref(a, b):
        return jnp.sum(jnp.tanh(a + b) ** 2)

    def mine(a, b):
        return jnp.sum(jnp.tanh(bias_add(a, b)) ** 2)

    close(jax.jit(jax.grad(mine, (0, 1)))(a, b), jax.grad(ref, (0, 1))(a, b))
    close(jax.grad(mine, 1)(a, b), jax.grad(ref, 1)(a, b))
    close(jax.grad(mine, 0)(a, b), jax.grad(ref, 0)(a, b))
    # grad of grad (the backward rule is differentiable)
    hess = lambda fn: jax.grad(lambda b: jnp.sum(jax.grad(fn, 0)(a, b) ** 2))(b)
    close(hess(mine), hess(ref), rtol=1e-5)
    # vmap over a batch of (a, b)
    A, B = normal((3, 5, 7)), normal((3, 7))
    close(jax.vmap(jax.grad(mine, (0, 1)))(A, B), jax.vmap(jax.grad(ref, (0, 1)))(A, B))

    # scan over layers, each under jax.checkpoint
    def stack(fn):
        def body(h, bb):
            return jax.checkpoint(lambda h, bb: jnp.tanh(fn(h, bb)))(h, bb), None
        return lambda a, bs: jnp.sum(jax.lax.scan(body, a, bs)[0] ** 2)

    bs = normal((4, 7))
    close(jax.grad(stack(bias_add), (0, 1))(a, bs),
          jax.grad(stack(lambda h, bb: h + bb), (0, 1))(a, bs))
    for dt in (jnp.bfloat16, jnp.float16):
        al, bl = a.astype(dt), b.astype(dt)
        got = jax.grad(mine, (0, 1))(al, bl)
        want = jax.grad(ref, (0, 1))(al, bl)
        assert all(u.dtype == dt for u in got)
        close(jax.tree_util.tree_map(lambda u: u.astype(jnp.float32), got),
              jax.tree_util.tree_map(lambda u: u.astype(jnp.float32), want), rtol=0, atol=0)


def test_bias_add_rejects_bad_input():
    with pytest.raises(TypeError, match="floating-point"):
        bias_add(jnp.ones((2, 3), jnp.int32), jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match="one dtype"):
        bias_add(jnp.ones((2, 3)), jnp.ones((3,), jnp.bfloat16))
    with pytest.raises(ValueError, match="does not broadcast"):
        bias_add(jnp.ones((2, 3)), jnp.ones((4,)))
    with pytest.raises(ValueError, match="broadcast"):
        bias_add(jnp.ones((2, 3)), jnp.ones((3,)), lambda b: jnp.broadcast_to(b, (4, 3)))


def test_constant_large_or_shared_biases_are_left():
    x, w = normal((4, 8)), normal((8, 8))
    c = np.asarray(normal((8,)))          # a constant: no gradient to reorder
    full = normal((4, 8))                 # as large as the output: no broadcast

    def f(w, x, b):
        y = x @ w
        y1 = y + c
        y2 = y + full
        bb = jnp.broadcast_to(b, (4, 8))  # the broadcast read twice
        y3 = x + jnp.tanh(y) + b          # added to a residual stream, not to a product
        return jnp.sum(jnp.tanh(y1 + y2 + bb) ** 2 + bb + y3)

    g = transform(f)
    b = normal((8,))
    assert g.report(w, x, b).by_kind("bias") == []
    close(jax.grad(g, (0, 1, 2))(w, x, b), jax.grad(f, (0, 1, 2))(w, x, b))


def test_biases_option_and_products_switch_it_off():
    model = _Mlp()
    x = normal((2, 6, 8))
    p = jax.jit(model.init)(key(), x)["params"]
    f = _loss(model)
    for g in (transform(f, biases=False), transform(f, products=False)):
        assert g.report(p, x).by_kind("bias") == []
    with pytest.raises(TypeError, match="biases must be True or False"):
        transform(f, biases=1)


@pytest.mark.xla_cpu
def test_xla_cpu_plan_is_unchanged():
    """On XLA:CPU the reordering is nothing: the step compiles to the same bytes with and
    without it (a Flax MLP with biases and a position embedding, full gradient)."""
    model = _Mlp()
    x = jax.ShapeDtypeStruct((64, 16, 8), jnp.float32)
    p = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    f = _loss(model)
    got = [compiled_memory(jax.grad(transform(f, biases=on)), p, x).total_bytes
           for on in (True, False)]
    assert got[0] == got[1], got
