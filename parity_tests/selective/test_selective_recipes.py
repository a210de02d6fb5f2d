"""Recipes of several producers (``_prims.recipes.combine``).

A ResNet block output ``relu(bn2(c2) + x)`` is an elementwise function of the arrays the
norms keep anyway (``c2`` and, down the chain of identity blocks, every earlier block's
norm input): recorded with ``combine``, the next block's first convolution keeps those
(shared) instead of the block output, and recomputes it in the backward pass. Gradients
are bit-identical (the recomputation is the forward's own functions of the same arrays);
one input-sized array less is kept per block."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxmem.selective as S
from jaxmem._prims import recipes
from jaxmem.measure import residual_bytes

SHAPE = (4, 8, 8, 8)
C = SHAPE[-1]


def _rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _unit(x, w, s, b):
    return S.batch_norm(S.conv(x, w), s, b, train=True)[0]


def _params(blocks):
    return {"stem": (_rand(1, (3, 3, 3, C), 0.3), jnp.ones((C,)), jnp.zeros((C,))),
            "blocks": [[(_rand(10 + 2 * i + j, (3, 3, C, C), 0.2),
                         1.0 + 0.1 * _rand(50 + 2 * i + j, (C,)),
                         0.1 * _rand(80 + 2 * i + j, (C,))) for j in range(2)]
                       for i in range(blocks)]}


def _loss(record: bool):
    """stem (conv-bn-relu) then identity blocks ``relu(bn(conv(relu(bn(conv(x))))) + x)``."""
    def loss(ps, inp):
        x = S.relu(_unit(inp, *ps["stem"]))
        for p in ps["blocks"]:
            h = S.relu(_unit(x, *p[0]))
            y = _unit(h, *p[1])
            z = y + x
            if record:  # what jaxmem.transform does for an add of two recorded values
                recipes.combine(z, lax.add, y, x)
            x = S.relu(z)
        return jnp.sum(x * x)
    return loss


def _reference(ps, inp):
    """The same network with plain JAX (autodiff of lax ops)."""
    def unit(x, w, s, b):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        mu = jnp.mean(y, (0, 1, 2))
        var = jnp.maximum(0.0, jnp.mean(y * y, (0, 1, 2)) - mu * mu)
        return (y - mu) * (lax.rsqrt(var + 1e-5) * s) + b
    x = jax.nn.relu(unit(inp, *ps["stem"]))
    for p in ps["blocks"]:
        x = jax.nn.relu(unit(jax.nn.relu(unit(x, *p[0])), *p[1]) + x)
    return jnp.sum(x * x)


def _inp():
    return _rand(0, SHAPE[:-1] + (3,))


def test_combine_records_the_sum_of_recorded_values():
    x = _rand(1, (4, 8))
    one, zero = jnp.ones((8,)), jnp.zeros((8,))
    a = S.batch_norm(x, one, zero, train=True)[0]
    b = S.relu(S.batch_norm(2.0 * x, one, zero, train=True)[0])
    z = a + b
    assert recipes.combine(z, lax.add, a, b)
    fn, args, groups = recipes.recipe(z)
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(z))
    ga, gb = recipes.recipe(a)[2], recipes.recipe(b)[2]
    n = len(recipes.recipe(a)[1])
    assert groups == ga + tuple(tuple(n + i for i in g) for g in gb)
    # the ReLU of the sum is recorded on top (``then``), with the same args and groups
    r = recipes.recipe(S.relu(z))
    assert r is not None and r[2] == groups
    np.testing.assert_array_equal(np.asarray(r[0](*r[1])), np.asarray(jax.nn.relu(z)))
    # a Python scalar is a constant of the op; an unrecorded array records nothing
    w = a * 0.5
    assert recipes.combine(w, lax.mul, a, 0.5)
    fn, args, _ = recipes.recipe(w)
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(w))
    assert not recipes.combine(x + a, lax.add, x, a)


def test_kept_needs_every_producer():
    groups = ((0, 3), (5, 8))
    args = list(range(10))
    assert recipes.kept(args, groups, lambda v: v in (3, 5))
    assert not recipes.kept(args, groups, lambda v: v in (0, 3))
    assert recipes.kept(args, ((0, 3),), lambda v: v == 0)


def test_combine_gives_up_past_the_argument_cap():
    one, zero = jnp.ones((8,)), jnp.zeros((8,))
    x = S.batch_norm(_rand(2, (4, 8)), one, zero, train=True)[0]
    per = len(recipes.recipe(x)[1])
    for _ in range(recipes.MAX_ARGS // per + 1):
        y = S.batch_norm(_rand(3, (4, 8)), one, zero, train=True)[0]
        z = x + y
        recorded = recipes.combine(z, lax.add, x, y)
        x = z
    assert not recorded and recipes.recipe(x) is None


def test_residual_blocks_gradients_bit_identical():
    ps, inp = _params(3), _inp()
    g_rec = jax.jit(jax.grad(_loss(True), argnums=(0, 1)))(ps, inp)
    g_plain = jax.jit(jax.grad(_loss(False), argnums=(0, 1)))(ps, inp)
    for a, b in zip(jax.tree.leaves(g_rec), jax.tree.leaves(g_plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and JAX's own autodiff of the same network, up to f32 rounding (scaled per leaf)
    ref = jax.jit(jax.grad(_reference, argnums=(0, 1)))(ps, inp)
    for a, b in zip(jax.tree.leaves(g_rec), jax.tree.leaves(ref)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5,
                                   atol=1e-5 * float(np.abs(b).max()))


def test_residual_blocks_keep_one_array_less_per_block():
    ps, inp = _params(3), _inp()
    per = int(np.prod(SHAPE)) * 4
    kept = residual_bytes(_loss(True), ps, inp, argnums=0).activation_bytes
    plain = residual_bytes(_loss(False), ps, inp, argnums=0).activation_bytes
    # blocks 2 and 3 read the previous block's output (block 1 reads the stem's ReLU,
    # recorded already): each now keeps the norms' arrays instead (per-channel statistics
    # counted again where a recipe reaches back: a few hundred bytes)
    assert 2 * per - 1024 <= plain - kept <= 2 * per, (plain, kept)


def test_partly_frozen_chain_keeps_what_it_kept():
    """Stem and first block frozen, input not differentiated: their norms keep nothing, so
    the later blocks' convolutions must keep the block output as before (``kept`` fails)."""
    ps, inp = _params(2), _inp()

    def split(loss):
        def f(train, frozen, inp):
            return loss({"stem": frozen["stem"], "blocks": [frozen["b0"], train]}, inp)
        return f

    train, frozen = ps["blocks"][1], {"stem": ps["stem"], "b0": ps["blocks"][0]}
    kept = residual_bytes(split(_loss(True)), train, frozen, inp, argnums=0).activation_bytes
    plain = residual_bytes(split(_loss(False)), train, frozen, inp, argnums=0).activation_bytes
    assert kept == plain
    g1 = jax.jit(jax.grad(split(_loss(True))))(train, frozen, inp)
    g0 = jax.jit(jax.grad(split(_loss(False))))(train, frozen, inp)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
