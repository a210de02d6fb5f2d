"""The planner's stages against a fake compiler (a deterministic function from a choice to
bytes): typed options, the byte model and its calibration, the search's promises (budget met
when reachable, the least reachable total reported when not, ``jax.grad`` checked too, least
cost among the plans that fit) and the explanation. Nothing here traces or compiles a model."""
import types

import numpy as np
import pytest

from jaxmem.planner import BudgetError, UnitChoice
from jaxmem.planner import explain as E
from jaxmem.planner import trace as T
from jaxmem.planner.model import FITTED, ByteModel
from jaxmem.planner.options import KINDS, Candidate, Option
from jaxmem.planner.search import Search
from jaxmem.planner.steps import StepCompiler

KIB = 1024
FENCE = 10.0


# --- fixtures: a model of units and a compiler that plays XLA ---------------------------------

def _model(stored, dots, recompute, seg_keep=None, extra=(), store_bytes=None):
    """Per-unit ``store``/``dots``/``recompute`` candidates (work = what they stop keeping,
    cost = that many FLOPs + a fence), a ``segment`` over every run of >= 2 units keeping
    ``seg_keep`` (default: the first unit's recompute bytes), and ``extra`` candidates."""
    cands = []
    for u, (s, d, r) in enumerate(zip(stored, dots, recompute)):
        cands += [Candidate((u,), Option("store"), s, 0, 0.0),
                  Candidate((u,), Option("dots"), d, s - d, (s - d) / 2 + FENCE),
                  Candidate((u,), Option("recompute"), r, s - r, float(s - r) + FENCE)]
    n = len(stored)
    for i in range(n):
        for j in range(i + 2, n + 1):
            keep = recompute[i] if seg_keep is None else seg_keep
            cands.append(Candidate(tuple(range(i, j)), Option("segment"), keep,
                                   sum(stored[i:j]), float(sum(stored[i:j])) + FENCE))
    cands += list(extra)
    base = 100 * KIB
    return ByteModel(cands, stored, base + sum(stored) if store_bytes is None else store_bytes)


class FakeCompiler:
    """Compiled bytes = ``base + sum(held - a_kind * saving) + b * max work`` (a linear XLA
    that keeps ``1 - a_kind`` of each jaxpr-level saving); ``grad = value_and_grad +
    grad_extra(choice)``. Records every compile."""

    def __init__(self, model, a=None, b=0.25, grad_extra=lambda c: 0):
        self.model, self.b, self.grad_extra = model, b, grad_extra
        self.a = {k: 1.0 for k in FITTED} | {"store": 0.0, "rows": 1.0} | dict(a or {})
        self.calls, self.grad_calls = [], []

    def true_bytes(self, choice):
        m = self.model
        held = sum(m.held(m.candidates[i]) - self.a[m.candidates[i].option.kind] * m.saving(i)
                   for i in choice)
        work = max((m.candidates[i].work_bytes for i in choice), default=0)
        return round(m.base + held + self.b * work)

    def value_and_grad(self, choice):
        self.calls.append(choice)
        return self.true_bytes(choice)

    def grad(self, choice):
        self.grad_calls.append(choice)
        return self.true_bytes(choice) + self.grad_extra(choice)


def _all_choices(model):
    """Every set of candidates that covers each unit exactly once."""
    n = model.n_units
    starting = {u: [i for i, c in enumerate(model.candidates) if c.cover[0] == u]
                for u in range(n)}

    def rec(u):
        if u == n:
            yield ()
            return
        for i in starting[u]:
            for rest in rec(model.candidates[i].cover[-1] + 1):
                yield (i, *rest)

    return [tuple(sorted(c)) for c in rec(0)]


STORED = [64 * KIB, 64 * KIB, 128 * KIB, 32 * KIB]
DOTS = [40 * KIB, 40 * KIB, 64 * KIB, 32 * KIB]
RECOMPUTE = [16 * KIB, 16 * KIB, 16 * KIB, 8 * KIB]


# --- options ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind, param", [
    ("store", "store", None), ("dots", "dots", None), ("recompute", "recompute", None),
    ("segment", "segment", None), ("offload", "offload", None), ("fewbit3", "fewbit", 3),
    ("rows8", "rows", 8)])
def test_option_text_round_trips(text, kind, param):
    o = Option.parse(text)
    assert (o.kind, o.param) == (kind, param) and str(o) == text
    assert Option.parse(str(Option(kind, param))) == Option(kind, param)


def test_option_conversion_and_run_mode():
    assert Option("fewbit", 2).conversion() == T.Conversion("fewbit", 2)
    assert Option("rows", 4).conversion() == T.Conversion("rows", 4)
    assert Option("recompute").conversion() is None
    assert [Option.parse(k if k not in ("fewbit", "rows") else k + "2").run_as
            for k in KINDS if k != "partial"] == ["store", "dots", "recompute", "segment",
                                                  "store", "store", "offload"]
    assert Option.parse("partial13").run_as == "partial13"
    assert [k for k in KINDS if Option.parse(k if k not in ("fewbit", "rows", "partial") else
                                             k + ("13" if k == "partial" else "1"))
            .checkpointed] == ["dots", "recompute", "segment", "partial"]
    assert UnitChoice("d0", "fewbit", 1, 0, 0.0, "", bits=3).as_option == Option("fewbit", 3)
    assert UnitChoice("t", "rows", 1, 0, 0.0, "", rows=8).as_option == Option("rows", 8)


@pytest.mark.parametrize("make, msg", [
    (lambda: Option("remat"), "kind must be one of .* got 'remat'"),
    (lambda: Option("fewbit"), "param of kind 'fewbit' must be an int >= 1, got None"),
    (lambda: Option("rows", 0), "param of kind 'rows' must be an int >= 1, got 0"),
    (lambda: Option("store", 2), "param of kind 'store' must be None, got 2"),
    (lambda: Option.parse("fewbit-2"), "got 'fewbit-2'"),
    (lambda: Option.parse(3), "got 3"),
    (lambda: Candidate((0, 2), Option("segment"), 1, 1, 1.0), r"consecutive.*\(0, 2\)"),
])
def test_option_and_candidate_refuse_bad_values(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


# --- byte model ---------------------------------------------------------------------------

def test_model_features_predict_and_exact_fit():
    """With a linear fake compiler the fit recovers its coefficients from a few compiled
    plans and predicts every choice within 2 % of the default."""
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m, a={"dots": 0.5, "recompute": 0.75, "segment": 0.9}, b=1.0)
    plans = [m.uniform(k) for k in ("store", "dots", "recompute")] + [
        m.alone(m.index[key]) for key in (((0, 1), "segment"), ((2, 3), "segment"),
                                          ((2,), "dots"), ((3,), "recompute"))]
    compiled = {c: fake.true_bytes(c) for c in plans}
    theta = m.fit(compiled)
    assert theta.shape == (len(FITTED) + 1,)
    coef = dict(zip(FITTED, theta))
    assert coef["dots"] == pytest.approx(0.5, abs=0.02)
    assert coef["recompute"] == pytest.approx(0.75, abs=0.02)
    assert coef["segment"] == pytest.approx(0.9, abs=0.05)
    for c in _all_choices(m)[:50]:
        assert abs(m.predict(c, theta) - fake.true_bytes(c)) <= 0.02 * m.store_bytes
    assert m.predict(m.uniform("store"), theta) == m.store_bytes
    # features: savings by kind, then minus the largest work
    f = m.features(m.uniform("recompute"))
    assert f[FITTED.index("recompute")] == sum(STORED) - sum(RECOMPUTE)
    assert f[-1] == -max(s - r for s, r in zip(STORED, RECOMPUTE))


def test_model_items_are_calibrated_bytes():
    m = _model(STORED, DOTS, RECOMPUTE)
    theta = np.array([0.5, 1.0, 1.0, 1.0, 1.0, 2.0])   # dots keep half their saving
    items = m.items(theta)
    assert len(items) == len(m.candidates)
    i = m.index[((2,), "dots")]
    assert items[i].bytes == STORED[2] - 0.5 * (STORED[2] - DOTS[2])
    assert items[i].work == 2 * (STORED[2] - DOTS[2])
    assert items[i].option == Option("dots") and items[i].cost == m.candidates[i].cost
    j = m.index[((0,), "store")]
    assert (items[j].bytes, items[j].work) == (STORED[0], 0)
    m.measured[i] = 7
    assert m.items(theta)[i].bytes == STORED[2] - 7 and m.items(theta)[i].work == 0


def test_model_uniform_least_of_and_alone():
    fb = [Candidate((1,), Option("fewbit", b), k, 0, 1.0) for b, k in ((1, 8 * KIB),
                                                                         (4, 20 * KIB))]
    m = _model(STORED, DOTS, RECOMPUTE, extra=fb)
    assert [str(m.candidates[i].option) for i in m.uniform("dots")] == ["dots"] * 4
    least = m.least_of("fewbit")
    assert [str(m.candidates[i].option) for i in m.in_order(least)] == \
        ["store", "fewbit1", "store", "store"]
    assert m.least_of("offload") is None
    alone = m.alone(m.index[((1, 2), "segment")])
    assert [m.candidates[i].cover for i in m.in_order(alone)] == [(0,), (1, 2), (3,)]


# --- search -------------------------------------------------------------------------------

def _cheapest_fitting(m, fake, budget):
    fits = [c for c in _all_choices(m) if fake.true_bytes(c) <= budget
            and fake.true_bytes(c) + fake.grad_extra(c) <= budget]
    return min(fits, key=m.cost) if fits else None


@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.6])
def test_search_meets_a_reachable_budget_at_least_cost(fraction):
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m)
    budget = int(fraction * m.store_bytes)
    best = _cheapest_fitting(m, fake, budget)
    assert best is not None
    s = Search(m, fake, time_limit=5.0)
    res = s.run(budget, floor=50 * KIB, max_iterations=6)
    assert res.choice is not None and res.smallest is None
    assert fake.true_bytes(res.choice) <= budget and s.tried[res.choice] <= budget
    assert res.choice in fake.grad_calls   # jax.grad compiled and checked too
    assert m.cost(res.choice) == pytest.approx(m.cost(best))
    assert res.status in ("OPTIMAL", "FEASIBLE") and res.iterations >= 1


def test_search_cost_ordering_prefers_storing_then_cheaper_options():
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m)
    assert Search(m, fake).run(m.store_bytes, 0, 6).choice == m.uniform("store")
    # just below storing everything: one cheap dots unit, the others stored
    budget = m.store_bytes - 10 * KIB
    res = Search(m, fake).run(budget, 0, 6)
    kinds = sorted(str(m.candidates[i].option) for i in res.choice)
    assert kinds == ["dots", "store", "store", "store"]
    assert m.cost(res.choice) == m.cost(_cheapest_fitting(m, fake, budget))


def test_search_calibrates_a_model_that_misses():
    """XLA keeps most of a saving (a = 0.4): the prior model (a = 1) misses, the search
    refits on what it compiled and still returns a plan within the budget."""
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m, a={"dots": 0.4, "recompute": 0.4, "segment": 0.4})
    budget = sorted(fake.true_bytes(c) for c in _all_choices(m))[10]
    s = Search(m, fake)
    res = s.run(budget, 0, 6)
    assert res.choice is not None and fake.true_bytes(res.choice) <= budget
    coef = dict(zip(FITTED, m.fit(s.tried)))
    assert coef["recompute"] < 0.7   # the refit learnt the smaller saving
    refit = m.predict(res.choice, m.fit(s.tried))
    assert abs(refit / s.tried[res.choice] - 1) < 0.05 and res.iterations >= 2
    assert m.uniform("recompute") in s.calibration and m.uniform("dots") in s.calibration


def test_search_checks_grad_as_well():
    """A plan whose ``value_and_grad`` fits but whose ``grad`` does not is never returned."""
    m = _model(STORED, DOTS, RECOMPUTE)
    budget = int(0.8 * m.store_bytes)
    plain = FakeCompiler(m)
    first = Search(m, plain).run(budget, 0, 6).choice
    m2 = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m2, grad_extra=lambda c: 10**9 if c == first else 0)
    s = Search(m2, fake)
    res = s.run(budget, 0, 6)
    assert res.choice is not None and res.choice != first
    assert fake.true_bytes(res.choice) + fake.grad_extra(res.choice) <= budget
    assert first in fake.grad_calls   # it fitted value_and_grad, so grad was compiled


def test_search_refusal_reports_smallest_reachable():
    """Below every plan: no choice, and ``smallest`` is the least of the plans every search
    compiles (value_and_grad and grad alike): searching for it succeeds."""
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = FakeCompiler(m, grad_extra=lambda c: 512)
    floor = 100 * KIB
    least = min(fake.true_bytes(c) + 512 for c in _all_choices(m))
    for budget in (floor - 1, floor + KIB):
        res = Search(m, fake).run(budget, floor, 6)
        assert res.choice is None and res.smallest >= least > budget
        again = Search(_model(STORED, DOTS, RECOMPUTE), fake).run(res.smallest, floor, 1)
        assert again.choice is not None
        assert fake.true_bytes(again.choice) + 512 <= res.smallest


def test_search_budget_between_floor_and_unit_options_met_by_segments():
    """Per-unit recompute keeps every unit's input; a segment keeps only its first input:
    a budget below every uniform option is met by segments."""
    stored, rec = [64 * KIB] * 4, [60 * KIB] * 4
    m = _model(stored, stored, rec, seg_keep=8 * KIB)
    fake = FakeCompiler(m, b=0.25)
    budget = min(fake.true_bytes(m.uniform(k)) for k in ("dots", "recompute")) - 32 * KIB
    res = Search(m, fake).run(budget, 0, 6)
    assert res.choice is not None and fake.true_bytes(res.choice) <= budget
    assert any(m.candidates[i].option.kind == "segment" for i in res.choice)


class JoinRewardingCompiler(FakeCompiler):
    """:class:`FakeCompiler`, except that a plan with a two-unit segment compiles
    ``bonus`` below the linear bytes (as when the joined segment's backward runs after the
    other units' kept bytes are freed): something the byte model cannot predict."""

    def __init__(self, model, bonus, **kw):
        super().__init__(model, **kw)
        self.bonus = bonus

    def true_bytes(self, choice):
        m = self.model
        two = any(m.candidates[i].option.kind == "segment" and len(m.candidates[i].cover) == 2
                  for i in choice)
        return super().true_bytes(choice) - (self.bonus if two else 0)


def test_refused_search_joins_recomputed_neighbours():
    """``Search.joined``: from the over-budget plan of fewest compiled bytes (every unit
    recomputed), two neighbouring recomputed units joined into one segment are compiled
    (which the compiler rewards beyond the byte model's view) until one fits: at most
    ``_JOIN_TRIES`` compiles; nothing when no compiled plan is over the budget."""
    stored, rec = [40 * KIB] * 4, [10 * KIB] * 4
    m = _model(stored, [35 * KIB] * 4, rec, seg_keep=20 * KIB)
    fake = JoinRewardingCompiler(m, 30 * KIB, b=0.25)
    s = Search(m, fake)
    budget = 135 * KIB
    assert s.compile(m.uniform("recompute")) > budget
    s.joined(budget)
    new = fake.calls[1:]
    assert 1 <= len(new) <= 3
    segs = [m.candidates[i] for i in new[0] if m.candidates[i].option.kind == "segment"]
    assert len(segs) == 1 and len(segs[0].cover) == 2
    rest = [m.candidates[i] for i in new[0] if m.candidates[i].option.kind != "segment"]
    assert [c.option.kind for c in rest] == ["recompute", "recompute"]
    assert s.fits(new[-1], budget)
    calls = len(fake.calls)
    s.joined(budget)                      # a plan fits: nothing more to join
    s2 = Search(m, fake)
    s2.joined(10**9)                      # nothing compiled over this budget
    assert len(fake.calls) == calls


def test_search_measures_rows_candidates_alone():
    rows = Candidate((1, 2), Option("rows", 4), 40 * KIB, 48 * KIB, 100.0)
    m = _model(STORED, DOTS, RECOMPUTE, extra=[rows])
    fake = FakeCompiler(m, a={"rows": 0.5})
    s = Search(m, fake)
    s.calibrate()
    i = len(m.candidates) - 1
    alone = m.alone(i)
    assert alone in fake.calls and alone in s.calibration
    assert m.measured[i] == m.store_bytes - fake.true_bytes(alone)
    assert m.known(alone) == m.measured[i]


class _MissOnDots(FakeCompiler):
    """XLA keeps ``extra`` more bytes of any plan with unit 0 under ``dots`` (fusion the
    linear model cannot learn from one plan)."""

    extra = 8 * KIB

    def true_bytes(self, choice):
        m = self.model
        hit = any(m.candidates[i].option.kind == "dots" and 0 in m.candidates[i].cover
                  for i in choice)
        return super().true_bytes(choice) + (self.extra if hit else 0)


def test_search_gives_back_the_slack_of_a_miss():
    """A plan over the budget tightens the model's budget by its miss; once nothing cheaper
    than a fitting plan is found that tight, the slack is halved (the miss stays forbidden):
    the plan returned is cheaper than every plan within the budget minus the miss."""
    m = _model(STORED, DOTS, RECOMPUTE)
    fake = _MissOnDots(m)
    budget = int(0.55 * m.store_bytes)
    res = Search(m, fake).run(budget, 0, 6)
    assert res.choice is not None and fake.true_bytes(res.choice) <= budget
    tight = min(m.cost(c) for c in _all_choices(m)
                if fake.true_bytes(c) <= budget - fake.extra)
    assert m.cost(res.choice) < tight


def test_search_is_deterministic_and_compiles_each_plan_once():
    runs = []
    for _ in range(2):
        m = _model(STORED, DOTS, RECOMPUTE)
        fake = FakeCompiler(m, a={"recompute": 0.6})
        res = Search(m, fake).run(int(0.7 * m.store_bytes), 0, 6)
        assert len(fake.calls) == len(set(fake.calls))
        runs.append((res, fake.calls))
    assert runs[0] == runs[1]


def test_search_without_units_stores():
    m = ByteModel([], [], 1000)
    fake = FakeCompiler(m)
    assert Search(m, fake).run(1000, 0, 6).choice == ()
    res = Search(m, fake).run(999, 0, 6)
    assert res.choice is None and res.smallest == 1000


# --- explain and the real compiler's bookkeeping -----------------------------------------

def test_unit_choices_say_why():
    fb = Candidate((3,), Option("fewbit", 2), 4 * KIB, 0, 1.0)
    m = _model(STORED, DOTS, RECOMPUTE, extra=[fb])
    choice = tuple(sorted([m.index[((0, 1), "segment")], m.index[((2,), "store")],
                           m.index[((3,), "fewbit2")]]))
    out = E.unit_choices(m, choice, ["a", "b", "c", "d"], FENCE)
    assert [(c.label, c.option, c.bits) for c in out] == [
        ("a..b", "segment", None), ("c", "store", None), ("d", "fewbit", 2)]
    assert out[0].recompute_flops == float(STORED[0] + STORED[1])   # fence left out
    assert out[0].why.startswith("recompute") and "MiB" in out[0].why
    assert out[1].why.startswith("fits") and "2-bit activation codes" in out[2].why


def test_refusal_names_what_dominates():
    class Mem:
        argument_bytes, output_bytes, alias_bytes, total_bytes = 3 * 2**20, 2**20, 0, 9 * 2**20

    e = E.refusal(2**20, 6 * 2**20, Mem, ["a", "b"], [100, 300], 5, finer_units=True)
    assert isinstance(e, BudgetError) and e.smallest_bytes == 6 * 2**20
    assert "before any activation is kept" in str(e) and not e.finer_units
    assert e.dominant["arguments (parameters, batch, state)"] == 3 * 2**20
    assert e.dominant["temporaries of that plan"] == 2 * 2**20
    assert e.dominant["largest unit working set (b; part of the temporaries)"] == 300
    e = E.refusal(5 * 2**20, 6 * 2**20, Mem, [], [], 1, finer_units=True)
    assert "no layer boundary" in str(e) and "before any" not in str(e) and e.finer_units


def test_step_compiler_realises_typed_options_and_decides_the_fence():
    cands = [Candidate((0,), Option("store"), 1, 0, 0.0),
             Candidate((1, 2), Option("segment"), 1, 1, 1.0),
             Candidate((3,), Option("fewbit", 2), 1, 0, 1.0),
             Candidate((4,), Option("rows", 4), 1, 0, 1.0)]
    labels = ["a", "b", "c", "d", "e"]
    sc = StepCompiler(lambda x: x, None, labels, labels, cands, (1.0,), target="h100")
    runs, convs = sc.realise((3, 1, 0, 2))
    assert runs == ((("a",), "store"), (("b", "c"), "segment"), (("d",), "store"),
                    (("e",), "store"))
    assert convs["d"] == T.Conversion("fewbit", 2) and convs["e"] == T.Conversion("rows", 4)
    assert convs["a"] == T.Conversion("exact")
    assert StepCompiler(lambda x: x, None, [], [], [], (), "cpu").fence_of((0,)) is True


def _gpu_compiler(sizes, budget):
    """A GPU-target StepCompiler whose compiles return ``sizes[fenced]`` in turn, logging
    which way each step was built."""
    cands = [Candidate((0,), Option("store"), 1, 0, 0.0),
             Candidate((0,), Option("recompute"), 1, 1, 1.0),
             Candidate((1,), Option("store"), 1, 0, 0.0)]
    built = []

    def compile_bytes(fn, args, target):
        assert target == "h100"
        return sizes[built[-1]]

    sc = StepCompiler(lambda x: x, None, ["a"], ["a", "b"], cands, (1.0,), target="h100",
                      compile_bytes=compile_bytes, budget=budget, fence_flops=7.0)
    real_build = sc.build

    def build(choice, fence=None):
        built.append(sc.fence_of(choice) if fence is None else fence)
        return real_build(choice, fence)

    sc.build = build
    return sc, built


def test_step_compiler_gpu_plain_remat_kept_when_it_fits():
    sc, built = _gpu_compiler({False: 90, True: 50}, budget=100)
    assert sc.value_and_grad((1, 2)) == 90 and built == [False]    # fenced never compiled
    assert sc.fence_of((1, 2)) is False and sc.extra_cost((1, 2)) == 0.0
    assert sc.grad((1, 2)) == 90 and built[-1] is False
    assert sc.notes == [("h100 plan: recomputed units run as plain jax.checkpoint (unfenced) "
                         "in 1 of 1 compiled plans, behind the lax.cond fence in 0 (where "
                         "unfenced exceeded the budget and fenced compiled smaller)")]


def test_step_compiler_gpu_fences_a_plan_only_when_needed_and_smaller():
    sc, built = _gpu_compiler({False: 120, True: 80}, budget=100)
    assert sc.value_and_grad((1, 2)) == 80 and built == [False, True]
    assert sc.fence_of((1, 2)) is True and sc.extra_cost((1, 2)) == 7.0
    assert sc.grad((1, 2)) == 80 and built[-1] is True
    sc, built = _gpu_compiler({False: 120, True: 130}, budget=100)
    assert sc.value_and_grad((1, 2)) == 120 and sc.fence_of((1, 2)) is False
    sc, built = _gpu_compiler({False: 120, True: 80}, budget=100)
    assert sc.value_and_grad((0, 2)) == 120 and built == [False]   # nothing recomputed
    assert sc.notes == []


def test_search_adds_the_compilers_fence_cost():
    class Fenced(FakeCompiler):
        def extra_cost(self, choice):
            return 1000.0 if choice == (0,) else 0.0

    m = ByteModel([Candidate((0,), Option("store"), 10, 0, 0.0)], [10], 10)
    assert Search(m, Fenced(m)).cost((0,)) == 1000.0
    assert Search(m, FakeCompiler(m)).cost((0,)) == 0.0


# --- max_batch's search over batch sizes -------------------------------------------------

@pytest.mark.parametrize("largest, start, limit", [(37, 1, 4096), (37, 16, 4096), (1, 1, 8),
                                                  (0, 4, 64), (64, 8, 64), (5, 64, 64)])
def test_max_batch_search_finds_the_largest_fitting_batch(largest, start, limit):
    from jaxmem.planner.batch import _largest

    asked = []

    def fits(b):
        asked.append(b)
        return f"plan{b}" if b <= largest else None

    b, v = _largest(fits, start, limit)
    want = min(largest, limit)
    assert (b, v) == (want, f"plan{want}" if want else None)
    assert len(asked) == len(set(asked)) and len(asked) <= 2 * limit.bit_length() + 2


def test_plan_retries_the_other_variant_when_refused(monkeypatch):
    """Every cut of the variant :func:`_variant` picked (here the scoped one) is refused:
    ``plan`` plans the other (unscoped) variant too, returns its plan when it fits, and
    otherwise raises the refusal of least ``smallest_bytes``."""
    from jaxmem.planner import api

    # a scope with ResNet block outputs kept (residual_adds=False) has no twin to try
    picked = api._Variant(True, api._glue_scope, 100, None, residual_adds=False)
    other = api._Variant(False, None, 120, None)
    seen = []

    def fake_plan(step, args, budget, s, finer, cache):
        if "variant" not in cache:
            cache["variant"], cache["pending"] = picked, [other]
        seen.append((cache["variant"].selective, finer))
        if cache["variant"] is picked or meets is None:
            smallest = 50 if cache["variant"] is picked else meets_not
            raise BudgetError("refused", smallest, {}, finer_units=finer == 0)
        return meets

    monkeypatch.setattr(api, "_plan", fake_plan)
    settings = api._Settings()
    meets = types.SimpleNamespace(predicted_time_total=1.2, conversion_time=0.0)
    assert api._plan_finer(lambda p: p, (1.0,), 0.25, settings) is meets
    assert seen == [(True, 0), (True, 1), (False, 0)]
    for meets, meets_not, least in ((None, 40, 40), (None, 70, 50)):
        seen.clear()
        with pytest.raises(BudgetError) as e:
            api._plan_finer(lambda p: p, (1.0,), 0.25, settings)
        assert e.value.smallest_bytes == least
        assert seen == [(True, 0), (True, 1), (False, 0), (False, 1)]


@pytest.mark.parametrize("other_total, expect", [(1.2, "other"), (1.5, "twin"), (None, "twin")])
def test_plan_weighs_a_later_converted_plan_against_the_next_variant(monkeypatch, other_total,
                                                                     expect):
    """After a refused first variant, a plan that carries the conversion's own FLOPs is not
    returned at once: the next variant is planned too and the plan of least
    ``predicted_time_total`` returned (a refusal of that variant keeps the first plan)."""
    from jaxmem.planner import api

    first = api._Variant(True, api._glue_scope, 100, None)
    twin = api._Variant(True, api._glue_scope, 110, None, residual_adds=False)
    other = api._Variant(False, None, 150, None)
    plans = {"twin": types.SimpleNamespace(predicted_time_total=1.3, conversion_time=0.17),
             "other": types.SimpleNamespace(predicted_time_total=other_total,
                                            conversion_time=0.0)}
    seen = []

    def fake_plan(step, args, budget, s, finer, cache):
        if "variant" not in cache:
            cache["variant"], cache["pending"] = first, [twin, other]
        v = cache["variant"]
        name = "first" if v is first else "twin" if v is twin else "other"
        seen.append(name)
        if name == "first" or (name == "other" and other_total is None):
            raise BudgetError("refused", 50, {}, finer_units=False)
        return plans[name]

    monkeypatch.setattr(api, "_plan", fake_plan)
    monkeypatch.setattr(api, "_traced_variants", lambda *a, **k: [])
    got = api._plan_finer(lambda p: p, (1.0,), 0.25, api._Settings())
    assert got is plans[expect]
    assert seen == ["first", "twin", "other"]
