"""``partial`` units: a unit whose costly children are stored and whose other children are
recomputed, run by run (``Option("partial", mask)``, :func:`jaxmem.planner.trace.partial_fn`),
and the search's local pass that tries them on a plan that fits (``Search.cheapen``).

Exactness is checked on a GPT traced under ``jaxmem.scope()`` (the planner's converted
variant) against the untouched loss; the search against a fake compiler; the candidates' bytes
and costs against storing and recomputing the same unit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import models
from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.planner import api
from jaxmem.planner import candidates as C
from jaxmem.planner import explain as E
from jaxmem.planner import trace as T
from jaxmem.planner.model import FITTED, ByteModel
from jaxmem.planner.options import (
    Candidate,
    Option,
    partial_children,
    partial_mask,
    recomputed_runs,
)
from jaxmem.planner.search import _CHEAPEN_TRIES, Search
from jaxmem.planner.steps import make_step

KIB = 1024


# --- the option -----------------------------------------------------------------------------

@pytest.mark.parametrize("stored, runs", [
    ((True, False, True), [(1, 2)]),
    ((False, True, False, False, True), [(0, 1), (2, 4)]),
    ((True, False), [(1, 2)])])
def test_partial_mask_round_trips(stored, runs):
    p = partial_mask(stored)
    assert partial_children(p) == stored
    assert recomputed_runs(stored) == runs
    o = Option("partial", p)
    assert Option.parse(str(o)) == o and o.run_as == str(o) and o.checkpointed
    assert Candidate((0,), o, 1, 1, 1.0).checkpoints == len(runs)


@pytest.mark.parametrize("param", [None, 2, 3, partial_mask((True, True)),
                                   partial_mask((False, False, False))])
def test_partial_refuses_a_mask_that_stores_all_or_nothing(param):
    with pytest.raises(ValueError, match="param of kind 'partial'"):
        Option("partial", param)


# --- exactness on a traced GPT ----------------------------------------------------------------

def _gpt(n_layer=2):
    m = models.gpt(n_layer=n_layer, d_model=32, n_head=2, ctx=16, vocab=64)
    tok = jax.random.randint(jax.random.key(3), (4, 16), 0, 64)
    params = jax.jit(m.init)(jax.random.key(4), tok)["params"]

    def loss(p, t):
        return -jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, t))[..., 1])

    return loss, params, tok


@pytest.fixture(scope="module")
def gpt_profile():
    loss, params, tok = _gpt()
    tr = T.trace(loss, (params, tok), api._glue_scope())
    prof = C.profile_units(tr)
    return loss, params, tok, prof


def test_partial_candidates_keep_between_recompute_and_store_for_less(gpt_profile):
    """Each GPT block gets ``partial`` candidates: fewer bytes than stored, fewer FLOPs than
    recomputed whole, one ``jax.checkpoint`` per recomputed run; the attention (the costliest
    child per byte) is the first stored."""
    *_, prof = gpt_profile
    cands = C.partial_candidates(prof, fence=0.0)
    by_unit = {}
    for c in cands:
        by_unit.setdefault(prof.labels[c.cover[0]], []).append(c)
    assert sorted(by_unit) == ["h_0", "h_1"]
    for lbl, cs in by_unit.items():
        u = prof.labels.index(lbl)
        for c in cs:
            assert c.keep_bytes < prof.keep[u][0]
            assert c.cost < prof.recompute[u][0]
            assert c.work_bytes > 0
            assert c.checkpoints == len(recomputed_runs(partial_children(c.option.param)))
        first = min(cs, key=lambda c: sum(partial_children(c.option.param)))
        kept = [k for k, s in zip(first.children, partial_children(first.option.param)) if s]
        assert f"{lbl}/attn" in kept and f"{lbl}/mlp" not in kept


@pytest.mark.parametrize("fence", [False, True])
def test_partial_step_matches_the_untouched_loss(gpt_profile, fence):
    """Every block ``partial`` (its first candidate): the planned step's value and gradients
    equal the untouched loss's, under ``jit``, plain ``jax.checkpoint`` and behind the fence."""
    loss, params, tok, prof = gpt_profile
    cands = C.partial_candidates(prof, fence=0.0)
    pick = {}
    for c in cands:
        pick.setdefault(prof.labels[c.cover[0]], c)
    runs = [((lbl,), str(pick[lbl].option) if lbl in pick else "store") for lbl in prof.labels]
    step = make_step(loss, api._glue_scope, prof.cut_labels, runs, {}, fence=fence)
    v1, g1 = jax.jit(jax.value_and_grad(step))(params, tok)
    v0, g0 = jax.jit(jax.value_and_grad(loss))(params, tok)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_partial_step_with_another_number_of_children_is_refused(gpt_profile):
    loss, params, tok, prof = gpt_profile
    runs = [((lbl,), "partial" + str(partial_mask((True, False))) if lbl == "h_0" else "store")
            for lbl in prof.labels]
    step = make_step(loss, api._glue_scope, prof.cut_labels, runs, {}, fence=False)
    with pytest.raises(ValueError, match="partial_fn: 2 flags for the 5 sub-chunks"):
        jax.value_and_grad(step)(params, tok)


def test_unit_choices_name_the_recomputed_children(gpt_profile):
    *_, prof = gpt_profile
    c = C.partial_candidates(prof, fence=0.0)[0]
    m = ByteModel([c] + [Candidate((u,), Option("store"), s, 0, 0.0)
                         for u, s in enumerate(prof.stored)], prof.stored, 10**6)
    choice = (0,) + tuple(1 + u for u in range(len(prof.stored)) if u != c.cover[0])
    (uc,) = [x for x in E.unit_choices(m, choice, prof.labels, 0.0) if x.option == "partial"]
    flags = partial_children(c.option.param)
    assert uc.recomputed == tuple(k for k, s in zip(c.children, flags) if not s)
    assert uc.as_option == c.option and "again" in uc.why and "stored" in uc.why


@pytest.mark.skipif(not gpu_plan_available(), reason="needs the CUDA PJRT plugin (GPU plans)")
def test_partial_blocks_compile_between_stored_and_recomputed_on_the_h100_plan(gpt_profile):
    """On XLA:GPU's plan (plain ``jax.checkpoint``) every block ``partial`` compiles to fewer
    bytes than every block stored and more than every block recomputed whole (it keeps the
    attention's residuals)."""
    loss, params, tok, prof = gpt_profile
    first = {}
    for c in C.partial_candidates(prof, fence=0.0):
        first.setdefault(prof.labels[c.cover[0]], c)

    def total(opt):
        runs = [((lbl,), opt(lbl)) for lbl in prof.labels]
        step = make_step(loss, api._glue_scope, prof.cut_labels, runs, {}, fence=False)
        return compiled_memory(jax.value_and_grad(step), params, tok, target="h100").total_bytes

    stored = total(lambda lbl: "store")
    part = total(lambda lbl: str(first[lbl].option) if lbl in first else "store")
    whole = total(lambda lbl: "recompute" if lbl in first else "store")
    assert whole < part < stored


# --- the search's local pass ------------------------------------------------------------------

class PeakCompiler:
    """Compiled bytes = base + kept bytes of every unit (but the last with ``free_last``: the
    last unit's backward runs first, after the peak, so what it keeps is free); ``grad``
    alike. Records the ``value_and_grad`` compiles."""

    def __init__(self, model, base, free_last=True):
        self.model, self.base, self.free_last, self.calls = model, base, free_last, []

    def grad(self, choice):
        m = self.model
        last = m.n_units - 1 if self.free_last else m.n_units
        return self.base + sum(m.candidates[i].keep_bytes for i in choice
                               if m.candidates[i].cover[-1] < last)

    def value_and_grad(self, choice):
        self.calls.append(choice)
        return self.grad(choice)


def _partial_model(n=4):
    cands = []
    for u in range(n):
        cands += [Candidate((u,), Option("store"), 40 * KIB, 0, 0.0),
                  Candidate((u,), Option("recompute"), 10 * KIB, 40 * KIB, 10.0),
                  Candidate((u,), Option("partial", partial_mask((True, False))), 20 * KIB,
                            20 * KIB, 4.0, children=(f"u{u}/a", f"u{u}"))]
    for i in range(n):
        for j in range(i + 2, n + 1):
            cands.append(Candidate(tuple(range(i, j)), Option("segment"), 10 * KIB,
                                   40 * KIB * (j - i), 10.0 * (j - i)))
    return ByteModel(cands, [40 * KIB] * n, 100 * KIB + 160 * KIB)


def test_cheapen_keeps_the_partial_units_that_fit():
    """From every unit recomputed (30 KiB kept, budget 45): the last unit goes partial for
    free, then the third (40 KiB); the first two would not fit partial (50), so they are
    joined into one segment (30 KiB, no more FLOPs); nothing over the budget is returned."""
    m = _partial_model()
    fake = PeakCompiler(m, 100 * KIB)
    s = Search(m, fake)
    budget = 100 * KIB + 45 * KIB
    start = m.uniform("recompute")
    assert s.compile(start) <= budget
    best = s.cheapen(budget, start)
    kinds = [(m.candidates[i].option.kind, m.candidates[i].cover) for i in m.in_order(best)]
    assert kinds == [("segment", (0, 1)), ("partial", (2,)), ("partial", (3,))]
    assert s.fits(best, budget) and s.cost(best) < s.cost(start)
    assert len(fake.calls) - 1 == 5 <= _CHEAPEN_TRIES


def test_cheapen_is_bounded_and_a_no_op_without_partial_candidates():
    m = _partial_model(n=8)
    fake = PeakCompiler(m, 100 * KIB, free_last=False)
    s = Search(m, fake)
    start = m.uniform("recompute")
    budget = s.compile(start) + 5 * KIB     # no partial unit fits; joins do
    best = s.cheapen(budget, start)
    assert len(fake.calls) - 1 <= _CHEAPEN_TRIES
    assert s.fits(best, budget) and s.cost(best) <= s.cost(start)
    plain = ByteModel([c for c in m.candidates if c.option.kind != "partial"], m.stored,
                      m.store_bytes)
    s2 = Search(plain, PeakCompiler(plain, 100 * KIB))
    st = plain.uniform("recompute")
    assert s2.cheapen(10**9, st) == st
    assert "partial" in FITTED


@pytest.mark.parametrize("objective, budget", [("time", 10**9), ("bytes", None),
                                                ("time", 100 * KIB + 100 * KIB)])
def test_solver_never_picks_a_partial_candidate(objective, budget):
    """The solver is given no ``partial`` candidate (``Search.cheapen`` tries them on
    compiled plans): with the stored plan forbidden, the cheapest other plan would be one
    ``partial`` unit (cost 4 against 10 recomputed); the solver returns a plan without it."""
    m = _partial_model()
    s = Search(m, PeakCompiler(m, 100 * KIB))
    store = m.uniform("store")
    sol = s.solve(m.fit(s.tried), budget, objective, forbidden=[store])
    assert sol.choice is not None and sol.choice != store
    assert all(m.candidates[i].option.kind != "partial" for i in sol.choice)
    assert sol.choice == tuple(sorted(sol.choice))
