"""``jaxmem.selective.gated_product``: ``a * b`` keeping the residuals of ``a``'s producer.

A gated linear unit ``down(silu(x W) * (x V))`` under plain autodiff keeps ``x W``, ``silu(x W)``,
``x V`` and the product; with the exact activation, the gated product and a selective dense it
keeps ``x W`` and ``x V`` only (two arrays of the hidden width, not four) -- and the values and
gradients are autodiff's (compared with a float64 reference), under ``jit``, ``vmap``,
``lax.scan``, ``jax.checkpoint``, in bf16, with frozen factors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxmem.selective as S
from jaxmem.measure import residual_bytes

N, D, F = 16, 8, 32
RNG = np.random.default_rng()


def _rand(shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape) * scale, dtype)


def _params(dtype=jnp.float32):
    return {"w": _rand((D, F), D ** -0.5, dtype), "v": _rand((D, F), D ** -0.5, dtype),
            "u": _rand((F, D), F ** -0.5, dtype)}


def glu(p, x):
    """SwiGLU as jaxmem's ops: exact silu, gated product, selective dense."""
    h = S.gated_product(S.smooth_activation(jax.nn.silu, S.dense(x, p["w"]), name="silu"),
                        S.dense(x, p["v"]))
    return S.dense(h, p["u"])


def glu_plain(p, x):
    return (jax.nn.silu(x @ p["w"]) * (x @ p["v"])) @ p["u"]


def _loss(layer):
    return lambda p, x: jnp.sum(layer(p, x) ** 2)


def _close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        b = np.asarray(b, np.float64)
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol,
                                   atol=rtol * max(1.0, float(np.abs(b).max())))


def test_values_and_gradients_match_autodiff_and_float64():
    p, x = _params(), _rand((N, D))
    got = jax.jit(jax.value_and_grad(_loss(glu), (0, 1)))(p, x)
    want = jax.jit(jax.value_and_grad(_loss(glu_plain), (0, 1)))(p, x)
    _close(got, want)
    with jax.enable_x64(True):
        p64, x64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), (p, x))
        ref = jax.value_and_grad(_loss(glu_plain), (0, 1))(p64, x64)
    _close(got, ref, rtol=1e-4)


def test_keeps_the_two_projections_only():
    p, x = _params(), _rand((N, D))
    ours = residual_bytes(_loss(glu), p, x, argnums=(0,))
    plain = residual_bytes(_loss(glu_plain), p, x, argnums=(0,))
    hidden = N * F * 4
    big = sorted(e.nbytes for e in ours.entries if e.kind == "activation" and e.nbytes >= hidden)
    assert big == [hidden, hidden], ours.entries          # x W and x V
    assert ours.activation_bytes <= plain.activation_bytes - 2 * hidden


def test_partly_frozen_and_unrecorded_factors():
    p, x = _params(), _rand((N, D))
    z, u = x @ p["w"], x @ p["v"]

    def f(z, u):   # only u differentiated: the silu keeps nothing, the product keeps silu(z)
        return jnp.sum(S.gated_product(S.smooth_activation(jax.nn.silu, z), u) ** 2)

    def ref(z, u):
        return jnp.sum((jax.nn.silu(z) * u) ** 2)

    _close(jax.grad(f, 1)(z, u), jax.grad(ref, 1)(z, u))
    _close(jax.grad(f, 0)(z, u), jax.grad(ref, 0)(z, u))
    _close(jax.grad(f, (0, 1))(z, u), jax.grad(ref, (0, 1))(z, u))
    # neither factor recorded: the plain product (no custom rule)
    jaxpr = jax.make_jaxpr(lambda a, b: S.gated_product(a, b))(z, u)
    assert [e.primitive.name for e in jaxpr.eqns] == ["mul"]


def test_under_vmap_scan_and_checkpoint():
    p, x = _params(), _rand((3, N, D))
    want = jax.grad(lambda p: sum(_loss(glu_plain)(p, xi) for xi in x))(p)
    vm = jax.grad(lambda p: jnp.sum(jax.vmap(lambda xi: _loss(glu)(p, xi))(x)))(p)
    _close(vm, want)

    sc = jax.grad(lambda p: lax.scan(lambda c, xi: (c + jax.checkpoint(_loss(glu))(p, xi),
                                                    None), 0.0, x)[0])(p)
    _close(sc, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_close_to_float64(dtype):
    p, x = _params(dtype), _rand((N, D), dtype=dtype)
    got = jax.jit(jax.grad(_loss(glu)))(p, x)
    plain = jax.jit(jax.grad(_loss(glu_plain)))(p, x)
    with jax.enable_x64(True):
        p64, x64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), (p, x))
        ref = jax.grad(_loss(glu_plain))(p64, x64)
    for g, q, r in zip(*(jax.tree_util.tree_leaves(t) for t in (got, plain, ref))):
        g, q, r = (np.asarray(a, np.float64) for a in (g, q, r))
        # no further from float64 than autodiff of the same bf16 / f16 program (its rounding)
        assert np.abs(g - r).max() <= 2 * np.abs(q - r).max() + 1e-2 * np.abs(r).max()


def test_bad_factors_are_refused():
    a = _rand((4, 3))
    with pytest.raises(ValueError, match="one shape and dtype"):
        S.gated_product(a, a[:, :2])
    with pytest.raises(ValueError, match="one shape and dtype"):
        S.gated_product(a, a.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="floating-point"):
        S.gated_product(jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.int32))
