"""Spatial rowconv: the height split over 2/4/8 devices equals the single-device stack."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem import rowconv as rc
from jaxmem.distributed import compiled_collectives
from jaxmem.rowconv.spatial import spatial_apply, spatial_plan


def _stack():
    """Strided SAME conv, dilated conv, max and avg pool, VALID conv, residual, dropout."""
    return [rc.Conv(4, 3), rc.Act(jax.nn.relu), rc.Conv(4, 3, strides=2), rc.Act(jnp.tanh),
            rc.Pool("max", 2), rc.Checkpoint(),
            rc.Conv(4, (3, 1), padding="VALID"), rc.Dropout(0.25),
            rc.Residual([rc.Conv(4, 3, kernel_dilation=2), rc.Act(jax.nn.relu)]),
            rc.Pool("avg", (1, 2))]


def _same_stack():
    return [rc.Conv(4, 3), rc.Act(jax.nn.relu), rc.Pool("max", 2), rc.Checkpoint(),
            rc.Conv(4, 3), rc.Act(jax.nn.relu), rc.Conv(4, 5, kernel_dilation=(1, 1))]


def _params(layers, shape, seed=0):
    # one compiled program rather than op by op
    return jax.jit(lambda: _make_params(layers, shape, seed))()


def _make_params(layers, shape, seed):
    p = rc.init(layers, jax.random.PRNGKey(seed), shape)
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.PRNGKey(seed + 7), len(leaves))
    return jax.tree.unflatten(tree, [v + 0.2 * jax.random.normal(k, v.shape)
                                     for k, v in zip(keys, leaves)])


def _weighted(y):
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37))


def _mesh(n, name="rows"):
    return Mesh(np.array(jax.devices()[:n]), (name,))


_KEY = jax.random.PRNGKey(5)


@functools.cache
def _untiled():
    """The stack, its parameters, the input and the untiled stack's (loss, y) and gradients
    on one device (the reference of every device count)."""
    layers = _stack()
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 128, 8, 3))
    params = _params(layers, x.shape)

    def loss_ref(p, x):
        y = rc.apply(layers, p, x, rng=_KEY)
        return _weighted(y), y

    return layers, params, x, jax.jit(jax.value_and_grad(loss_ref, (0, 1), has_aux=True))(
        params, x)


#: 2 devices (each an edge with one neighbour) and 8 (edges and six interior devices with
#: two neighbours) cover the device roles that 4 would; the 4-device split is compiled by
#: the halo and the batch x height tests below.
@pytest.mark.parametrize("n", [2, 8])
def test_outputs_and_grads_equal_untiled(n):
    layers, params, x, ((v0, y0), (gp0, gx0)) = _untiled()
    mesh = _mesh(n)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "rows")))

    def loss(p, x):
        y = spatial_apply(layers, p, x, mesh=mesh, axis_name="rows", rows=2, rng=_KEY)
        return _weighted(y), y

    (v, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, xs)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(v), float(v0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx0), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gp0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_hlo_halo_permutes_match_plan_and_no_all_gather():
    n, layers = 4, _same_stack()
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 64, 8, 3))
    params = _params(layers, x.shape)
    mesh = _mesh(n)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "rows")))
    plan = spatial_plan(layers, x.shape, n)
    # halos: conv3x3 (1+1) then pool; conv3x3 + conv5 (1+2 each side)
    assert [(s.top, s.bottom) for s in plan.segments] == [(1, 1), (3, 3)]

    def loss(p, x):
        return _weighted(spatial_apply(layers, p, x, mesh=mesh, axis_name="rows"))

    c = compiled_collectives(jax.grad(loss, (0, 1)), params, xs)
    assert c.counts["all-gather"] == 0 and c.counts["all-to-all"] == 0
    count, nbytes = plan.permutes(batch=2, itemsize=4)
    # (1+1) * 2*8*3*4 + (3+3) * 2*4*4*4 bytes per direction, forward and backward
    assert (count, nbytes) == (8, 2 * (2 * 2 * 8 * 3 * 4 + 6 * 2 * 4 * 4 * 4))
    assert c.counts["collective-permute"] == count
    assert c.bytes["collective-permute"] == nbytes
    # weight gradients: summed over the axis, nothing more than their own bytes
    pbytes = sum(v.size * 4 for v in jax.tree.leaves(params))
    assert c.bytes["all-reduce"] <= pbytes + 8
    # params only: the input's halos are not sent back
    cp = compiled_collectives(jax.grad(loss), params, xs)
    assert cp.counts["collective-permute"] == plan.permutes(2, 4, grad_input=False)[0] == 6
    assert cp.bytes["collective-permute"] == plan.permutes(2, 4, grad_input=False)[1]
    # forward only
    cf = compiled_collectives(lambda p, x: spatial_apply(layers, p, x, mesh=mesh,
                                                         axis_name="rows"), params, xs)
    assert (cf.counts["collective-permute"], cf.bytes["collective-permute"]) == \
        plan.permutes(2, 4, grad=False)
    assert cf.counts["all-gather"] == 0 and cf.counts["all-reduce"] == 0


def test_batch_and_height_mesh_bf16():
    layers = _same_stack()
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 8, 3))
    params = _params(layers, x.shape)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "space"))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "space")))

    def loss(p, x):
        return _weighted(spatial_apply(layers, p, x, mesh=mesh, axis_name="space",
                                       batch_axis="data", rows=2))

    g = jax.jit(jax.grad(loss))(params, xs)
    g0 = jax.jit(jax.grad(lambda p: _weighted(rc.apply(layers, p, x))))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    pb = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    xb = x.astype(jnp.bfloat16)
    yb = jax.jit(lambda p, x: spatial_apply(layers, p, x, mesh=mesh, axis_name="space",
                                            batch_axis="data"))(pb, xs.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb, np.float32),
                               np.asarray(jax.jit(lambda p, x: rc.apply(layers, p, x))(pb, xb),
                                          np.float32),
                               rtol=0.05, atol=0.05)


def test_bad_input_errors():
    layers = _same_stack()
    mesh = _mesh(8)
    x = jnp.ones((1, 40, 8, 3))
    params = _params(layers, (1, 64, 8, 3))
    with pytest.raises(ValueError, match=r"H=40.*devices=8.*8 x 2 = 16"):
        spatial_apply(layers, params, x, mesh=mesh, axis_name="rows")
    with pytest.raises(ValueError, match="axis_name='space' is not an axis"):
        spatial_apply(layers, params, jnp.ones((1, 64, 8, 3)), mesh=mesh, axis_name="space")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        spatial_apply(layers, params, jnp.ones((1, 64, 8, 3)), mesh="rows", axis_name="rows")
    with pytest.raises(ValueError, match="rows=9.*4 output rows"):
        spatial_apply(layers, params, jnp.ones((1, 64, 8, 3)), mesh=mesh, axis_name="rows",
                      rows=9)
    deep = [rc.Conv(2, 3) for _ in range(5)]
    with pytest.raises(ValueError, match="halos may only reach the neighbouring devices"):
        spatial_plan(deep, (1, 32, 4, 3), 8)
    with pytest.raises(ValueError, match="BatchNorm"):
        spatial_plan([rc.Conv(2, 3), rc.BatchNorm(2, use_running_average=False)],
                     (1, 32, 4, 3), 8)
