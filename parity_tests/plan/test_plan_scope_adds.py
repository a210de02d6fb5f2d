"""jaxmem.plan's scope variant with ResNet block outputs kept (``residual_adds=False``).

Under ``jaxmem.scope()``'s defaults a ResNet block's output is never kept: the next block's
first convolution recomputes it from the add's inputs. A unit the plan recomputes then keeps
those inputs (several maps) instead of the block output, so when the default scope is refused
the plan tries the same scope with the block outputs kept before planning without one."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import models
from jaxmem.planner import api
from jaxmem.planner import candidates as C
from jaxmem.planner import trace as T
from jaxmem.planner.result import BudgetError


def _resnet(batch=4, side=16):
    m = models.resnet18(width=0.125, num_classes=10, stem="cifar")
    x = jax.random.normal(jax.random.key(0), (batch, side, side, 3))
    v = m.init(jax.random.key(1), x, train=False)

    def loss(p, x):
        y, _ = m.apply({"params": p, "batch_stats": v["batch_stats"]}, x, train=True,
                       mutable=["batch_stats"])
        return jnp.mean(jnp.sin(y) ** 2)

    return loss, v["params"], x


def _unit_residual_maps(loss, args, factory, label):
    """Shapes of the activation maps (rank 4, batch first; not kernels) a recomputed unit
    ``label`` keeps."""
    tr = T.trace(loss, args, factory() if factory else None)
    u = next(u for u in T.choose_units(tr) if u.label == label)
    ins, outs = T.chunk_io(tr.closed.jaxpr, u.start, u.stop)
    f = T.chunk_fn(tr.closed.jaxpr, u.start, u.stop, ins, outs)
    av = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
    jx = C._residual_jaxpr(f, av, jax.checkpoint_policies.nothing_saveable)
    return sorted(tuple(v.aval.shape) for v in jx.outvars
                  if hasattr(v, "aval") and len(v.aval.shape) == 4
                  and v.aval.shape[0] == args[1].shape[0])


def test_a_recomputed_block_keeps_its_input_alone_with_block_outputs_kept():
    loss, params, x = _resnet()
    args = (params, x)
    keep = _unit_residual_maps(loss, args,
                               lambda: api._glue_scope(residual_adds=False), "layer2_1")
    recipe = _unit_residual_maps(loss, args, api._glue_scope, "layer2_1")
    plain = _unit_residual_maps(loss, args, None, "layer2_1")
    assert keep == plain and len(keep) == 1          # the block input, one map
    assert len(recipe) > 1                            # the add's inputs, kept apart
    assert sum(int(np.prod(s)) for s in recipe) > sum(int(np.prod(s)) for s in keep)


def test_next_variant_after_a_refused_scope_is_the_scope_with_block_outputs_kept():
    loss, params, x = _resnet()
    args = (params, x)
    s = api._Settings()
    cache = {}
    first = api._variant(loss, args, s, cache)
    assert first.selective and first.residual_adds
    nxt = api._next_variant(loss, args, s, cache)
    assert nxt.selective and not nxt.residual_adds and nxt.bytes != first.bytes
    cache["variant"] = nxt
    last = api._next_variant(loss, args, s, cache)   # a kept-outputs scope adds no twin
    assert last is not None and not last.selective
    assert nxt.bytes <= last.bytes
    cache["variant"] = last
    assert api._next_variant(loss, args, s, cache) is None


def test_a_model_without_residual_adds_gets_no_twin():
    m = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(1)])
    x = jax.random.normal(jax.random.key(2), (16, 8))
    params = m.init(jax.random.key(3), x)

    def loss(p, x):
        return jnp.mean(m.apply(p, x) ** 2)

    s, cache = api._Settings(), {}
    cache["variant"] = v = api._traced_variants(loss, (params, x), s, True)[0]
    assert v.selective and v.residual_adds
    nxt = api._next_variant(loss, (params, x), s, cache)
    assert nxt is None or nxt.residual_adds is True and nxt.bytes != v.bytes


def test_plan_under_the_kept_outputs_scope_is_exact(monkeypatch):
    """Every other variant refused (forced here): the plan made under the scope with block
    outputs kept says so and gives the untouched loss's value and gradients."""
    loss, params, x = _resnet()
    args = (params, x)
    s = api._Settings(order=False)
    twin = api._traced_variants(loss, args, s, True, residual_adds=False)[0]
    assert twin.selective and not twin.residual_adds
    default = api.compiled_total(jax.value_and_grad(loss), args, "cpu")
    assert twin.bytes < default
    real = api._plan

    def refuse_others(step, args, budget, s, finer, cache):
        v = api._variant(step, args, s, cache)
        if v.residual_adds:
            raise BudgetError("forced", 2**40, {}, finer_units=False)
        return real(step, args, budget, s, finer, cache)

    monkeypatch.setattr(api, "_plan", refuse_others)
    mp = api.plan(loss, params, x, budget=int(1.05 * twin.bytes), order=False)
    assert mp.selective and mp.residual_adds is False
    assert any("residual_adds=False" in n for n in mp.notes)
    assert mp.to_dict()["residual_adds"] is False
    assert mp.compiled_bytes <= mp.budget_bytes
    v0, g0 = jax.value_and_grad(loss)(params, x)
    v1, g1 = jax.jit(jax.value_and_grad(mp.step))(params, x)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    # per leaf, relative to its largest entry: batch-norm sums run in another order
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
