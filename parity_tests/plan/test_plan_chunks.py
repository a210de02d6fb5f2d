"""``jaxmem.plan(..., attention_chunk=..., mlp_chunk=...)``: the scope the loss is planned
under runs its attentions and MLPs in row chunks (part of the traced variant, noted in the
plan), the planned step keeps the untouched gradients, and ``traced_time`` prices what the
planned step runs: the FLOPs of its ``value_and_grad`` jaxpr over the untouched step's."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmem import models
from jaxmem.planner import api as A
from jaxmem.planner import plan
from jaxmem.planner import trace as T


def _gpt():
    m = models.gpt(n_layer=2, d_model=32, n_head=2, ctx=32, vocab=64)
    tok = jnp.asarray(np.random.default_rng().integers(0, 64, (4, 32)), jnp.int32)
    params = m.init(jax.random.key(0), tok)["params"]

    def loss(p, t):
        return optax.softmax_cross_entropy_with_integer_labels(
            m.apply({"params": p}, t), t).mean()

    return loss, params, tok


def _flops(fn, *args):
    return T.flops_of(jax.make_jaxpr(jax.value_and_grad(fn))(*args).jaxpr,
                      merge_identical=True)[0]


def test_scope_variant_traced_with_the_chunks():
    loss, params, tok = _gpt()
    s = A._Settings(attention_chunk=8, mlp_chunk=32)
    factory = A._scope_factory(s)
    assert A._scope_factory(A._Settings()) is A._glue_scope
    with factory() as opts:
        assert (opts.attention_chunk, opts.mlp_chunk) == (8, 32)
    # the chunked MLP recomputes its first product in its backward pass: more FLOPs traced
    chunked = A._make_step(loss, factory, (), (), {})
    whole = A._make_step(loss, A._glue_scope, (), (), {})
    assert _flops(chunked, params, tok) > _flops(whole, params, tok)


def test_plan_with_chunks_is_exact_and_traced():
    loss, params, tok = _gpt()
    p = plan(loss, params, tok, budget=0.5, attention_chunk=8, mlp_chunk=32)
    assert p.compiled_bytes <= p.budget_bytes
    want = _flops(p.step, params, tok) / _flops(loss, params, tok)
    assert abs(p.traced_time - want) < 1e-9 and p.to_dict()["traced_time"] == p.traced_time
    assert p.traced_time > 1.0   # recomputation (and the conversion's) traced
    assert p.selective and any("mlp_chunk=32" in n for n in p.notes)
    got = jax.jit(jax.value_and_grad(p.step))(params, tok)
    ref = jax.jit(jax.value_and_grad(loss))(params, tok)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) < 1e-5


def test_untouched_plan_traced_time_is_one():
    loss, params, tok = _gpt()
    p = plan(loss, params, tok, budget=1.0)
    assert p.traced_time == 1.0
