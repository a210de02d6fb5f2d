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
    # data drawn with NumPy (jax.random op by op compiles a program per shape and dtype)
    rng = np.random.default_rng(7)
    xn = rng.normal(size=(2, 9, 5, 3)).astype(np.float32)
    xn[0, 1, :, 0], xn[1, 2, 0, :] = 0.0, np.nan                 # ties at 0, NaN
    x = jnp.asarray(xn, dtype)
    ok_n = rng.uniform(size=(1, 9, 1, 1)) > 0.3
    assert ok_n.any() and not ok_n.all()                          # rows kept and masked
    ok = jnp.asarray(ok_n)
    g = jnp.asarray(rng.normal(size=x.shape).astype(np.float32), dtype)

    def vjp(f):
        y, back = jax.vjp(lambda x: f(x, ok, value), x)
        return y, back(g)[0]

    y0, d0 = jax.jit(lambda: vjp(_composite))()
    y1, d1 = jax.jit(lambda: vjp(tiled._relu_masked))()
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
    np.testing.assert_array_equal(np.asarray(d1, np.float32), np.asarray(d0, np.float32))
    # vmap over the batch, and under jax.checkpoint (each compiled: op by op, every
    # operation is a compile of its own)
    per = jax.jit(jax.vmap(lambda xi, gi: jax.vjp(lambda t: tiled._relu_masked(t, ok[0], value),
                                                  xi)[1](gi)[0]))(x, g)
    np.testing.assert_array_equal(np.asarray(per, np.float32), np.asarray(d0, np.float32))
    ck = jax.jit(jax.grad(lambda t: jnp.sum(jax.checkpoint(
        lambda u: tiled._relu_masked(u, ok, value))(t).astype(jnp.float32)
        * jnp.where(jnp.isinf(value), 0.0, 1.0))))(x)
    ref = jax.jit(jax.grad(lambda t: jnp.sum(_composite(t, ok, value).astype(jnp.float32)
                                             * jnp.where(jnp.isinf(value), 0.0, 1.0))))(x)
    np.testing.assert_array_equal(np.asarray(ck, np.float32), np.asarray(ref, np.float32))


CFG = (8, 8, "M", 16, 16, "M")   # two convs per stage: ReLU -> conv and ReLU -> pool


def _step(side=128, rows=8, abstract=False):
    """The tiled and the untiled loss of the trunk, its parameters and input (``abstract``:
    their shapes only, nothing computed)."""
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape = (1, side, side, 3)
    if abstract:
        params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
    else:
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
    loss, _, ps, xs = _step(side, rows, abstract=True)
    fused = compiled_memory(jax.grad(loss), ps, xs, target=target).temp_bytes
    monkeypatch.setattr(tiled, "_masks_next", lambda nd, nxt: False)
    plain = compiled_memory(jax.grad(loss), ps, xs, target=target).temp_bytes
    tile = (side // rows) * side * 8 * 4   # one first-stage tile's rows, 8 channels, f32
    assert fused <= plain - tiles_less * tile, (fused / MIB, plain / MIB)


@pytest.mark.skipif(not gpu_plan_available(),
                    reason="needs the CUDA PJRT plugin for the H100 plan")
def test_pool_backward_zeros_not_copied_on_the_h100_plan(monkeypatch):
    """The masked ReLU's backward compares with a zero of its own (``_unshared_zero``): read
    from the zeros map the max pool's backward scatters into, that map would be used twice
    and XLA:GPU would keep it beside a copy for the in-place scatter (a tile map more where
    the peak is a tile's backward: 1024² VGG-16, temp 19.38 -> 17.70 MiB; here at least half
    a first-stage tile map)."""
    side, rows = 256, 16
    loss, _, ps, xs = _step(side, rows, abstract=True)
    own = compiled_memory(jax.grad(loss), ps, xs, target="h100")
    monkeypatch.setattr(tiled, "_unshared_zero", lambda dtype: jnp.zeros((), dtype))
    shared = compiled_memory(jax.grad(loss), ps, xs, target="h100")
    tile = (side // rows) * side * 8 * 4   # one first-stage tile's rows, 8 channels, f32
    assert own.temp_bytes <= shared.temp_bytes - tile // 2, (own.temp_bytes / MIB,
                                                        shared.temp_bytes / MIB)
