"""Tiled rowconv on XLA:GPU's plan for an H100 (compiled here without a GPU): no segment's
zero-initialised buffer is created at program start, and a segment's input cotangent is
written over its input instead of into a second map of the input's size."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem import rowconv as rc
from jaxmem.measure import compiled_memory, gpu_plan_available

pytestmark = pytest.mark.skipif(not gpu_plan_available(),
                                reason="needs the CUDA PJRT plugin for the H100 plan "
                                       "(docs/measuring.md)")
MIB = 2 ** 20
CFG = (8, "M", 16, "M", 32, "M", 64, "M")  # VGG-style, four segments cut at the pools


def _temp(mode, target, side=256, rows=16):
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape = (1, side, side, 3)
    params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    r = rc.segment_rows(layers, shape, rows, mode)

    def loss(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=r, mode=mode)))

    return compiled_memory(jax.grad(loss), params, x, target=target).temp_bytes


@pytest.mark.parametrize(("mode", "bound_mib"), [("overlap", 1.5), ("share", 2.4)])
def test_hybrid_trunk_temp_on_the_h100_plan(mode, bound_mib):
    """256x256 input, 16 tiles: temp 2.01 MiB (overlap) / 2.88 MiB (share) when the
    accumulators were zeros tied as a whole (XLA:GPU's scheduler still created them at
    program start) and each segment's input cotangent had its own buffer; 1.15 / 1.94 MiB
    with the tied scalar broadcast late and the cotangent written over the input."""
    temp = _temp(mode, "h100")
    assert temp <= bound_mib * MIB, f"{mode}: temp {temp / MIB:.3f} MiB > {bound_mib} MiB"


@pytest.mark.parametrize("mode", rc.MODES)
def test_input_cotangent_costs_no_second_map_on_the_h100_plan(mode):
    """Differentiating w.r.t. the image too adds the image's cotangent (an output) and
    nothing more: it is written over a copy of the (not donated) image that the tile loop
    carries, no zero-initialised accumulator beside it."""
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape = (1, 256, 256, 3)
    params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    r = rc.segment_rows(layers, shape, 16, mode)

    def loss(p, x):
        return jnp.sum(jnp.square(rc.apply(layers, p, x, rows=r, mode=mode)))

    only_p = compiled_memory(jax.grad(loss), params, x, target="h100")
    both = compiled_memory(jax.grad(loss, (0, 1)), params, x, target="h100")
    image = 256 * 256 * 3 * 4
    assert image <= both.output_bytes - only_p.output_bytes <= image + 256  # + tuple table
    assert both.total_bytes - only_p.total_bytes <= image + 64 * 1024


def test_plan_checks_the_tiling_on_the_target_it_is_given():
    """``rc.plan(..., target="h100")`` verifies its pick on XLA:GPU's plan, where this trunk
    compiles smaller than on XLA:CPU (256², 2 rows a segment: 5.08 MiB against 10.32): at a
    5.5 MiB budget the H100 plan takes 2 rows a segment, the CPU check needs 8."""
    layers = rc.trunks.vgg_layers(CFG, checkpoints_at_pools=True)
    shape, budget = (1, 256, 256, 3), int(5.5 * MIB)
    gpu = rc.plan(layers, shape, budget, target="h100")
    cpu = rc.plan(layers, shape, budget)
    assert (gpu.target, cpu.target) == ("h100", "cpu")
    assert gpu.compiled_bytes <= budget and cpu.compiled_bytes <= budget
    assert max(gpu.rows) < max(cpu.rows), (gpu.rows, cpu.rows)
    params = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)

    def step(p, x):
        return jax.grad(lambda p: jnp.mean(jnp.square(
            rc.apply(layers, p, x, rows=gpu.rows, mode=gpu.mode))))(p)

    assert compiled_memory(step, params, x, target="h100").total_bytes == gpu.compiled_bytes
