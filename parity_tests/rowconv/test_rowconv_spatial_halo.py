"""Halo arithmetic of spatial rowconv (height split over devices), on one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem import rowconv as rc
from jaxmem.rowconv.spatial import SpatialPlan, spatial_apply, spatial_local, spatial_plan

STACKS = {
    "same3x3x2": [rc.Conv(2, 3), rc.Conv(2, 3)],
    "stride2": [rc.Conv(2, 3, strides=2), rc.Conv(2, 3)],
    "pool_valid": [rc.Conv(2, 3), rc.Pool("avg", 2), rc.Conv(2, (3, 1), padding="VALID")],
    "dilated_asym": [rc.Conv(2, 3, kernel_dilation=2),
                     rc.Conv(2, (4, 3), padding=((2, 1), (1, 1)))],
    "residual": [rc.Conv(2, 1), rc.Residual([rc.Conv(2, 5), rc.Act(jax.nn.relu)],
                                            [rc.Conv(2, 3)]), rc.Pool("avg", 3, 1, "SAME")],
}


def test_same_convs_halo_is_one_row_per_conv_each_side():
    plan = spatial_plan([rc.Conv(2, 3)] * 3, (1, 64, 4, 3), 4)
    (s,) = plan.segments
    assert (s.local_in, s.local_out, s.offset, s.window, s.top, s.bottom) == (16, 16, -3, 22,
                                                                              3, 3)


def test_strided_conv_needs_only_bottom_rows():
    # 3x3 stride 2 'SAME' on an even height pads (0, 1): output row j reads rows 2j..2j+2
    plan = spatial_plan([rc.Conv(2, 3, strides=2)], (1, 32, 4, 3), 4)
    (s,) = plan.segments
    assert (s.stride, s.local_out, s.offset, s.window, s.top, s.bottom) == (2, 4, 0, 9, 0, 1)


def test_checkpoints_split_halos_per_segment():
    layers = [rc.Conv(2, 3), rc.Pool("max", 2), rc.Checkpoint(), rc.Conv(2, 5)]
    plan = spatial_plan(layers, (1, 64, 4, 3), 4)
    assert [(s.start, s.stop, s.top, s.bottom, s.local_in) for s in plan.segments] == \
        [(0, 2, 1, 1, 16), (3, 4, 2, 2, 8)]
    assert plan.out_rows == 8 and plan.out_shape == (1, 32, 2, 2)


@pytest.mark.parametrize("name", sorted(STACKS))
def test_window_is_exactly_the_rows_a_device_block_depends_on(name):
    """Brute force: the input rows whose gradient reaches device d's output block."""
    layers, n, d = STACKS[name], 4, 1
    shape = (1, 64, 6, 2)
    plan = spatial_plan(layers, shape, n)
    (s,) = plan.segments
    params = jax.tree.map(lambda a: jnp.asarray(np.ones(a.shape, a.dtype)),
                          jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape)))
    x = jnp.asarray(np.ones(shape, np.float32))

    def block(x):
        y = rc.apply(layers, params, x)
        return jnp.sum(y[:, d * s.local_out:(d + 1) * s.local_out])

    # all-ones parameters and input: every path's contribution is positive, so a row's
    # gradient is nonzero exactly where it is reached
    hit = np.nonzero(np.abs(np.asarray(jax.jit(jax.grad(block))(x))).sum(axis=(0, 2, 3)))[0]
    lo, hi = d * s.local_in + s.offset, d * s.local_in + s.offset + s.window
    assert (hit.min(), hit.max() + 1) == (max(lo, 0), min(hi, shape[1]))
    assert s.top == max(0, -s.offset) and s.bottom == max(0, s.offset + s.window - s.local_in)


def test_permute_count_and_bytes_formula():
    layers = [rc.Conv(2, 3), rc.Pool("max", 2), rc.Checkpoint(), rc.Conv(2, 3, strides=2)]
    plan = spatial_plan(layers, (2, 64, 4, 3), 4)
    assert [(s.top, s.bottom) for s in plan.segments] == [(1, 1), (0, 1)]
    b0, b1 = 2 * 2 * 4 * 3 * 4, 1 * 2 * 2 * 2 * 4  # (top+bottom)*B*W*C*4
    assert plan.permutes(2) == (2 * (2 + 1), 2 * (b0 + b1))
    assert plan.permutes(2, grad=False) == (3, b0 + b1)
    assert plan.permutes(2, grad_input=False) == (2 + 1 + 1, b0 + 2 * b1)
    assert plan.permutes(2, itemsize=2, grad=False) == (3, (b0 + b1) // 2)


def test_errors_name_height_devices_and_stride_product():
    layers = [rc.Conv(2, 3, strides=2), rc.Pool("max", 2)]
    with pytest.raises(ValueError, match=r"H=48.*devices=8.*8 x 4 = 32"):
        spatial_plan(layers, (1, 48, 4, 3), 8)
    with pytest.raises(ValueError, match="devices must be an int >= 1"):
        spatial_plan(layers, (1, 64, 4, 3), 0)
    with pytest.raises(ValueError, match="devices must be an int >= 1"):
        spatial_plan(layers, (1, 64, 4, 3), True)
    with pytest.raises(ValueError, match="halos may only reach"):
        spatial_plan([rc.Conv(2, 7)], (1, 16, 4, 3), 8)
    with pytest.raises(ValueError, match="exceeds devices x rows per device"):
        spatial_plan([rc.Conv(2, 3, padding=2)], (1, 16, 4, 3), 2)
    with pytest.raises(ValueError, match="train-mode BatchNorm"):
        spatial_plan([rc.BatchNorm(3, use_running_average=False)], (1, 16, 4, 3), 2)
    with pytest.raises(TypeError, match="unsupported layer"):
        spatial_plan([object()], (1, 16, 4, 3), 2)


def test_one_device_mesh_equals_untiled_and_local_checks():
    layers = [rc.Conv(3, 3), rc.Act(jax.nn.relu), rc.Pool("max", 2), rc.Checkpoint(),
              rc.Conv(3, 3, padding="VALID"), rc.Affine(3)]
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 8, 3))
    params = rc.init(layers, jax.random.PRNGKey(1), x.shape)
    params = jax.tree.map(lambda v: v + 0.1, params)
    mesh = Mesh(np.array(jax.devices()[:1]), ("space",))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "space")))

    def loss(f):
        return lambda p, x: jnp.sum(jnp.sin(f(p, x)))

    sp = lambda p, x: spatial_apply(layers, p, x, mesh=mesh, axis_name="space", rows=[4, 2])
    g = jax.jit(jax.grad(loss(sp), (0, 1)))(params, xs)
    g0 = jax.jit(jax.grad(loss(lambda p, x: rc.apply(layers, p, x)), (0, 1)))(params, x)
    assert_tree_close(g, g0, rtol=1e-5, atol=1e-6)
    assert jax.eval_shape(sp, params, xs).shape == (2, 14, 2, 3)
    gc = jax.jit(jax.grad(jax.checkpoint(loss(sp))))(params, xs)  # recomputed under remat
    assert_tree_close(gc, g0[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not height=64"):
        jax.shard_map(lambda p, x: spatial_local(layers, p, x, axis_name="space", height=64),
                      mesh=mesh, in_specs=(P(), P(None, "space")),
                      out_specs=P(None, "space"))(params, xs)
    with pytest.raises(ValueError, match="batch_axis='data' must be another axis"):
        sp2 = spatial_apply(layers, params, xs, mesh=mesh, axis_name="space", batch_axis="data")
        del sp2
    assert isinstance(spatial_plan(layers, x.shape, 1), SpatialPlan)
