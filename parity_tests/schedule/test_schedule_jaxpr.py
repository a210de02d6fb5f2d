"""jaxmem.schedule.trace (jaxpr -> Graph) and the executor that realises a plan."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assert import assert_tree_close

from jaxmem.schedule import Scheduled, execute, optimize, simulate, trace, validate_plan
from jaxmem.schedule.jaxpr_graph import UnsupportedPrimitiveError


def _ops(ts):
    return [n.split(":")[2] for n in ts.graph.nodes if n.startswith("op:")]


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(bool(jnp.array_equal(x, y)) for x, y in zip(la, lb))


def _rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


# --------------------------------------------------------------------------- sizes, views
def test_sizes_from_avals_and_persistent_inputs():
    def f(x, w):
        h = jnp.tanh(x @ w)  # 4x16 f32 = 256 B
        return jnp.sum(h.astype(jnp.bfloat16))  # 4x16 bf16 = 128 B

    x, w = _rand(0, (4, 8)), _rand(1, (8, 16))
    ts = trace(f, x, w)
    g = ts.graph
    assert g.persistent_bytes() == x.nbytes + w.nbytes
    sizes = sorted(e.size for e in g.edges.values() if not e.persistent and e.size)
    assert 256 in sizes and 128 in sizes
    assert sizes[0] == 2  # the bf16 scalar output
    # donated inputs are not persistent: they live from the start until their last use
    ts2 = trace(f, x, w, donate_argnums=0)
    assert ts2.graph.persistent_bytes() == w.nbytes
    with pytest.raises(ValueError, match="donate_argnums"):
        trace(f, x, w, donate_argnums=5)


def test_views_cost_nothing_and_extend_the_buffer_lifetime():
    def f(x):
        y = jnp.sin(x)  # 64 floats
        z = y.reshape(8, 8)  # view of y
        a = jnp.cos(x)
        return jnp.sum(z @ z) + jnp.sum(a)

    x = _rand(2, (64,))
    ts = trace(f, x)
    assert "reshape" not in _ops(ts)
    # the sin output is read by the matmul (through the view)
    sin_node = next(n for n in ts.graph.nodes if n.endswith(":sin"))
    (edge,) = ts.graph.fanout(sin_node)
    readers = ts.graph.edges[edge].sinks
    assert any(r.endswith("dot_general") for r in readers)
    ts_copy = trace(f, x, alias_views=False)
    assert "reshape" in _ops(ts_copy)
    # results are identical either way
    ref = f(x)
    for t in (ts, ts_copy):
        out = execute(t, optimize(t.graph, time_limit=1), x)
        np.testing.assert_allclose(out, ref, rtol=1e-6)


# --------------------------------------------------------------------------- nested jaxprs
def test_nested_jit_custom_vjp_custom_jvp_and_remat_are_inlined():
    @jax.custom_vjp
    def cube(x):
        return x * x * x

    cube.defvjp(lambda x: (cube(x), x), lambda x, g: (3 * x * x * g,))

    @jax.jit
    def inner(x):
        return jnp.exp(x) + 1.0

    @jax.checkpoint
    def block(x):
        return jnp.sin(inner(x)) * 2.0

    def loss(x):
        return jnp.sum(cube(jax.nn.relu(block(x))))  # relu is a custom_jvp

    def step(x):
        return jax.value_and_grad(loss)(x)

    x = _rand(3, (5, 7))
    ts = trace(step, x)
    ops = _ops(ts)
    for nested in ("jit", "pjit", "custom_vjp_call", "custom_jvp_call", "checkpoint", "remat"):
        assert nested not in ops, ops
    assert "exp" in ops and "sin" in ops and "mul" in ops
    plan = optimize(ts.graph, time_limit=1)
    validate_plan(ts.graph, plan)
    out = execute(ts, plan, x)
    ref = jax.jit(step)(x)
    assert_tree_close(out, ref, rtol=1e-5, atol=1e-6)
    with jax.disable_jit():
        assert _leaves_equal(out, step(x))


def test_control_flow_is_opaque_or_refused():
    def f(x):
        def body(c, xi):
            return c + jnp.sin(xi), c * 2

        c, ys = jax.lax.scan(body, jnp.zeros(3), x)
        z = jax.lax.cond(c.sum() > 0, lambda v: v * 2, lambda v: v - 1, ys)
        w = jax.lax.while_loop(lambda v: v.sum() < 100.0, lambda v: v + 1.0, z)
        return w.sum() + c.sum()

    x = _rand(4, (6, 3))
    ts = trace(f, x)
    ops = _ops(ts)
    assert "scan" in ops and "cond" in ops and "while" in ops
    out = execute(ts, optimize(ts.graph, time_limit=1), x)
    np.testing.assert_allclose(out, f(x), rtol=1e-6)
    with pytest.raises(UnsupportedPrimitiveError, match="control_flow"):
        trace(f, x, control_flow="error")
    with pytest.raises(ValueError, match="control_flow"):
        trace(f, x, control_flow="inline")


def test_unsupported_primitives_raise():
    def f(x):
        jax.debug.print("x={x}", x=x)
        return x * 2

    with pytest.raises(UnsupportedPrimitiveError):
        trace(f, jnp.ones(3))

    def g(x):
        return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((3,), jnp.float32), x)

    with pytest.raises(UnsupportedPrimitiveError, match="pure_callback"):
        trace(g, jnp.ones(3))
    with pytest.raises(TypeError, match="fn"):
        trace(3, jnp.ones(3))


def test_dead_code_is_dropped():
    def f(x):
        _unused = jnp.exp(x) * 3
        return jnp.sin(x)

    ts = trace(f, jnp.ones(4))
    assert _ops(ts) == ["sin"]


# --------------------------------------------------------------------------- training steps
def _mlp_step():
    from jaxmem.models import MLP

    model = MLP(features=(32, 10))
    x = _rand(5, (4, 16))
    y = jax.random.randint(jax.random.key(6), (4,), 0, 10)
    # inits compiled as one program each (the step below is what runs op by op)
    params = jax.jit(model.init)(jax.random.key(7), x)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
    opt = jax.jit(tx.init)(params)

    def step(params, opt, x, y):
        def loss(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        l, g = jax.value_and_grad(loss)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, l

    return step, (params, opt, x, y)


def _convchain_step():
    from jaxmem.models import ConvChain

    model = ConvChain(depth=3, channels=4)
    x = _rand(8, (2, 8, 8, 4))
    params = jax.jit(model.init)(jax.random.key(9), x)
    tx = optax.sgd(0.1, momentum=0.9)
    opt = jax.jit(tx.init)(params)

    def step(params, opt, x):
        l, g = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, l

    return step, (params, opt, x)


@pytest.mark.parametrize("make", [_mlp_step, _convchain_step], ids=["mlp_clip_momentum", "convchain_sgd"])
def test_executor_reproduces_training_step(make):
    step, args = make()
    ts = trace(step, *args)
    plan = optimize(ts.graph, time_limit=1, placement=True)
    validate_plan(ts.graph, plan)
    assert plan.peak <= plan.baseline_peak  # never worse than program order
    out, stats = execute(ts, plan, *args, measure=True)
    # identical to the un-jitted step (same primitives, same values)
    with jax.disable_jit():
        ref = step(*args)
    assert _leaves_equal(out, ref)
    # close to the jitted step (XLA fuses, so rounding may differ in the last bits)
    ref_jit = jax.jit(step)(*args)
    assert_tree_close(out, ref_jit, rtol=1e-5, atol=1e-6)
    # measured live buffers match the plan's resident-set prediction
    assert stats.predicted_peak == plan.peak
    assert abs(stats.peak_live_bytes - plan.peak) <= 0.05 * plan.peak
    # and program order measures as its simulation
    _, st0 = execute(ts, None, *args, measure=True)
    assert st0.predicted_peak == simulate(ts.graph)
    assert abs(st0.peak_live_bytes - st0.predicted_peak) <= 0.05 * st0.predicted_peak


def test_scheduled_wrapper_under_bad_args():
    step, args = _convchain_step()
    sched = Scheduled(step, time_limit=1)
    out = sched(*args)
    with jax.disable_jit():
        assert _leaves_equal(out, step(*args))
    assert sched.plan is not None and sched.traced is not None
    with pytest.raises(ValueError, match="args"):
        execute(sched.traced, sched.plan, args[0], args[1], args[2][:1])
    with pytest.raises(ValueError, match="order"):
        execute(sched.traced, ["in:0"], *args)


def test_traced_function_can_be_scheduled_inside_jit_world():
    # scheduling is a host-side, eager transformation; inputs may come from jitted code
    step, args = _convchain_step()
    args = jax.jit(lambda *a: a)(*args)
    ts = trace(functools.partial(step), *args)
    out = execute(ts, optimize(ts.graph, time_limit=1), *args)
    with jax.disable_jit():
        assert _leaves_equal(out, step(*args))


@pytest.mark.parametrize("chunks", [1, 4])
def test_as_function_reemits_the_plan_under_jit(chunks):
    from jaxmem.schedule.xla import as_function

    step, args = _convchain_step()
    ts = trace(step, *args, donate_argnums=(0, 1))
    plan = optimize(ts.graph, time_limit=1)
    fn = jax.jit(as_function(ts, plan.order, chunks=chunks))
    flat = jax.tree_util.tree_leaves(args)
    out = fn(*flat)
    ref = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    assert len(out) == len(ref)
    assert_tree_close(out, ref, rtol=1e-5, atol=1e-6)
    if chunks > 1:
        text = jax.jit(as_function(ts, plan.order, chunks=chunks)).lower(*flat).as_text()
        assert "optimization_barrier" in text
    with pytest.raises(ValueError, match="chunks"):
        as_function(ts, plan.order, chunks=0)


def test_donated_buffers_are_freed_and_measured_peak_matches_plan():
    step, args = _mlp_step()
    ts = trace(step, *args, donate_argnums=(0, 1))
    plan = optimize(ts.graph, time_limit=1)
    with jax.disable_jit():
        ref = step(*args)
    fresh = jax.tree_util.tree_map(lambda a: a.copy(), args)
    out, stats = execute(ts, plan, *fresh, measure=True)
    assert _leaves_equal(out, ref)
    assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(fresh[0]))
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(fresh[2:]))
    assert abs(stats.peak_live_bytes - plan.peak) <= 0.05 * plan.peak
    # donation lets the optimiser run weight updates early: below the program order
    assert plan.peak < plan.baseline_peak
