"""Tensor-parallel LayerNorm: the feature axis split over a ``model`` mesh axis, each device
normalising its own features with statistics pooled over the axis (Flax's
``LayerNorm(axis_name="model")`` inside ``shard_map``). ``jaxmem.transform`` re-emits it as
``jaxmem.selective.normalize`` with that axis name: values and gradients equal the untouched
sharded step's and an unsharded LayerNorm's over all features."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmem.transform import transform

D, DEVICES = 16, 4


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                                   atol=1e-5 * max(1.0, float(np.max(np.abs(y)))))


def test_feature_sharded_layer_norm_matches_unsharded():
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("model",))
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(8, D)) * 2 + rng.normal(size=(8, 1)), jnp.float32)
    p = {"params": {"scale": jnp.asarray(1 + 0.3 * rng.normal(size=D), jnp.float32),
                    "bias": jnp.asarray(0.3 * rng.normal(size=D), jnp.float32)}}
    local = nn.LayerNorm(axis_name="model")

    def body(p, x):
        return jax.lax.psum(jnp.sum(jnp.sin(local.apply(p, x)) * x), "model")

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(None, "model")),
                            out_specs=P())
    full = lambda p, x: jnp.sum(jnp.sin(nn.LayerNorm().apply(p, x)) * x)
    step = lambda fn: jax.jit(jax.value_and_grad(fn, (0, 1)))(p, x)
    want = step(sharded)
    _close(want, step(full))
    g = transform(sharded)
    _close(step(g), want)
    rows = g.report(p, x).by_kind("norm")
    assert [(r.converted, r.path) for r in rows] == [(True, "shard_map")], rows
    assert "pooled over axis 'model'" in rows[0].matched
