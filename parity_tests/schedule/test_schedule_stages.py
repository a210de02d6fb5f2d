"""The named stages of the scheduler: free-block bookkeeping, ILP objective domain,
reachability closure, the analysis re-exports and the seeded test graphs."""
from __future__ import annotations

import itertools

import pytest

from jaxmem.schedule import Graph, analysis, optimize, simulate
from jaxmem.schedule.bounds import antichain_lower_bound, cut_lower_bound, structural_lower_bound
from jaxmem.schedule.ilp import (
    _objective_bounds,
    _scaled_sizes,
    solve_order,
    solve_order_cumulative,
)
from jaxmem.schedule.inplace import expand_order, inplace_update_graph
from jaxmem.schedule.place import _release_block, _take_best_fit
from jaxmem.schedule.reach import Reach, edge_ranges, spans
from jaxmem.schedule.testgraphs import chain, random_dag
from jaxmem.schedule.updates import add_early_update_edges, levels


def test_analysis_reexports_the_names_of_their_modules():
    moved = {"Reach": Reach, "spans": spans, "edge_ranges": edge_ranges, "levels": levels,
             "add_early_update_edges": add_early_update_edges,
             "structural_lower_bound": structural_lower_bound,
             "cut_lower_bound": cut_lower_bound, "antichain_lower_bound": antichain_lower_bound,
             "inplace_update_graph": inplace_update_graph, "expand_order": expand_order}
    for name, obj in moved.items():
        assert getattr(analysis, name) is obj
    assert set(analysis.__all__) == set(moved)


def test_release_block_merges_neighbours_and_lowers_the_top():
    free = [(0, 8), (16, 24)]
    assert _release_block(free, 40, 8, 16) == 40  # bridges both neighbours
    assert free == [(0, 24)]
    assert _release_block(free, 40, 24, 40) == 0  # reaches the top: the arena shrinks
    assert free == []
    free = [(0, 4)]
    assert _release_block(free, 40, 10, 12) == 40  # no neighbour: inserted in order
    assert free == [(0, 4), (10, 12)]


def test_take_best_fit_takes_the_smallest_block_that_fits():
    free = [(0, 16), (20, 26), (30, 36)]
    assert _take_best_fit(free, 40, 4) == (20, 40)  # first of the two 6-byte blocks
    assert free == [(0, 16), (24, 26), (30, 36)]
    assert _take_best_fit(free, 40, 6) == (30, 40)  # exact fit: the block is gone
    assert free == [(0, 16), (24, 26)]
    assert _take_best_fit(free, 40, 32) == (40, 72)  # nothing fits: on top


def _graph_with_persistent() -> Graph:
    g = Graph()
    for v in "abc":
        g.add_node(v)
    g.add_edge("w", "a", ["c"], 100, persistent=True)
    g.add_edge("x", "a", ["b"], 8)
    g.add_edge("y", "b", ["c"], 12)
    return g


def test_objective_domain_is_in_units_without_persistent_bytes():
    g = _graph_with_persistent()
    sizes, unit = _scaled_sizes(g)
    assert sorted(sizes) == [8, 12] and unit == 4
    assert _objective_bounds(g, sizes, unit, None, None) == (0, 5)
    # upper bound floored, lower bound rounded up, both after removing 100 persistent bytes
    assert _objective_bounds(g, sizes, unit, 115, 105) == (2, 3)
    # a lower bound above the upper bound is clipped to it; an upper bound below the
    # persistent bytes leaves the single value 0
    assert _objective_bounds(g, sizes, unit, 111, 200) == (2, 2)
    assert _objective_bounds(g, sizes, unit, 50, None) == (0, 0)


def test_scaled_sizes_of_a_graph_without_memory_is_unit_one():
    g = Graph()
    g.add_node("a")
    g.add_node("b")
    g.add_edge("c", "a", ["b"], 0)
    assert _scaled_sizes(g) == ([], 1)


def test_reach_bitsets_are_the_transitive_closure():
    g = random_dag(40, seed=3, reach=5)
    r = Reach(g)
    succ = {v: set(g.succs(v)) for v in g.nodes}
    for u, v in itertools.product(g.nodes, repeat=2):
        seen, todo = set(), [u]
        while todo:  # plain DFS from u
            for s in succ[todo.pop()] - seen:
                seen.add(s)
                todo.append(s)
        assert r.reaches(u, v) == (v in seen)
        assert bool(r.anc[r.index[v]] >> r.index[u] & 1) == (v in seen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_ilp_models_reach_the_brute_force_optimum(seed):
    g = random_dag(8, seed=seed, reach=3)
    best = min(simulate(g, o) for o in itertools.permutations(g.nodes)
               if _topological(g, o))
    for fn in (solve_order, solve_order_cumulative):
        res = fn(g, hint=g.topological_order(), time_limit=10, num_workers=1)
        assert res.status == "OPTIMAL"
        assert res.objective == res.bound == simulate(g, res.order) == best


def test_solve_order_formulation_selects_the_model():
    """``solve_order(formulation=...)`` is the one entry point of both ILP models;
    ``solve_order_cumulative`` is the compact one, and an unknown name is refused."""
    g = random_dag(8, seed=3, reach=3)
    olla = solve_order(g, time_limit=10, num_workers=1)
    compact = solve_order(g, time_limit=10, num_workers=1, formulation="cumulative")
    alias = solve_order_cumulative(g, time_limit=10, num_workers=1)
    assert olla.status == compact.status == alias.status == "OPTIMAL"
    assert olla.objective == compact.objective == alias.objective
    assert compact.num_vars == alias.num_vars != olla.num_vars  # a different model
    with pytest.raises(ValueError, match="formulation.*'olla'.*'cumulative'.*'compact'"):
        solve_order(g, time_limit=1, formulation="compact")


def _topological(g: Graph, order) -> bool:
    pos = {v: i for i, v in enumerate(order)}
    return all(pos[e.src] < pos[s] for e in g.edges.values() for s in e.sinks)


def test_chain_has_one_order_and_optimize_proves_it():
    g = chain(50)
    plan = optimize(g, time_limit=5, num_workers=1)
    assert plan.order == [f"n{i}" for i in range(50)]
    assert plan.peak == plan.baseline_peak == plan.lower_bound == plan.arena_size
