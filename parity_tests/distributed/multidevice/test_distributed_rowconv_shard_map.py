"""rowconv.apply inside a user's shard_map: batch sharded over 'data', parameters replicated.

A replicated parameter next to a per-device batch has a different varying-axes type than
the batch; the tiled segments and the conv rule must type their cotangents like their
primals (the parameter gradient is psum-ed, as plain JAX's shard_map does). Outputs and
gradients equal the untiled stack run on one device, for OverL, 2PS and hybrid trunks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmem import rowconv as rc


def _stack():
    """Two segments: dilated and strided convs | residual, frozen BatchNorm, max pool,
    VALID conv, avg pool."""
    return [rc.Conv(4, 3, kernel_dilation=(2, 1)), rc.Act(jax.nn.relu),
            rc.Conv(4, 3, strides=2), rc.Act(jnp.tanh), rc.Checkpoint(),
            rc.Residual([rc.Conv(4, 3), rc.Act(jax.nn.relu)]), rc.BatchNorm(4),
            rc.Pool("max", 2), rc.Conv(4, (3, 1), padding="VALID"), rc.Pool("avg", (1, 2))]


def _dropout_stack():
    return [rc.Conv(4, 3), rc.Dropout(0.25), rc.Checkpoint(), rc.Conv(4, 3),
            rc.Dropout(0.5), rc.Act(jnp.tanh)]


def _params(layers, shape, seed=0):
    # one compiled program rather than op by op
    return jax.jit(lambda: _make_params(layers, shape, seed))()


def _make_params(layers, shape, seed):
    p = rc.init(layers, jax.random.PRNGKey(seed), shape)
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.PRNGKey(seed + 7), len(leaves))
    # kernels get normal noise; vectors (bias, BatchNorm scale/mean/var) positive noise,
    # so that var stays positive
    return jax.tree.unflatten(tree, [
        v + (0.2 * jax.random.normal(k, v.shape) if v.ndim > 1
             else 0.3 * jax.random.uniform(k, v.shape)) for k, v in zip(keys, leaves)])


def _weighted(y):
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37))


def _close(a, b, rtol=1e-5, atol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _dp_case():
    layers = _stack()
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 32, 8, 3))
    return layers, _params(layers, x.shape), x


def _dp_sharded(layers, params, x, rows, mode, n):
    """(psum-ed loss, y, parameter gradient, x gradient) under shard_map over 'data'."""
    def local(p, x):
        def loss(p, x):
            y = rc.apply(layers, p, x, rows=rows, mode=mode)
            return _weighted(y), y
        (v, y), (gp, gx) = jax.value_and_grad(loss, (0, 1), has_aux=True)(p, x)
        return lax.psum(v, "data"), y, gp, gx

    return jax.jit(jax.shard_map(local, mesh=_mesh(n), in_specs=(P(), P("data")),
                                 out_specs=(P(), P("data"), P(), P("data"))))(params, x)


@pytest.fixture(scope="module")
def dp_reference():
    """The untiled stack on the whole batch on one device, and under the shard_map."""
    layers, params, x = _dp_case()
    n = 4

    def ref(p, x):  # _weighted per shard == per batch slice
        ys = [rc.apply(layers, p, xs) for xs in jnp.split(x, n)]
        return sum(_weighted(u) for u in ys), jnp.concatenate(ys)

    (v0, y0), (gp0, gx0) = jax.jit(jax.value_and_grad(ref, (0, 1), has_aux=True))(params, x)
    return n, (v0, y0, gp0, gx0), _dp_sharded(layers, params, x, 1, "overlap", n)


def _check_dp(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    _close(got[1], want[1], atol=1e-6)
    _close(got[3], want[3], atol=1e-6)
    _close(got[2], want[2])


def test_data_parallel_untiled_equals_single_device(dp_reference):
    """The untiled stack (rows=1, the conv rule alone) under shard_map(in_specs=(P(),
    P('data'))): the parameter gradient is psum-ed, as plain JAX ops give it."""
    _, single, untiled = dp_reference
    _check_dp(untiled, single)


@pytest.mark.parametrize("mode,rows", [("overlap", (4, 2)), ("share", (4, 3))])
def test_data_parallel_equals_single_device(dp_reference, mode, rows):
    """Tiled hybrid trunk under shard_map(in_specs=(P(), P('data'))): output, x-gradient
    and the (psum-ed) parameter gradient equal the untiled stack on one device."""
    n, single, _ = dp_reference
    layers, params, x = _dp_case()
    _check_dp(_dp_sharded(layers, params, x, list(rows), mode, n), single)


def test_unchecked_shard_map_gives_per_shard_grads():
    """check_vma=False: no cast, each shard returns its own partial parameter gradient,
    exactly as the untiled stack does under the same shard_map."""
    mode = "share"
    layers, n = _stack(), 2
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 8, 3))
    params = _params(layers, x.shape, seed=1)

    def local(p, x, r):
        gp, gx = jax.grad(lambda p, x: _weighted(rc.apply(layers, p, x, rows=r, mode=mode)),
                          (0, 1))(p, x)
        return jax.tree.map(lambda a: a[None], gp), gx

    def sharded(r):
        return jax.jit(jax.shard_map(lambda p, x: local(p, x, r), mesh=_mesh(n),
                                     in_specs=(P(), P("data")), out_specs=(P("data"), P("data")),
                                     check_vma=False))

    gp, gx = sharded(2)(params, x)
    gp1, gx1 = sharded(1)(params, x)
    _close((gp, gx), (gp1, gx1))
    grad_one = jax.jit(jax.grad(lambda p, xs: _weighted(rc.apply(layers, p, xs))))
    per_shard = [grad_one(params, xs) for xs in jnp.split(x, n)]
    for s in range(n):
        _close(jax.tree.map(lambda a, s=s: a[s], gp), per_shard[s])


def test_dropout_rows_bp_and_params_only():
    """Dropout with a replicated key, N_bp != N_fp (2PS runs one more forward pass in the
    backward), gradient w.r.t. parameters only (no input cotangent): equal to the untiled
    stack under the same shard_map."""
    mode = "share"
    layers, n = _dropout_stack(), 2
    x = jax.random.normal(jax.random.PRNGKey(4), (4, 16, 4, 3))
    params = _params(layers, x.shape, seed=2)
    key = jax.random.PRNGKey(11)

    def local(p, x, k, r, rbp):
        return jax.grad(lambda p: _weighted(rc.apply(layers, p, x, rows=r, rows_bp=rbp,
                                                     mode=mode, rng=k)))(p)

    def sharded(r, rbp):
        return jax.jit(jax.shard_map(lambda p, x, k: local(p, x, k, r, rbp), mesh=_mesh(n),
                                     in_specs=(P(), P("data"), P()), out_specs=P()))

    _close(sharded(4, 2)(params, x, key), sharded(1, None)(params, x, key))


def test_two_axis_mesh_and_per_device_key():
    """Mesh ('data', 'model'): x sharded over 'data' only, the dropout key folded with the
    'model' index (so the outputs vary over both axes): tiled == untiled, and the input
    gradient is summed over 'model' as the untiled stack's is."""
    layers = _dropout_stack()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    x = jax.random.normal(jax.random.PRNGKey(6), (4, 16, 4, 3))
    params = _params(layers, x.shape, seed=3)
    key = jax.random.PRNGKey(12)

    def local(p, x, r):
        k = jax.random.fold_in(key, lax.axis_index("model"))

        def loss(p, x):
            y = rc.apply(layers, p, x, rows=r, mode="overlap", rng=k)
            return lax.psum(_weighted(y), ("data", "model"))
        return jax.grad(loss, (0, 1))(p, x)

    def sharded(r):
        return jax.jit(jax.shard_map(lambda p, x: local(p, x, r), mesh=mesh,
                                     in_specs=(P(), P("data")), out_specs=(P(), P("data"))))

    _close(sharded([2, 4])(params, x), sharded(1)(params, x))
