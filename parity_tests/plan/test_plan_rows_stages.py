"""jaxmem.plan's ``rows`` option over a VGG trunk's first pooling stages: those stages run
row-tiled (:func:`jaxmem.planner.trace.row_split`), the rest of the trunk as its own layers
(units with their own options). Exact: same loss and gradients as the untouched model; the
high-resolution stages, where the bytes are, tiled without recomputing the whole trunk."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import models
from jaxmem.planner import candidates as C
from jaxmem.planner import trace as T
from jaxmem.planner.options import Option
from jaxmem.planner.result import UnitChoice
from jaxmem.planner.steps import StepCompiler, make_step

CFG = (8, 8, "M", 8, 8, "M", 16, "M")


@pytest.fixture(scope="module")
def vgg():
    m = models.VGG(CFG, 1.0, False, 10, (16,))
    x = jax.random.normal(jax.random.key(4), (2, 64, 64, 3))
    params = jax.jit(m.init)(jax.random.key(5), x)["params"]

    def loss(p, x):
        return jnp.mean(m.apply({"params": p}, x) ** 2)

    tr = T.trace(loss, (params, x))
    cuts = [u.label for u in T.choose_units(tr) if u.label != "(rest)"]
    return loss, params, x, tr, cuts


def _rel(a, b):
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _bytes(fn, *args):
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
            - m.alias_size_in_bytes)


@pytest.mark.parametrize("scoped", [False, True], ids=["plain", "scope"])
@pytest.mark.parametrize("stages", [1, 2])
def test_first_stages_tiled_exact_and_labelled_as_the_trunk(vgg, stages, scoped):
    """The head's convs leave the trace (their units merge into the head's last conv, the
    tag at the tiled output); the tail's convs keep the trunk's own labels; values and
    gradients equal the untouched step's (fresh input, jit), traced plainly or under the
    selective scope the planner may trace the loss in."""
    from jaxmem.planner.api import _glue_scope

    loss, params, x, tr, cuts = vgg
    factory = _glue_scope if scoped else None
    conv = {"features": T.Conversion("rows", 4, stages)}
    traced = T.trace(loss, (params, x), factory() if scoped else None, conv)
    assert traced.converted == {"features"}
    n_head = 2 if stages == 1 else 4
    head_end = f"features/conv_{n_head - 1}"
    inside = [lbl for lbl in tr.ends if lbl.startswith("features/")]
    assert [lbl for lbl in inside if lbl in traced.ends] == \
        [head_end] + [f"features/conv_{i}" for i in range(n_head, 5)]
    step = make_step(loss, factory, cuts, (), conv)
    x2 = jax.random.normal(jax.random.key(6), x.shape)
    v0, g0 = jax.jit(jax.value_and_grad(loss))(params, x2)
    v1, g1 = jax.jit(jax.value_and_grad(step))(params, x2)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    assert _rel(g1, g0) < 1e-5


def test_row_split_only_where_a_stage_is_followed_by_layers():
    f = models.VGGFeatures(cfg=CFG, width=1.0)
    split = T.row_split(f, 4, 2)
    assert split.n_head == 4 and tuple(split.tail.cfg) == (16, "M")
    assert T.row_split(f, 4, 3) is None              # nothing after the last pool
    assert T.row_split(f, 4, 4) is None              # fewer stages than asked
    assert T.row_split(models.VGGFeatures(cfg=CFG, batch_norm=True), 4, 1) is None
    with pytest.raises(ValueError, match="stages"):
        T.Conversion("fewbit", 2, 1)
    with pytest.raises(ValueError, match="stages"):
        T.Conversion("rows", 4, 0)


def test_option_text_round_trips_with_stages():
    o = Option("rows", 8, 2)
    assert str(o) == "rows8s2" and Option.parse("rows8s2") == o
    assert Option.parse("rows8") == Option("rows", 8)
    assert o.conversion() == T.Conversion("rows", 8, 2)
    assert UnitChoice("a..b", "rows", 1, 0, 0.0, "", rows=8, stages=2).as_option == o
    with pytest.raises(ValueError, match="stages"):
        Option("recompute", None, 1)


def test_candidates_cover_the_first_stages_and_compile_smaller(vgg):
    """``row_candidates`` offers each prefix of stages (``converts`` the trunk) beside the
    whole trunk; a prefix candidate alone (the rest stored) compiles below every unit
    stored and runs the untouched step's gradients."""
    loss, params, x, tr, _ = vgg
    prof = C.profile_units(tr)
    rows = C.row_candidates(loss, (params, x), None, prof)
    labels = prof.labels
    prefix = [c for c in rows if c.option.stages is not None]
    assert {c.option.stages for c in prefix} == {1, 2}
    assert all(c.converts == "features" for c in prefix)
    assert all(c.converts is None for c in rows if c.option.stages is None)
    one = next(c for c in prefix if c.option == Option("rows", 4, 1))
    assert [labels[u] for u in one.cover] == ["features/conv_0", "features/conv_1"]
    assert sum(c.cost for c in prefix if c.option == Option("rows", 4, 1)) < \
        next(c.cost for c in rows if c.option == Option("rows", 4))
    cands = C.exact_candidates(prof, 0.0) + rows
    store = {c.cover[0]: i for i, c in enumerate(cands) if c.option == Option("store")}
    two = next(c for c in prefix if c.option == Option("rows", 8, 2))
    choice = tuple(sorted([cands.index(two)] + [store[u] for u in range(len(labels))
                                                if u not in two.cover]))
    sc = StepCompiler(loss, None, prof.cut_labels, labels, cands, (params, x))
    runs, convs = sc.realise(choice)
    assert convs == {"features": T.Conversion("rows", 8, 2)}
    assert runs[0] == (tuple(f"features/conv_{i}" for i in range(4)), "store")
    stored = tuple(sorted(store.values()))
    assert sc.value_and_grad(choice) < sc.value_and_grad(stored)
    x2 = jax.random.normal(jax.random.key(7), x.shape)
    g0 = jax.jit(jax.grad(loss))(params, x2)
    g1 = jax.jit(jax.grad(sc.build(choice)))(params, x2)
    assert _rel(g1, g0) < 1e-5
