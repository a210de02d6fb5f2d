"""The planner's recomputation cost: the FLOPs a checkpointed unit or segment runs again in
the backward pass are only what its kept residuals depend on (JAX's checkpoint drops the rest,
e.g. a block's trailing matmul whose output the backward pass never reads), checked against
the FLOPs of JAX's own checkpointed VJP minus the plain one."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxmem import models
from jaxmem._glue.options import Options
from jaxmem.linen import scope_options
from jaxmem.planner import candidates as C
from jaxmem.planner import trace as T
from jaxmem.planner.options import Option


def _gpt(scope):
    # one block: chunks of up to four units still cross unit boundaries (embeddings into the
    # block, the block into ln_f and the head; on the finer cut attention into the MLP)
    m = models.gpt(n_layer=1, d_model=32, ctx=16)
    tok = jax.random.randint(jax.random.key(3), (4, 16), 0, 256)
    params = jax.jit(m.init)(jax.random.key(4), tok)["params"]   # one program, not op by op

    def loss(p, t):
        return -jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, t))[..., 0])

    ctx = scope_options(Options(), label="test") if scope else None
    return T.trace(loss, (params, tok), ctx)


def _jax_recompute_flops(jaxpr, start, stop):
    """FLOPs of ``vjp`` of the chunk under ``jax.checkpoint(nothing_saveable)`` minus those of
    its plain ``vjp``: what JAX's own checkpoint runs again."""
    ins, outs = T.chunk_io(jaxpr, start, stop)
    f = T.chunk_fn(jaxpr, start, stop, ins, outs)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]

    def count(g):
        def run(*a):
            out, vjp = jax.vjp(g, *a)
            return vjp(out)
        return T.flops_of(jax.make_jaxpr(run)(*avals).jaxpr)[0]

    ck = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=True)
    return count(ck) - count(f)


@pytest.mark.parametrize(("scope", "finer"), [(False, 1), (True, 0)],
                         ids=["plain-finer", "scope-blocks"])
def test_recompute_cost_is_what_jax_checkpoint_runs_again(scope, finer):
    tr = _gpt(scope)
    prof = C.profile_units(tr, finer)
    jx = tr.closed.jaxpr
    step = 3.0 * prof.total_flops
    n = len(prof.units)
    below_full = 0
    for i in range(n):
        for j in range(i + 1, min(n, i + 4) + 1):
            ours = C.chunk_recompute_flops(prof, i, j)
            truth = _jax_recompute_flops(jx, prof.units[i].start, prof.units[j - 1].stop)
            full = sum(prof.flops[u][0] for u in range(i, j))
            # elementwise equations are counted one FLOP per output element on both sides;
            # ours keeps a unit whole when any of its outputs is needed (never less than JAX)
            assert truth - 1e-3 * step <= ours <= full + 1e-9
            assert ours == pytest.approx(truth, abs=0.01 * step)
            below_full += ours < full - 0.01 * step
    assert below_full   # some chunks end in work the backward pass does not read


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1], name="down")(jax.nn.gelu(nn.Dense(256, name="up")(x)))


def test_trailing_matmul_is_not_counted_and_candidates_use_the_cost():
    m = _MLP()
    x = jax.random.normal(jax.random.key(0), (64, 32))
    p = jax.jit(m.init)(jax.random.key(1), x)

    def loss(p, x):
        return jnp.sum(jnp.sin(m.apply(p, x)))

    tr = T.trace(loss, (p, x))
    prof = C.profile_units(tr, 1)
    u = prof.labels.index("down")
    up = prof.labels.index("up")
    matmul = 2.0 * 64 * 32 * 256
    # "down" (gelu, then its matmul) recomputes the gelu its backward reads, not the matmul
    assert 0 < prof.recompute[u][0] < prof.flops[u][0] - 0.9 * matmul
    seg = C.chunk_recompute_flops(prof, up, u + 1)
    assert seg == pytest.approx(prof.flops[up][0] + prof.recompute[u][0])
    assert seg < prof.flops[up][0] + prof.flops[u][0] - 0.9 * matmul
    cands = C.exact_candidates(prof, fence=7.0)
    rec = next(c for c in cands if c.cover == (u,) and c.option == Option("recompute"))
    assert rec.cost == pytest.approx(prof.recompute[u][0] + 7.0)
    s = next(c for c in cands if c.cover == (up, u) and c.option == Option("segment"))
    assert s.cost == pytest.approx(seg + 7.0)
