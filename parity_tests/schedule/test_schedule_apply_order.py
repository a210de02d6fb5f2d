"""``schedule.apply_order``: an order re-emitted under jit is kept only where it lowers the
compiled plan of the target asked for (here XLA:GPU's plan for an H100, compiled without a
GPU), never where that plan is as large or larger."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.schedule import apply_order, optimize, trace

TARGET = "h100"
pytestmark = pytest.mark.skipif(not gpu_plan_available(),
                                reason="needs the CUDA PJRT plugin for the H100 plan "
                                       "(docs/measuring.md)")


def _wide_step():
    """Eight full-size intermediates in program order; XLA fuses each into its reduction."""
    def step(x):
        ys = [jnp.tanh(x * (i + 1.0)) for i in range(8)]
        return sum(jnp.sum(y) for y in ys)

    return step, (jnp.ones((256, 256), jnp.float32),)


def _mlp_step():
    from jaxmem.bench.schedule import jax_step

    return jax_step("mlp", 1)


def test_order_that_compiles_larger_on_the_target_is_refused():
    step, args = _wide_step()
    ts = trace(step, *args)
    r = apply_order(step, ts.program_order, *args, traced=ts, chunks=(1, 16), target=TARGET)
    base = compiled_memory(step, *args, target=TARGET).total_bytes
    assert r.target == TARGET and r.baseline_bytes == base
    # the 16 barrier cuts keep the eight intermediates: larger than XLA:GPU's own plan
    assert r.candidates[16] > base
    assert not r.applied and r.fn is step and r.chunks is None
    assert r.compiled_bytes == base and r.reduction == 0.0
    assert "kept fn" in r.why
    out = r.fn(*args)
    assert jnp.allclose(out, step(*args))


def test_order_kept_only_when_it_lowers_the_target_plan():
    step, args = _mlp_step()
    donate = (0, 1, 2)
    ts = trace(step, *args, donate_argnums=donate)
    plan = optimize(ts.graph, time_limit=2, placement=False)
    r = apply_order(step, plan, *args, traced=ts, chunks=(1, 4, 16), target=TARGET,
                    donate_argnums=donate)
    base = compiled_memory(step, *args, donate_argnums=donate, target=TARGET).total_bytes
    assert r.baseline_bytes == base
    assert set(r.candidates) <= {1, 4, 16} and r.candidates
    assert r.compiled_bytes <= base
    if r.applied:
        assert r.compiled_bytes < base
        assert r.compiled_bytes == min(r.candidates.values()) == r.candidates[r.chunks]
        assert compiled_memory(r.fn, *args, donate_argnums=donate,
                               target=TARGET).total_bytes == r.compiled_bytes
        got = jax.tree_util.tree_leaves(r.fn(*jax.tree_util.tree_map(jnp.copy, args)))
        want = jax.tree_util.tree_leaves(jax.jit(step)(*jax.tree_util.tree_map(jnp.copy,
                                                                                args)))
        for a, b in zip(got, want):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert r.fn is step and min(r.candidates.values()) >= base


def test_apply_order_checks_its_arguments():
    step, args = _wide_step()
    ts = trace(step, *args)
    with pytest.raises(ValueError, match="chunks"):
        apply_order(step, ts.program_order, *args, traced=ts, chunks=0, target=TARGET)
    with pytest.raises(ValueError, match="target"):
        apply_order(step, ts.program_order, *args, traced=ts, target="tpu")
    with pytest.raises(TypeError, match="callable"):
        apply_order(None, ts.program_order, *args, traced=ts, target=TARGET)
