"""The planner's promise, on random small models and budgets (hypothesis): a returned plan,
used every documented way, compiles within its budget and gives the untouched step's
gradients; a refusal's ``smallest_bytes`` is a budget the planner then meets."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from jaxmem.measure import compiled_memory
from jaxmem.planner import BudgetError, plan

ACTS = {"tanh": nn.tanh, "relu": nn.relu, "gelu": nn.gelu}


def _model(depth, width, batch, act, residual, seed):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(depth):
                y = ACTS[act](nn.Dense(width, name=f"d{i}")(x))
                x = x + y if residual else y
            return nn.Dense(1, name="head")(x)

    m = Net()
    x = jax.random.normal(jax.random.key(seed), (batch, width))
    params = jax.jit(m.init)(jax.random.key(seed + 1), x)
    return (lambda p, x: jnp.mean(m.apply(p, x) ** 2)), params, x, jax.random.normal(
        jax.random.key(seed + 2), (batch, width))


def _total(fn, *args):
    return compiled_memory(fn, *args).total_bytes


def _check_plan(p, loss, params, x, fresh):
    assert p.compiled_bytes <= p.budget_bytes
    assert _total(jax.value_and_grad(p.step), params, x) <= p.budget_bytes
    assert _total(jax.grad(p.step), params, x) <= p.budget_bytes
    if p.order is not None and p.order.applied:
        assert _total(p.value_and_grad(), params, x) <= p.budget_bytes
    v0, g0 = jax.jit(jax.value_and_grad(loss))(params, fresh)
    v1, g1 = jax.jit(jax.value_and_grad(p.step))(params, fresh)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(b))))


@settings(max_examples=2, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(depth=st.integers(2, 3), width=st.sampled_from([16, 32]),
       batch=st.sampled_from([32, 64]), act=st.sampled_from(sorted(ACTS)),
       residual=st.booleans(), fraction=st.floats(0.2, 1.0), seed=st.integers(0, 2**16))
# a budget of the whole default: XLA:CPU plans grad(step) above value_and_grad(step) here
@example(depth=2, width=16, batch=32, act="relu", residual=False, fraction=1.0, seed=0)
def test_plan_promise_on_random_models(depth, width, batch, act, residual, fraction, seed):
    loss, params, x, fresh = _model(depth, width, batch, act, residual, seed)
    kw = {"order": False, "max_iterations": 2, "time_limit": 2.0}
    try:
        p = plan(loss, params, x, budget=fraction, **kw)
    except BudgetError as e:
        assert e.smallest_bytes > int(fraction * _total(jax.value_and_grad(loss), params, x))
        p = plan(loss, params, x, budget=e.smallest_bytes, **kw)   # reachable
        assert p.budget_bytes == e.smallest_bytes
    _check_plan(p, loss, params, x, fresh)
