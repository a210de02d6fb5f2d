"""A ReLU whose output the next spatial layer masks (rows outside the image set to its pad
value) runs inside an overlap tile as one op that keeps only the masked output for its
backward: gradients bit for bit the composite's, a tile-sized buffer less on XLA:GPU's H100
plan (whose cuDNN conv + bias + ReLU fusion otherwise keeps its output beside the masked
copy); never more on XLA:CPU (which already keeps one of the two)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import rowconv as rc
from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.rowconv import tiled

MIB = 2 ** 20


def _composite(x, ok, value):
    return jnp.where(ok, jax.nn.relu(x), jnp.asarray(value, x.dtype))


@pytest.mark.parametrize("value", [0.0, -np.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_relu_masked_equals_the_composite_bit_for_bit(value, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k1, (2, 9, 5, 3), dtype)
    x = x.at[0, 1, :, 0].set(0.0).at[1, 2, 0, :].set(jnp.nan)   # ties at 0, NaN
    ok = (jax.random.uniform(k2, (1, 9, 1, 1)) > 0.3)
    g = jax.random.normal(k3, x.shape, dtype)

    def vjp(f):
        y, back = jax.vjp(lambda x: f(x, ok, value), x)
        return y, back(g)[0]

    y0, d0 = jax.jit(lambda: vjp(_composite))()
    y1, d1 = jax.jit(lambda: vjp(tiled._relu_masked))()
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
    np.testing.assert_array_equal(np.asarray(d1, np.float32), np.asarray(d0, np.float32))
    # vmap over the batch, and under jax.checkpoint
    per = jax.vmap(lambda xi, gi: jax.vjp(lambda t: tiled._relu_masked(t, ok[0], value),
                                          xi)[1](gi)[0])(x, g)
    np.testing.assert_array_equal(np.asarray(per, np.float32), np.asarray(d0, np.float32))
    ck = jax.grad(lambda t: jnp.sum(jax.checkpoint(
        lambda u: tiled._relu_masked(u, ok, value))(t).astype(jnp.float32)
        * jnp.where(jnp.isinf(value), 0.0, 1.0)))(x)
    ref = jax.grad(lambda t: jnp.sum(_composite(t, ok, value).astype(jnp.float32)
                                     * jnp.where(jnp.isinf(value), 0.0, 1.0)))(x)
    np.testing.assert_array_equal(np.asarray(ck, np.float32), np.asarray(ref, np.float32))


CFG = (8, 8, "M", 16, 16, "M")   # two convs per stage: ReLU -> conv and ReLU -> pool


def _step(side=128, rows=8):
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape = (1, side, side, 3)
    params = rc.init(layers, jax.random.PRNGKey(0), shape)
    x = jax.random.normal(jax.random.key(1), shape)
    r = rc.segment_rows(layers, shape, rows, "overlap")

    def loss(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=r, mode="overlap")))

    def untiled(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=1)))

    return loss, untiled, params, x


def test_tiled_gradients_unchanged_by_the_fused_relu(monkeypatch):
    loss, untiled, params, x = _step()
    g1 = jax.jit(jax.grad(loss, (0, 1)))(params, x)
    monkeypatch.setattr(tiled, "_masks_next", lambda nd, nxt: False)
    g0 = jax.jit(jax.grad(loss, (0, 1)))(params, x)
    gu = jax.jit(jax.grad(untiled, (0, 1)))(params, x)
    for a, b, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), jax.tree.leaves(gu)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("target", "tiles_less"), [
    ("cpu", 0), pytest.param("h100", 0.5, marks=pytest.mark.skipif(
        not gpu_plan_available(), reason="needs the CUDA PJRT plugin for the H100 plan"))])
def test_fused_relu_keeps_a_tile_buffer_less(target, tiles_less, monkeypatch):
    side, rows = 256, 16
    loss, _, params, x = _step(side, rows)
    ps = jax.eval_shape(lambda: params)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fused = compiled_memory(jax.grad(loss), ps, xs, target=target).temp_bytes
    monkeypatch.setattr(tiled, "_masks_next", lambda nd, nxt: False)
    plain = compiled_memory(jax.grad(loss), ps, xs, target=target).temp_bytes
    tile = (side // rows) * side * 8 * 4   # one first-stage tile's rows, 8 channels, f32
    assert fused <= plain - tiles_less * tile, (fused / MIB, plain / MIB)
