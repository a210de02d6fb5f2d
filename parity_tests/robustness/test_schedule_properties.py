"""jaxmem.schedule against brute force on generated graphs (hypothesis).

Graphs: random DAGs with chains, size-0 and size-1 tensors, sink-less tensors, tensors
with several sinks, persistent and output tensors, single nodes and disconnected parts,
sometimes inserted in a non-topological program order.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.schedule import (
    Graph,
    antichain_lower_bound,
    cut_lower_bound,
    lifetimes,
    memory_profile,
    node_lower_bound,
    optimize,
    peak_of_spans,
    place,
    simulate,
    structural_lower_bound,
)

SETTINGS = {"max_examples": 30, "deadline": None, "derandomize": True}
SIZES = st.sampled_from([0, 1, 1, 2, 3, 4, 8, 13, 40, 100])


@st.composite
def graphs(draw, max_nodes: int = 7) -> Graph:
    n = draw(st.integers(1, max_nodes))
    kind = draw(st.sampled_from(["dag", "chain", "parts"]))
    edges = []  # (src, sinks, size, persistent, output) over node indices, src < sinks
    if kind == "chain":
        for i in range(n - 1):
            edges.append((i, [i + 1], draw(SIZES), False, False))
    else:
        cut = draw(st.integers(1, n)) if kind == "parts" else n  # [0, cut) and [cut, n)
        for i in range(n):
            hi = cut if i < cut else n
            for _ in range(draw(st.integers(0, 2))):
                later = list(range(i + 1, hi))
                sinks = draw(st.lists(st.sampled_from(later), max_size=3, unique=True)) \
                    if later else []
                edges.append((i, sinks, draw(SIZES), draw(st.booleans()) and
                               draw(st.integers(0, 4)) == 0, draw(st.integers(0, 5)) == 0))
    # insertion order: usually topological (the program order), sometimes shuffled
    perm = list(range(n))
    if draw(st.integers(0, 3)) == 0:
        perm = draw(st.permutations(perm))
    g = Graph()
    for i in perm:
        g.add_node(f"v{i}")
    for k, (s, sinks, size, pers, out) in enumerate(edges):
        g.add_edge(f"e{k}", f"v{s}", [f"v{j}" for j in sinks], size,
                   persistent=pers, output=out and not pers)
    return g


def all_orders(g: Graph):
    preds = {v: set(g.preds(v)) for v in g.nodes}
    for perm in itertools.permutations(g.nodes):
        seen: set[str] = set()
        ok = True
        for v in perm:
            if not preds[v] <= seen:
                ok = False
                break
            seen.add(v)
        if ok:
            yield list(perm)


def recount(g: Graph, order: list[str]) -> int:
    """Peak by the definition: at step t, every persistent tensor, and every tensor
    whose producer ran at or before t and that is still needed at or after t."""
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    peak = sum(e.size for e in g.edges.values() if e.persistent)
    for t in range(n):
        here = 0
        for e in g.edges.values():
            if e.persistent:
                here += e.size
                continue
            a = pos[e.src]
            b = n - 1 if e.output else max([pos[s] for s in e.sinks], default=a)
            if a <= t <= b:
                here += e.size
        peak = max(peak, here)
    return peak


def assert_no_overlap(spans, addrs, arena):
    for (si, ai, bi), xi in zip(spans, addrs):
        assert xi >= 0 and xi + si <= arena
    for i, j in itertools.combinations(range(len(spans)), 2):
        (si, ai, bi), (sj, aj, bj) = spans[i], spans[j]
        if si and sj and ai <= bj and aj <= bi:  # live at a common step
            assert addrs[i] + si <= addrs[j] or addrs[j] + sj <= addrs[i], (i, j)


@settings(**SETTINGS)
@given(graphs(max_nodes=9), st.randoms(use_true_random=False))
def test_simulate_equals_a_brute_force_recount(g, rnd):
    orders = list(itertools.islice(all_orders(g), 200)) if len(g) <= 7 else [g.topological_order()]
    for order in rnd.sample(orders, min(5, len(orders))):
        assert simulate(g, order) == recount(g, order)
        assert int(memory_profile(g, order).max(initial=0)) <= simulate(g, order)


@settings(**SETTINGS)
@given(graphs(max_nodes=7))
def test_optimize_is_valid_bounded_and_optimal_on_small_graphs(g):
    best = min(recount(g, o) for o in all_orders(g))
    plan = optimize(g, time_limit=5, gap_limit=0)
    g.check_order(plan.order)
    assert plan.peak == simulate(g, plan.order) == recount(g, plan.order)
    assert plan.peak == best  # exact on <= 7 nodes
    bounds = [node_lower_bound(g), structural_lower_bound(g), cut_lower_bound(g),
              antichain_lower_bound(g, list(g.nodes)), plan.lower_bound]
    assert all(b <= best for b in bounds), (bounds, best)
    try:
        g.check_order(g.program_order)
        assert plan.peak <= simulate(g, g.program_order) == plan.baseline_peak
    except ValueError:
        assert plan.baseline_peak is None
    # placement: co-live tensors never overlap and everything fits in the arena reported
    spans = lifetimes(g, plan.order)
    n = len(plan.order)
    items = [(e.size, 0, n - 1) if e.persistent else (e.size, *spans[e.name])
             for e in g.edges.values()]
    addrs = [plan.addresses[e] for e in g.edges]
    assert_no_overlap(items, addrs, plan.arena_size)
    assert plan.arena_size >= plan.peak
    assert plan.optimal == (plan.peak == plan.lower_bound and plan.arena_size == plan.peak)


@settings(**SETTINGS)
@given(graphs(max_nodes=12))
def test_optimize_without_placement_and_with_ilp_off(g):
    for kw in ({"placement": False}, {"use_ilp": False}):
        plan = optimize(g, time_limit=2, **kw)
        g.check_order(plan.order)
        assert plan.peak == recount(g, plan.order)
        assert plan.lower_bound <= plan.peak
        if plan.baseline_peak is not None:
            assert plan.peak <= plan.baseline_peak


span_lists = st.lists(
    st.tuples(SIZES, st.integers(0, 8), st.integers(0, 4)).map(lambda t: (t[0], t[1], t[1] + t[2])),
    min_size=0, max_size=14)


@settings(**SETTINGS)
@given(span_lists)
def test_place_never_overlaps_co_live_tensors(spans):
    addrs, arena = place(spans, time_limit=1)
    assert_no_overlap(spans, addrs, arena)
    assert arena == max((a + s for a, (s, _, _) in zip(addrs, spans)), default=0)
    assert arena >= peak_of_spans(spans)
    # the peak by definition: the bytes resident at the busiest step
    steps = range(max((b for _, _, b in spans), default=-1) + 1)
    assert peak_of_spans(spans) == max(
        (sum(s for s, a, b in spans if a <= t <= b) for t in steps), default=0)


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_chains(n):
    g = Graph()
    for i in range(n):
        g.add_node(f"v{i}")
    if n == 2:
        g.add_edge("e", "v0", ["v1"], 1)
    plan = optimize(g, time_limit=1)
    assert plan.peak == (1 if n == 2 else 0) and plan.optimal
