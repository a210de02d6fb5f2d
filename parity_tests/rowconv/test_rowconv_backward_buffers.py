"""Tiled rowconv: zero-initialised buffers exist only while they are used.

A constant ``zeros`` buffer has no operands, so XLA may create it at the start of the
program: every segment's forward output buffer and backward accumulators would then be
live during the first segment's forward pass. ``rowconv.apply`` builds them from the
segment input (forward) or the incoming cotangent (backward) with
``jaxmem._prims.ties.zeros_after``, which must stay an exact ``+0`` for every cotangent
value (NaN and inf included), so gradients are unchanged.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close

from jaxmem import rowconv as rc
from jaxmem._prims.ties import zeros_after

MIB = 2 ** 20

# VGG-style hybrid trunk: four segments cut at the pools, 128x128x3 input, 16 row tiles.
CFG = (8, "M", 16, "M", 32, "M", 64, "M")


@pytest.mark.parametrize(("mode", "bound_mib"), [("overlap", 0.53), ("share", 0.89)])
def test_hybrid_trunk_temp_without_buffers_held_from_program_start(mode, bound_mib):
    """Compiled ``temp`` of the grad step: 0.599 MiB (overlap) / 1.005 MiB (share) when
    the zeros buffers of all segments are created at program start, 0.462 / 0.778 MiB
    when each is made from its segment's input or cotangent. Bounds sit in between."""
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape = (1, 128, 128, 3)
    # compiled, never run: abstract arguments
    params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    rows = rc.segment_rows(layers, shape, 16, mode)

    def loss(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=rows, mode=mode)))

    temp = jax.jit(jax.grad(loss)).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp <= bound_mib * MIB, f"{mode}: temp {temp / MIB:.3f} MiB > {bound_mib} MiB"


def test_zeros_after_is_exact_positive_zero_for_any_dependency():
    bad = jnp.array([[jnp.nan, jnp.inf], [-jnp.inf, -0.0]], jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for after in (bad, bad[::-1], bad[:, ::-1], jnp.ones((2, 2)), jnp.arange(4)):
            z = jax.jit(lambda a, dtype=dtype: zeros_after((3, 4), dtype, a))(after)
            assert z.dtype == dtype and z.shape == (3, 4)
            z32 = np.asarray(z, np.float32)
            np.testing.assert_array_equal(z32, 0.0)
            assert not np.signbit(z32).any()
    assert zeros_after((2,), jnp.float32, jnp.zeros((0, 3))).shape == (2,)
    assert zeros_after((2,), jnp.float32, jnp.float32(jnp.nan)).tolist() == [0.0, 0.0]
    zv = jax.vmap(lambda a: zeros_after((2,), jnp.float32, a))(bad)
    np.testing.assert_array_equal(np.asarray(zv), 0.0)


@pytest.mark.xla_cpu
@pytest.mark.parametrize("mode", ["overlap", "share"])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_gradients_equal_untiled_for_nonfinite_cotangent(mode, bad):
    """A NaN/inf first cotangent element poisons exactly the gradients it reaches in the
    untiled stack, and the same ones tiled (the accumulators start at an exact zero).

    Where a NaN reaches is a property of one compilation, not of the math (``NaN * 0`` vs a
    select): the untiled stack jitted and run eagerly already differ on XLA:CPU (42 vs 54 NaN
    entries in the first kernel's gradient here), and XLA:GPU places them differently again.
    So this pins XLA:CPU's compilation (``xla_cpu``) on every machine."""
    layers = [rc.Conv(4, 3, padding=((1, 1), (1, 1))), rc.Act(jax.nn.relu), rc.Checkpoint(),
              rc.Conv(3, 3, padding=((1, 1), (1, 1)))]
    shape = (1, 16, 6, 2)
    params = rc.init(layers, jax.random.PRNGKey(2), shape)
    x = jax.random.normal(jax.random.PRNGKey(3), shape)
    g = jax.random.normal(jax.random.PRNGKey(4), (1, 16, 6, 3)).at[0, 0, 0, 0].set(bad)

    def vjp(rows):
        _, f = jax.vjp(lambda p, x: rc.apply(layers, p, x, rows=rows, mode=mode), params, x)
        return f(g)

    want, got = vjp(1), jax.jit(lambda: vjp(4))()
    # NaN and inf entries at the same places, the finite ones close
    assert_tree_close(want, got, rtol=1e-5, atol=1e-5)
    dx = np.asarray(got[1])
    assert np.isfinite(dx[:, 4:]).all()  # rows beyond the receptive field stay finite
