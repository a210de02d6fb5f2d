"""The overlap tile's backward runs the chain rule one layer at a time
(``tiled._ov_vjp``), each layer's parameter cotangent released together with the cotangent
it hands on (``tiled._release_together``). It must compute what ``jax.vjp`` of the whole
tile computes, and on XLA:GPU's plan keep fewer bytes where a segment spans several
stages (a later stage's weight gradients no longer wait for an earlier stage's backward)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rc_util import normal

from jaxmem import rowconv as rc
from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.rowconv import tiled

MIB = 2 ** 20


def _whole_tile_vjp(nodes, params, x, o, rng, gy, want_dx):
    """The tile's VJP as one ``jax.vjp`` of the whole tile (the reference)."""
    if want_dx:
        _, vjp = jax.vjp(lambda p, xw: tiled._ov_seq(nodes, p, xw, o, rng), params, x)
        return vjp(gy)
    _, vjp = jax.vjp(lambda p: tiled._ov_seq(nodes, p, x, o, rng), params)
    return vjp(gy)[0], None


@pytest.mark.parametrize("trunk", ["vgg", "resnet"])
@pytest.mark.parametrize("wrt", [(0,), (0, 1)])
def test_layer_by_layer_tile_vjp_equals_the_whole_tile_vjp(trunk, wrt, monkeypatch):
    """VGG (masked ReLUs into convs and pools) and ResNet bottlenecks (residual nodes, a
    projected shortcut, frozen BN), gradient w.r.t. the parameters and the image: bit for
    bit on XLA:CPU, and within fp32 rounding of the untiled stack."""
    if trunk == "vgg":
        layers = rc.trunks.vgg_layers((8, 8, "M", 16, "M"), checkpoints_at_pools=(1,))
        shape, rows = (2, 48, 20, 3), 4
    else:
        layers = rc.trunks.resnet50_layers(width=0.0625, stages=(2, 1), stem=False)
        shape, rows = (1, 32, 12, 5), 4
    params = rc.init(layers, jax.random.PRNGKey(0), shape)
    x = normal(shape, seed=3)

    def grads(rows):
        def loss(p, x):
            y = rc.apply(layers, p, x, rows=rows, mode="overlap")
            return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape) * 0.37))
        return jax.jit(jax.grad(loss, wrt))(params, x)

    per_layer = grads(rows)
    untiled = grads(1)
    monkeypatch.setattr(tiled, "_ov_vjp", _whole_tile_vjp)
    whole = grads(rows)
    leaves = zip(jax.tree.leaves(per_layer), jax.tree.leaves(whole), jax.tree.leaves(untiled),
                 strict=True)
    for a, b, c in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(not gpu_plan_available(),
                    reason="needs the CUDA PJRT plugin for the H100 plan")
def test_released_weight_gradients_keep_less_on_the_h100_plan(monkeypatch):
    """VGG-16 (width 1/8) at 256², 16 tiles, the first two stages one segment: temp 1.365
    MiB with each layer's weight gradient released with its input cotangent, 1.456 MiB
    without (at 1024²: 15.09 vs 16.69 MiB). Bound: at least half a first-stage tile map."""
    layers = rc.trunks.vgg_layers(width=0.125, checkpoints_at_pools=(2, 3, 4))
    side, n = 256, 16
    shape = (1, side, side, 3)
    params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    r = rc.segment_rows(layers, shape, n, "overlap")

    def loss(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=r, mode="overlap")))

    tied = compiled_memory(jax.grad(loss), params, x, target="h100").temp_bytes
    monkeypatch.setattr(tiled, "_release_together", lambda dp, gx: (dp, gx))
    free = compiled_memory(jax.grad(loss), params, x, target="h100").temp_bytes
    tile = (side // n) * side * 8 * 4   # one first-stage tile's rows, 8 channels, f32
    assert tied <= free - tile // 2, (tied / MIB, free / MIB)
