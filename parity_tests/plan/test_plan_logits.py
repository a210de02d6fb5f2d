"""``jaxmem.plan(..., logits_chunk=...)``: the loss's language-model head computed a chunk of
rows at a time where that compiles smaller (the loss as written, nothing rewritten by the
user), with the untouched loss's values and gradients, its recomputation counted in the
predicted time; left whole where it saves nothing; FLOPs of scans and checkpoints counted
as they run."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from jaxmem import models
from jaxmem.planner import api as A
from jaxmem.planner import plan
from jaxmem.planner import trace as T


def _head_heavy_gpt(vocab=1024):
    """One block, d 16, 4 x 32 tokens (128 rows), vocab ``vocab``: the logits are most of
    the step's bytes."""
    m = models.gpt(n_layer=1, d_model=16, n_head=2, ctx=32, vocab=vocab)
    tok = jnp.asarray(np.random.default_rng().integers(0, vocab, (4, 32)), jnp.int32)
    params = m.init(jax.random.key(0), tok)["params"]

    def loss(p, t):
        return optax.softmax_cross_entropy_with_integer_labels(
            m.apply({"params": p}, t), t).mean()

    return loss, params, tok


def _max_rel(a, b):
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-30))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_plan_chunks_the_head_to_meet_the_budget():
    loss, params, tok = _head_heavy_gpt()
    p = plan(loss, params, tok, budget=0.5, logits_chunk=32)
    assert p.compiled_bytes <= p.budget_bytes
    assert p.logits_chunk == 32 and p.to_dict()["logits_chunk"] == 32
    (note,) = [n for n in p.notes if "language-model head" in n]
    assert "32 rows at a time" in note
    # the head is most of this model's FLOPs: its second forward pass shows in the time
    assert p.predicted_time > 1.1
    got = jax.jit(jax.value_and_grad(p.step))(params, tok)
    want = jax.jit(jax.value_and_grad(loss))(params, tok)
    assert _max_rel(got, want) < 1e-5


def test_variants_with_and_without_chunking():
    """``logits_chunk=None`` never chunks; a head whose chunking saves less than 1 % of the
    step (vocab 32, two columns per feature) is left whole; the chunked variant of a heavy
    head compiles smaller than the whole one."""
    loss, params, tok = _head_heavy_gpt()
    args = (params, tok)
    off = A._variant(loss, args, A._Settings(logits_chunk=None), {})
    on = A._variant(loss, args, A._Settings(logits_chunk=32), {})
    assert not off.chunked and off.step is loss
    assert on.chunked and on.bytes < 0.99 * off.bytes
    small, sargs = _head_heavy_gpt(vocab=32)[0], _head_heavy_gpt(vocab=32)[1:]
    assert not A._variant(small, sargs, A._Settings(logits_chunk=32), {}).chunked


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "128"])
def test_bad_logits_chunk_is_refused(bad):
    loss, params, tok = _head_heavy_gpt()
    with pytest.raises(ValueError, match="logits_chunk"):
        plan(loss, params, tok, budget=0.5, logits_chunk=bad)


def test_flops_of_a_scan_and_its_checkpoints():
    """A scan's body runs ``length`` times; FLOPs under ``jax.checkpoint`` run again in the
    backward pass (inside a scan: ``length`` times)."""
    w = jnp.ones((8, 8))

    def body(c, x):
        return c, jax.checkpoint(lambda x: jnp.tanh(x @ w))(x)

    def f(xs):
        return lax.scan(body, 0.0, xs)[1]

    jx = jax.make_jaxpr(f)(jnp.ones((5, 4, 8))).jaxpr
    one = 2.0 * 4 * 8 * 8 + 4 * 8          # the product and the tanh of one step
    assert T.flops_of(jx)[0] == pytest.approx(5 * one)
    assert T.flops_of(jx)[1] == pytest.approx(5 * 2.0 * 4 * 8 * 8)
    assert T.recomputed_flops(jx) == pytest.approx(5 * one)
    plain = jax.make_jaxpr(lambda xs: lax.scan(lambda c, x: (c, jnp.tanh(x @ w)), 0.0,
                                               xs)[1])(jnp.ones((5, 4, 8))).jaxpr
    assert T.recomputed_flops(plain) == 0.0
