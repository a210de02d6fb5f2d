"""jaxmem.schedule.optimize keeps its time limit on big graphs and returns a valid plan.

Behaviour, not a benchmark: the bounds below are generous. Wall times are measured by
``benchmarks/schedule/time_limit.py``.
"""
from __future__ import annotations

import random
import time

import pytest

from jaxmem.schedule import Graph, check_placement, lifetimes, optimize, place, simulate
from jaxmem.schedule.testgraphs import chain, random_dag


def _check_plan(g: Graph, plan) -> None:
    g.check_order(plan.order)
    assert plan.peak == simulate(g, plan.order)
    assert plan.lower_bound <= plan.peak <= plan.baseline_peak
    spans = lifetimes(g, plan.order, check=False)
    sp = [(g.edges[k].size, *spans[k]) for k in spans]
    addrs = [plan.addresses[k] for k in spans]
    assert all(a + s <= plan.arena_size for a, (s, _, _) in zip(addrs, sp))
    check_placement(sp, addrs)


@pytest.mark.slow
def test_big_chain_returns_within_its_time_limit():
    g = chain(5000)
    t = time.perf_counter()
    plan = optimize(g, time_limit=2)
    wall = time.perf_counter() - t
    assert wall < 2 + 30, wall  # generous: the promise is time_limit + linear overhead
    _check_plan(g, plan)
    assert plan.peak == plan.baseline_peak == plan.lower_bound  # a chain has one order


@pytest.mark.slow
def test_random_dag_returns_within_its_time_limit():
    g = random_dag(1500)
    t = time.perf_counter()
    plan = optimize(g, time_limit=2)
    wall = time.perf_counter() - t
    assert wall < 2 + 30, wall
    _check_plan(g, plan)


def test_place_keeps_a_valid_first_plan_under_a_tiny_time_limit():
    rng = random.Random(0)
    sp = []
    for _ in range(3000):
        a = rng.randint(0, 2000)
        sp.append((4 * rng.randint(1, 50), a, a + rng.randint(0, 40)))
    t = time.perf_counter()
    info = place(sp, time_limit=0.01, return_info=True)
    assert time.perf_counter() - t < 20
    assert info.arena_size >= info.lower_bound
    assert all(a + s <= info.arena_size for a, (s, _, _) in zip(info.addresses, sp))
    check_placement(sp, info.addresses)
