"""``shard_map`` bodies are converted per device, inside a ``shard_map`` of the same mesh,
specs and manual axes: values and gradients equal the untouched step's, and the report has
the body's rows under the ``shard_map`` path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxmem
from jaxmem.measure import compiled_memory


def _mesh():
    devs = jax.devices("cpu")
    n = 2 if len(devs) >= 2 else 1
    return Mesh(np.array(devs[:n]), ("data",)), n


def _params(d=16, h=64):
    k = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k[0], (d, h)) / 4, "w2": jax.random.normal(k[1], (h, d)) / 8,
            "g": 1.0 + 0.1 * jax.random.normal(k[2], (d,))}


def _dp_loss(mesh):
    """Data-parallel loss: LayerNorm -> Dense -> GELU -> Dense -> ReLU per device, psum."""
    def local(p, x):
        m = jnp.mean(x, -1, keepdims=True)
        v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(v + 1e-5) * p["g"]
        h = jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        return jax.lax.psum(jnp.sum(jnp.square(jax.nn.relu(h))), "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())


def test_shard_map_body_converted_and_exact():
    mesh, n = _mesh()
    p = _params()
    x = jax.random.normal(jax.random.key(1), (8 * n, 16)) * 2 + 0.3
    f = _dp_loss(mesh)
    g = jaxmem.transform(f)
    want = jax.jit(jax.value_and_grad(f, (0, 1)))(p, x)
    got = jax.jit(jax.value_and_grad(g, (0, 1)))(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    rep = g.report(p, x)
    entered = [r for r in rep.by_kind("higher-order") if r.matched.startswith("shard_map")]
    assert entered and all(r.converted for r in entered)
    # where the user wrote the per-device step (JAX's short traceback of the shard_map call
    # itself ends in jaxmem)
    assert all("test_transform_shard_map.py" in r.where for r in entered), entered
    inside = [r for r in rep.converted() if r.path.startswith("shard_map")]
    kinds = {r.kind for r in inside}
    assert {"normalisation", "activation"} <= kinds or len(inside) >= 3, rep.table()

    # the converted body keeps fewer bytes than the untouched one on this plan
    loss_bytes = [compiled_memory(jax.grad(fn), p, x).temp_bytes for fn in (f, g)]
    assert loss_bytes[1] < loss_bytes[0]


def test_shard_map_under_vmap_and_checkpoint():
    mesh, n = _mesh()
    p = _params(8, 16)
    xs = jax.random.normal(jax.random.key(2), (3, 4 * n, 8))
    f = _dp_loss(mesh)
    g = jaxmem.transform(jax.checkpoint(f))
    want = jax.jit(jax.vmap(jax.grad(f), (None, 0)))(p, xs)
    got = jax.jit(jax.vmap(jax.grad(g), (None, 0)))(p, xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_mlp_chunk_in_shard_map_bodies_exact():
    """``mlp_chunk`` inside a ``shard_map`` body: the MLP (per device 32 rows, 8 at a time)
    is chunked and the replicated weights' gradients are the untouched step's."""
    mesh, n = _mesh()
    p = _params()
    x = jax.random.normal(jax.random.key(2), (32 * n, 16))
    f = _dp_loss(mesh)
    g = jaxmem.transform(f, mlp_chunk=8)
    want = jax.jit(jax.grad(f))(p, x)
    got = jax.jit(jax.grad(g))(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert len(g.report(p, x).by_kind("mlp")) == 1
