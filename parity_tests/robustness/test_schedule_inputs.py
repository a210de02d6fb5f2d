"""jaxmem.schedule: bad input is refused with a clear error; edge cases give valid plans."""
from __future__ import annotations

import math

import numpy as np
import pytest

from jaxmem.schedule import (
    Graph,
    GraphError,
    best_fit_online,
    check_placement,
    optimize,
    peak_of_spans,
    place,
    simulate,
    validate_plan,
)
from jaxmem.schedule.ilp import solve_order, solve_order_cumulative


def _two_nodes() -> Graph:
    g = Graph()
    g.add_node("a")
    g.add_node("b")
    return g


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("bad", [2.7, 3.0, np.float32(4.0), "8", None, True, np.bool_(True)])
def test_add_edge_refuses_non_integer_sizes(bad):
    g = _two_nodes()
    with pytest.raises(TypeError, match="size must be an int"):
        g.add_edge("e", "a", ["b"], bad)
    assert not g.edges  # nothing half-added


@pytest.mark.parametrize("good", [5, np.int64(5), np.int32(5), np.uint8(5)])
def test_add_edge_accepts_python_and_numpy_ints(good):
    g = _two_nodes()
    g.add_edge("e", "a", ["b"], good)
    assert g.edges["e"].size == 5 and type(g.edges["e"].size) is int


def test_negative_sizes_are_refused_everywhere():
    g = _two_nodes()
    with pytest.raises(GraphError, match=">= 0"):
        g.add_edge("e", "a", ["b"], -1)
    for fn in (place, peak_of_spans, best_fit_online):
        with pytest.raises(ValueError, match=">= 0"):
            fn([(-4, 0, 1)])
    with pytest.raises(ValueError, match=">= 0"):
        check_placement([(-4, 0, 1)], [0])


def test_place_refuses_fractional_sizes_instead_of_truncating():
    # regression: 2.7 bytes truncated to 2 gave an arena too small for the tensor
    for fn in (place, peak_of_spans, best_fit_online):
        with pytest.raises(TypeError, match="size must be an int"):
            fn([(2.7, 0, 1), (3, 1, 2)])
    with pytest.raises(TypeError, match="size must be an int"):
        check_placement([(2.7, 0, 1)], [0])
    with pytest.raises(TypeError, match="steps must be ints"):
        place([(4, 0.5, 1)])
    with pytest.raises(TypeError, match="size must be an int"):
        place({"x": (True, 0, 1)})
    addrs, arena = place([(np.int64(3), np.int32(0), 1), (3, 1, 2)], time_limit=1)
    assert arena == 6 and all(type(a) is int for a in addrs)


def test_check_placement_refuses_mismatched_addresses():
    with pytest.raises(ValueError, match="addresses"):
        check_placement([(4, 0, 1), (4, 0, 1)], [0])
    with pytest.raises(TypeError, match="addresses"):
        check_placement([(4, 0, 1)], [0.5])


# --------------------------------------------------------------------------- graph API
def test_add_edge_sinks_none_and_bad_names_are_type_errors():
    g = _two_nodes()
    with pytest.raises(TypeError, match="sinks"):
        g.add_edge("e", "a", None, 4)
    with pytest.raises(TypeError, match="sinks"):
        g.add_edge("e", "a", 7, 4)
    with pytest.raises(TypeError, match="sinks"):
        g.add_edge("e", "a", ["b", 3], 4)
    with pytest.raises(TypeError, match="src"):
        g.add_edge("e", ["a"], ["b"], 4)
    with pytest.raises(TypeError, match="name"):
        g.add_edge(None, "a", ["b"], 4)
    with pytest.raises(TypeError, match="name"):
        g.add_node(3)
    with pytest.raises(TypeError, match="kind"):
        g.add_node("c", kind=None)
    assert not g.edges and list(g.nodes) == ["a", "b"]
    g.add_edge("e", "a", "b", 4)  # a single name is one sink
    g.add_edge("f", "a", ("b", "b"), 4)  # duplicates merged
    assert g.edges["f"].sinks == ("b",)


def test_unknown_names_raise_graph_errors_naming_them():
    g = _two_nodes()
    g.add_edge("e", "a", ["b"], 4)
    for method in ("fanin", "fanout", "preds", "succs"):
        with pytest.raises(GraphError, match="'zz' is not a node"):
            getattr(g, method)("zz")
        with pytest.raises(GraphError, match="is not a node"):
            getattr(g, method)(["a"])
    with pytest.raises(GraphError, match="'nope' is not an edge"):
        g.add_sinks("nope", ["b"])
    with pytest.raises(TypeError, match="sinks"):
        g.add_sinks("e", None)
    with pytest.raises(GraphError, match="sink 'q'"):
        g.add_sinks("e", ["q"])
    with pytest.raises(GraphError, match="duplicate edge"):
        g.add_edge("e", "a", ["b"], 4)
    with pytest.raises(TypeError, match="order"):
        g.check_order(None)
    with pytest.raises(TypeError, match="node names must be str"):
        g.check_order(["a", ["b"]])


def test_cycle_error_names_the_cycle():
    g = Graph()
    for v in "xabcd":
        g.add_node(v)
    g.add_edge("xa", "x", ["a"], 4)
    g.add_edge("ab", "a", ["b"], 4)
    g.add_edge("bc", "b", ["c"], 4)
    g.add_edge("ca", "c", ["a"], 4)
    g.add_edge("cd", "c", ["d"], 4)  # downstream of the cycle, not on it
    with pytest.raises(GraphError, match=r"cycle: a -> b -> c -> a"):
        g.validate()
    with pytest.raises(GraphError, match="cycle"):
        optimize(g, time_limit=1)


# --------------------------------------------------------------------------- time limits
@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, "5", None, True, np.bool_(True)])
def test_time_limits_must_be_finite_positive_numbers(bad):
    g = _two_nodes()
    g.add_edge("e", "a", ["b"], 4)
    with pytest.raises(ValueError, match="time_limit"):
        optimize(g, time_limit=bad)
    with pytest.raises(ValueError, match="time_limit"):
        place([(4, 0, 1)], time_limit=bad)
    with pytest.raises(ValueError, match="time_limit"):
        solve_order(g, time_limit=bad)


def test_numpy_time_limits_are_accepted():
    g = _two_nodes()
    g.add_edge("e", "a", ["b"], 4)
    plan = optimize(g, time_limit=np.float32(1.0), place_time_limit=np.int64(1))
    validate_plan(g, plan)


# --------------------------------------------------------------------------- edge cases
def test_empty_and_single_node_graphs():
    g = Graph()
    plan = optimize(g, time_limit=1)
    assert plan.order == [] and plan.peak == 0 and plan.arena_size == 0
    assert solve_order(g, time_limit=1).order == []
    assert solve_order_cumulative(g, time_limit=1).order == []
    g.add_node("only")
    g.add_edge("w", "only", [], 8, persistent=True)
    g.add_edge("out", "only", [], 4, output=True)
    plan = optimize(g, time_limit=1)
    assert plan.order == ["only"] and plan.peak == 12 == simulate(g) and plan.optimal
    validate_plan(g, plan)
    for fn in (solve_order, solve_order_cumulative):
        res = fn(g, time_limit=1)
        assert res.order == ["only"] and res.objective == 12


def _diamond() -> Graph:
    g = Graph()
    for v in "ABCDEFG":
        g.add_node(v)
    for name, s, d, size in [("ab", "A", "B", 10), ("bc", "B", "C", 20), ("bd", "B", "D", 30),
                             ("de", "D", "E", 40), ("ef", "E", "F", 50), ("cf", "C", "F", 60),
                             ("fg", "F", "G", 10)]:
        g.add_edge(name, s, [d], size)
    return g


def test_solver_time_out_gives_the_documented_fallback(monkeypatch):
    from ortools.sat.python import cp_model

    class NoSolution(cp_model.CpSolver):
        def Solve(self, model, *a, **k):  # CP-SAT's method name
            return cp_model.UNKNOWN

    monkeypatch.setattr(cp_model, "CpSolver", NoSolution)
    g = _diamond()
    for fn in (solve_order, solve_order_cumulative):
        res = fn(g, time_limit=1)  # no hint: Kahn's order
        assert res.status == "UNKNOWN" and res.objective is None
        g.check_order(res.order)
        hint = list("ABDECFG")
        res = fn(g, hint=hint, time_limit=1)
        assert res.order == hint and res.objective is None
    with pytest.raises(ValueError, match="topological"):
        solve_order(g, hint=list("BACDEFG"), time_limit=1)
    plan = optimize(g, time_limit=2, local_search=False, gap_limit=0)
    validate_plan(g, plan)
    assert plan.peak >= 130 and plan.method != "ilp"


def test_simulate_checks_empty_and_one_shot_orders():
    g = _diamond()
    with pytest.raises(ValueError, match="every node"):
        simulate(g, [])  # regression: an empty order must not report a peak of 0
    assert simulate(g, iter("ABCDEFG")) == simulate(g, list("ABCDEFG")) == 150
    assert simulate(Graph(), []) == 0


def test_optimize_refuses_bad_gap_limit_and_workers():
    g = _diamond()
    for bad in (float("nan"), 1, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="gap_limit"):
            optimize(g, time_limit=1, gap_limit=bad)
    for bad in (0, 1.5, True, None):
        with pytest.raises(ValueError, match="num_workers"):
            optimize(g, time_limit=1, num_workers=bad)
    plan = optimize(g, time_limit=2, gap_limit=np.float32(0.0), num_workers=np.int64(1))
    assert plan.peak == 130
