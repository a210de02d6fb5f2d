"""jaxmem.planner.plan: exact gradients, budgets met in compiled bytes, clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import models
from jaxmem.planner import BudgetError, MemoryPlan, parse_budget, plan
from jaxmem.planner import solve as S
from jaxmem.planner import trace as T


def _gpt(n_layer=2, d_model=32, ctx=32, batch=8):
    m = models.gpt(n_layer=n_layer, d_model=d_model, ctx=ctx)
    tok = jax.random.randint(jax.random.key(0), (batch, ctx), 0, 256)
    params = jax.jit(m.init)(jax.random.key(1), tok)["params"]

    def loss(p, t):
        lg = m.apply({"params": p}, t)
        return -jnp.mean(jax.nn.log_softmax(lg)[..., 0])

    return loss, params, tok


@pytest.fixture(scope="module")
def gpt_half():
    # one block: its plan still recomputes units (segments and a recomputed MLP) to half the
    # default, in fewer compiles than two blocks
    loss, params, tok = _gpt(n_layer=1)
    return loss, params, tok, plan(loss, params, tok, budget=0.5)


def _max_rel(a, b):
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_plan_gpt_half_budget_met_and_gradients_exact(gpt_half):
    loss, params, tok, p = gpt_half
    assert isinstance(p, MemoryPlan)
    assert p.compiled_bytes <= p.budget_bytes == int(0.5 * p.default_bytes)
    assert any(c.option != "store" for c in p.choices)
    d = p.to_dict()
    assert d["compiled_bytes"] == p.compiled_bytes and len(d["choices"]) == len(p.choices)
    # the returned step compiles to the reported bytes and gives the untouched gradients
    compiled = jax.jit(jax.value_and_grad(p.step)).lower(params, tok).compile()
    m = compiled.memory_analysis()
    assert (m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
            - m.alias_size_in_bytes) == p.compiled_bytes
    tok2 = jax.random.randint(jax.random.key(7), tok.shape, 0, 256)   # fresh input
    v0, g0 = jax.jit(jax.value_and_grad(loss))(params, tok2)
    v1, g1 = compiled(params, tok2)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    assert _max_rel(g0, g1) < 1e-5


def test_plan_every_option_exact_float64():
    """Every unit recomputed, or with dots kept: gradients equal the untouched loss's (f64)."""
    with jax.enable_x64(True):
        loss, params, tok = _gpt(n_layer=1, d_model=16, ctx=8, batch=2)
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
        tr = T.trace(loss, (params, tok))
        units = T.choose_units(tr)
        labels = [u.label for u in units]
        assert labels[:2] == ["wte", "wpe"] and any(lb.startswith("h_0") for lb in labels)
        opts = ("dots", "recompute")

        def f(p, t, opt):
            flat = jax.tree_util.tree_leaves((p, t))
            return T.run_chunks(tr.closed, units, {u.label: opt for u in units}, flat)[0]

        # the untouched gradients and those of each option, in one compiled program
        g0, *gs = jax.jit(lambda p, t: [jax.grad(loss)(p, t)] + [
            jax.grad(f)(p, t, opt) for opt in opts])(params, tok)
        for opt, g1 in zip(opts, gs):
            assert _max_rel(g0, g1) < 1e-12, opt


def test_plan_prices_the_conversions_own_recomputation(gpt_half):
    # GPT's converted attention keeps its input, not q, k, v: its backward runs the q, k, v
    # projection again, 2 * tokens * d * 3d FLOPs per layer at least (the other recomputed
    # work comes on top), out of a step of about 3x the loss's forward FLOPs
    loss, params, tok, p = gpt_half
    assert p.selective
    fwd = T.flops_of(jax.make_jaxpr(loss)(params, tok).jaxpr)[0]
    d, three_d = params["h_0"]["attn"]["c_attn"]["kernel"].shape
    qkv = 2.0 * tok.size * d * three_d
    assert qkv / (3.0 * fwd) <= p.conversion_time < 0.5, (p.conversion_time, qkv / (3 * fwd))
    assert p.predicted_time_total == pytest.approx(p.predicted_time + p.conversion_time)
    assert p.to_dict()["conversion_time"] == p.conversion_time
    assert f"{p.conversion_time:+.2f} conversion" in str(p)
    assert any(n.startswith("conversion_time") for n in p.notes)


def test_flops_of_merges_repeated_equations_only_when_asked():
    # x @ w three times over the same inputs is one computation after XLA's CSE, and so is
    # tanh of the repeats; x @ v is another computation
    x, w, v = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((8, 16))

    def f(x, w, v):
        return jnp.tanh(x @ w) + jnp.tanh(x @ w) + (x @ w) * (x @ v)

    jx = jax.make_jaxpr(f)(x, w, v).jaxpr
    dot, elt = 2.0 * 4 * 8 * 16, 4.0 * 16
    # two tanh, two adds, one product; merged: one tanh
    assert T.flops_of(jx) == (pytest.approx(4 * dot + 5 * elt), pytest.approx(4 * dot))
    assert T.flops_of(jx, merge_identical=True) == (pytest.approx(2 * dot + 4 * elt),
                                                    pytest.approx(2 * dot))


def test_flops_of_a_strided_convolutions_input_gradient_counts_the_taps_that_meet_data():
    # the input gradient of a stride-2 convolution is a convolution over the cotangent
    # dilated by 2: one tap in four meets a nonzero, the forward's multiply-adds once more
    x = jnp.ones((2, 16, 16, 8))
    w = jnp.ones((3, 3, 8, 4))

    def conv(x):
        return jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    y, vjp = jax.vjp(conv, x)
    fwd = T.flops_of(jax.make_jaxpr(conv)(x).jaxpr)[1]
    dx = T.flops_of(jax.make_jaxpr(vjp)(y).jaxpr)[1]
    assert fwd == 2.0 * y.size * 3 * 3 * 8
    assert dx == pytest.approx(fwd)


def test_plan_prediction_error_reported(gpt_half):
    # the calibrated prediction, made before the plan was compiled
    assert abs(gpt_half[3].prediction_error) < 0.25


def test_plan_bad_budget_values():
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\]"):
        parse_budget(1.5, 100)
    with pytest.raises(ValueError, match="not a size"):
        parse_budget("12 parsecs")
    with pytest.raises(TypeError, match="budget"):
        parse_budget([1])
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget(0.25, 1000) == 250
    with pytest.raises(TypeError, match="step must be callable"):
        plan(3, 1.0, budget=10)


def test_plan_solver_deterministic_and_optimal():
    keep = [[8, 4, 1], [8, 4, 1], [16, 6, 2]]
    work = [[0, 4, 7], [0, 4, 7], [0, 10, 14]]
    cost = [[0, 1, 10], [0, 1, 10], [0, 2, 20]]
    sols = [S.solve([[k * 1024 for k in r] for r in keep], [[w * 1024 for w in r] for r in work],
                    cost, 0, 30 * 1024) for _ in range(3)]
    assert len({s.choice for s in sols}) == 1 and sols[0].status == "OPTIMAL"
    # brute force
    import itertools
    best = min((sum(cost[u][o] for u, o in enumerate(c)), c)
               for c in itertools.product(range(3), repeat=3)
               if sum(keep[u][o] for u, o in enumerate(c))
               + max(work[u][o] for u, o in enumerate(c)) <= 30)
    assert sols[0].objective == best[0]


def _deep_mlp(depth=12, width=128, batch=512):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(depth):
                x = nn.tanh(nn.Dense(width, name=f"d{i}")(x))
            return nn.Dense(1, name="head")(x)

    m = Net()
    x = jax.random.normal(jax.random.key(0), (batch, width))
    params = jax.jit(m.init)(jax.random.key(1), x)
    return (lambda p, x: jnp.mean(m.apply(p, x) ** 2)), params, x


def _uniform_bytes(loss, params, x, opt):
    from jaxmem.measure import compiled_memory
    tr = T.trace(loss, (params, x))
    units = T.choose_units(tr)

    def f(p, x):
        return T.run_chunks(tr.closed, units, {u.label: opt for u in units},
                            jax.tree_util.tree_leaves((p, x)))[0]
    return compiled_memory(jax.value_and_grad(f), params, x).total_bytes


@pytest.fixture(scope="module")
def mlp():
    return _deep_mlp(depth=6, width=64, batch=256)


@pytest.fixture(scope="module")
def mlp_segments(mlp):
    loss, params, x = mlp
    # the CPU device's plan also where a GPU is JAX's default (the test using it is xla_cpu;
    # a module fixture is set up before the xla_cpu marker's device context)
    with jax.default_device(jax.devices("cpu")[0]):
        return plan(loss, params, x, budget=0.85, order=False)


@pytest.mark.xla_cpu   # XLA:GPU plans uniform "dots" below this budget (real H200, jax 0.11.2)
def test_plan_budget_below_every_per_unit_option_met_by_segments(mlp, mlp_segments):
    """A deep tanh MLP: recomputing units one by one keeps every unit's input and compiles to
    more than the default; a budget between the least reachable plan and the default (below
    every uniform per-unit option) is met by recomputing segments of units, exactly."""
    loss, params, x = mlp
    p = mlp_segments
    assert p.compiled_bytes <= p.budget_bytes < p.default_bytes
    for opt in ("dots", "recompute"):
        assert _uniform_bytes(loss, params, x, opt) > p.budget_bytes, opt
    assert any(c.option == "segment" and ".." in c.label for c in p.choices)
    assert abs(p.prediction_error) < 0.10
    # where its bytes go: the temporaries live at its peak fit within what it compiles to
    peak = p.live_peak(params, x)
    assert 0 < peak.live_bytes <= peak.temp_bytes < p.compiled_bytes
    x2 = jax.random.normal(jax.random.key(9), x.shape)
    v0, g0 = jax.jit(jax.value_and_grad(loss))(params, x2)
    v1, g1 = jax.jit(jax.value_and_grad(p.step))(params, x2)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    assert _max_rel(g0, g1) < 1e-5


def test_plan_refused_below_arguments_reports_reached_smallest():
    # a small MLP (few units: the planner compiles few plans before it refuses)
    loss, params, x = _deep_mlp(depth=2, width=32, batch=64)
    with pytest.raises(BudgetError, match=r"cannot be met.*arguments \(parameters.*before any "
                                          r"activation is kept") as e:
        plan(loss, params, x, budget=4096)
    floor = sum(e.value.dominant[k] for k in ("arguments (parameters, batch, state)",
                                              "outputs (loss, gradients)"))
    assert e.value.smallest_bytes > floor   # a compiled plan, above the lower bound
    # what is live at that plan's peak: its temporaries, within the smallest total reached
    assert "smallest_peak()" in str(e.value)
    peak = e.value.smallest_peak()
    assert 0 < peak.live_bytes <= peak.temp_bytes <= e.value.smallest_bytes - floor
    assert peak.buffers and peak.buffers[0].bytes <= peak.live_bytes
    assert e.value.smallest_peak() is peak   # read once


def test_plan_bad_options():
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    with pytest.raises(ValueError, match="fence_cost must be a number >= 0, got -1"):
        plan(loss, w, x, budget=0.5, fence_cost=-1)
    with pytest.raises(ValueError, match="max_iterations must be an int >= 1, got 0"):
        plan(loss, w, x, budget=0.5, max_iterations=0)


def _mlp_batches(width=32, depth=4):
    loss, params, _ = _deep_mlp(depth=depth, width=width, batch=8)

    def make(b):
        return params, jax.random.normal(jax.random.key(b), (b, width))

    return loss, make


def test_max_batch_default_largest_within_budget_and_planned_at_least_default():
    """The default batch is the largest whose untouched step compiles within the budget; the
    planned batch is at least that (its plan compiles to the reported bytes)."""
    import jaxmem
    from jaxmem.measure import compiled_memory
    from jaxmem.planner import max_batch
    assert jaxmem.plan.max_batch is max_batch
    loss, make = _mlp_batches()
    budget = 64 * 2**10
    fit = max_batch(loss, make, budget, limit=48, max_iterations=1, order=False,
                    time_limit=1.0)
    assert 0 < fit.default_batch < 48 and fit.default_bytes <= budget
    nxt = [compiled_memory(fn, *make(fit.default_batch + 1)).total_bytes
           for fn in (jax.value_and_grad(loss), jax.grad(loss))]
    assert max(nxt) > budget
    assert fit.default_batch <= fit.planned_batch
    assert fit.planned_bytes <= budget and fit.plan.compiled_bytes == fit.planned_bytes
    assert fit.plan.step(*make(fit.planned_batch)).shape == ()
    with pytest.raises(TypeError, match="fraction 0.5"):
        max_batch(loss, make, 0.5)
    with pytest.raises(TypeError, match="make_args must be callable"):
        max_batch(loss, 3, budget)


def test_max_batch_default_holds_the_plans_promise():
    """A 2-layer MLP whose ``jax.grad`` compiles to more bytes than its ``value_and_grad``:
    the default batch is the largest whose untouched step fits as both (the promise a plan
    makes), so the plan of that batch is the step itself: the planned search, which starts
    there, never ends below it."""
    from jaxmem.measure import compiled_memory
    from jaxmem.planner import max_batch
    loss, make = _mlp_batches(depth=2)
    budget = 40 * 2**10
    fit = max_batch(loss, make, budget, limit=64, planned=False)
    b = fit.default_batch
    both = [compiled_memory(fn, *make(b)).total_bytes
            for fn in (jax.value_and_grad(loss), jax.grad(loss))]
    assert 0 < b < 64 and max(both) == fit.default_bytes <= budget
    nxt = [compiled_memory(fn, *make(b + 1)).total_bytes
           for fn in (jax.value_and_grad(loss), jax.grad(loss))]
    assert max(nxt) > budget
    assert plan(loss, *make(b), budget=budget, order=False).step is loss


def test_max_batch_docstring_example():
    import doctest

    from jaxmem.planner import batch
    r = doctest.testmod(batch, optionflags=doctest.ELLIPSIS)
    assert r.attempted > 0 and r.failed == 0


@pytest.mark.xla_cpu   # compared with mlp_segments, planned on the CPU device
def test_plan_deterministic(mlp, mlp_segments):
    """The same step, arguments and budget give the same plan (one-worker CP-SAT, fixed
    seed, deterministic tracing and compiles)."""
    loss, params, x = mlp
    again = plan(loss, params, x, budget=0.85, order=False)
    assert [(c.label, c.option) for c in again.choices] == \
        [(c.label, c.option) for c in mlp_segments.choices]
    assert again.compiled_bytes == mlp_segments.compiled_bytes
