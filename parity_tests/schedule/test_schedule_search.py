"""Block relocation (search) and antichain bounds (proofs): exactness against brute force."""
from __future__ import annotations

import random

import numpy as np
import pytest
from test_schedule_core import _random_weighted_graph, brute_force_peak, random_graph

from jaxmem.schedule import Graph, optimize, simulate, validate_plan
from jaxmem.schedule.bounds import antichain_lower_bound, cut_lower_bound
from jaxmem.schedule.order import best_greedy_order, improve_order
from jaxmem.schedule.relocate import (
    _candidate_blocks,
    _Tensors,
    insertion_peaks,
    relocate_blocks,
)


def backward_graph(acts: list[int], weights: list[int], fused: bool) -> Graph:
    """A training step in miniature: forward chain ``f_l`` saving activation ``a_l``, a
    loss, backward chain ``b_L..b_1``, SGD update chains ``mul_l -> add_l`` writing the new
    weight (a step output; weights donated). ``fused``: the weight gradient comes out of
    ``b_l`` (torch's ``convolution_backward``); otherwise a separate ``dw_l`` (JAX)."""
    g = Graph()
    L = len(acts)
    for k in range(L):
        g.add_node(f"w{k}", kind="input")
    g.add_node("x", kind="input")
    for k in range(L):
        g.add_node(f"f{k}")
    g.add_node("loss")
    for k in reversed(range(L)):
        g.add_node(f"b{k}")
        if not fused:
            g.add_node(f"dw{k}")
        g.add_node(f"mul{k}")
        g.add_node(f"add{k}", kind="update")
    g.add_edge("x_in", "x", ["f0"], 8, persistent=True)
    dw = (lambda k: []) if fused else (lambda k: [f"dw{k}"])
    for k in range(L):
        g.add_edge(f"W{k}", f"w{k}", [f"f{k}", f"b{k}", f"add{k}"], weights[k])
        nxt = f"f{k + 1}" if k + 1 < L else "loss"
        g.add_edge(f"a{k}", f"f{k}", [nxt, f"b{k}", *dw(k)], acts[k])
    g.add_edge("dy_top", "loss", [f"b{L - 1}", *dw(L - 1)], acts[-1])
    for k in reversed(range(L)):
        if k > 0:
            g.add_edge(f"dy{k}", f"b{k}", [f"b{k - 1}", *dw(k - 1)], acts[k - 1])
        g.add_edge(f"G{k}", f"b{k}" if fused else f"dw{k}", [f"mul{k}"], weights[k])
        g.add_edge(f"T{k}", f"mul{k}", [f"add{k}"], weights[k])
        g.add_edge(f"N{k}", f"add{k}", [], weights[k], output=True)
    g.validate()
    return g


def _random_topological(g: Graph, rng: random.Random) -> list[str]:
    preds = {v: set(g.preds(v)) for v in g.nodes}
    done: set[str] = set()
    order = []
    while len(order) < len(preds):
        ready = [v for v in g.nodes if v not in done and preds[v] <= done]
        v = rng.choice(ready)
        done.add(v)
        order.append(v)
    return order


def test_insertion_peaks_equal_simulation_for_every_block_and_position():
    rng = random.Random(1)
    checked = 0
    for k in range(60):
        g = random_graph(rng, rng.randint(3, 12)) if k % 2 else \
            _random_weighted_graph(rng, rng.randint(3, 10))
        names = list(g.nodes)
        idx = {v: i for i, v in enumerate(names)}
        ts = _Tensors(g, names)
        preds = [[idx[p] for p in g.preds(v)] for v in names]
        succs = [[idx[s] for s in g.succs(v)] for v in names]
        seq = np.asarray([idx[v] for v in _random_topological(g, rng)])
        for blocks in _candidate_blocks(g, names, 16):
            for _u, blk in blocks:
                in_block = np.zeros(len(names), dtype=bool)
                in_block[blk] = True
                rest, block, xs, peaks = insertion_peaks(ts, seq, in_block, preds, succs)
                feasible = set(xs.tolist())
                for x in range(len(rest) + 1):
                    order = [names[i] for i in np.concatenate([rest[:x], block, rest[x:]])]
                    if x in feasible:
                        assert simulate(g, order) == peaks[xs.tolist().index(x)]
                        checked += 1
                    else:
                        with pytest.raises(ValueError):
                            g.check_order(order)
    assert checked > 1000


def test_relocate_blocks_is_valid_never_worse_and_above_the_optimum():
    rng = random.Random(4)
    improved = 0
    for k in range(16):
        g = random_graph(rng, 8) if k % 2 else _random_weighted_graph(rng, 7)
        start = _random_topological(g, rng)
        order, peak = relocate_blocks(g, start, time_budget=1.0)
        g.check_order(order)
        assert peak == simulate(g, order)
        assert brute_force_peak(g) <= peak <= simulate(g, start)
        improved += peak < simulate(g, start)
    assert improved >= 3


def test_relocate_blocks_moves_weight_update_chains_off_the_plateau():
    # JAX-style step: the weight gradient is its own node, so the chain dw -> mul -> add
    # can run late, when the activations are gone; single-node moves cannot get there
    g = backward_graph([40, 20, 20], [10, 50, 50], fused=False)
    order, _peak, _rule = best_greedy_order(g)
    local, local_peak = improve_order(g, order, time_budget=1.0)
    moved, moved_peak = relocate_blocks(g, local, time_budget=2.0)
    g.check_order(moved)
    assert local_peak == 298
    assert moved_peak == 288
    # and 288 is optimal: the antichain bound proves it (brute force would enumerate
    # 2.4 million orders)
    assert antichain_lower_bound(g, list(g.nodes), max_size=6) == 288


def test_antichain_bound_is_valid_and_never_below_its_floor():
    rng = random.Random(7)
    stronger = 0
    for k in range(30):
        if k % 3 == 2:  # small training steps with random sizes
            g = backward_graph([rng.randint(5, 50) for _ in range(2)],
                               [rng.randint(5, 80) for _ in range(2)], fused=bool(k % 2))
        else:
            g = random_graph(rng, rng.randint(4, 8)) if k % 2 else _random_weighted_graph(rng, 6)
        best = brute_force_peak(g)
        cut = cut_lower_bound(g)
        anti = antichain_lower_bound(g, list(g.nodes), max_size=4, floor=cut)
        assert cut <= anti <= best
        stronger += anti > cut
    assert stronger >= 2


def test_antichain_bound_certifies_a_fused_backward_where_one_cut_cannot():
    # torch-style step: b_l emits the weight gradient, so the big update sits either on
    # the activation plateau or keeps its gradient alive into the next layer's backward;
    # one cut per node lets each node assume the other choice, a pair does not
    g = backward_graph([40, 20, 20], [10, 50, 50], fused=True)
    best = brute_force_peak(g)
    assert best == 298
    assert cut_lower_bound(g) < best
    assert antichain_lower_bound(g, list(g.nodes), max_size=3) == best
    plan = optimize(g, time_limit=5, placement=False, gap_limit=0.0)
    validate_plan(g, plan)
    assert plan.peak == plan.lower_bound == best
    assert plan.status == "OPTIMAL"


def test_antichain_bound_arguments():
    g = backward_graph([25, 25], [60, 60], fused=True)
    assert antichain_lower_bound(g, [], floor=17) == 17
    with pytest.raises(ValueError, match="not nodes of the graph"):
        antichain_lower_bound(g, ["no such node"])
    with pytest.raises(ValueError):
        relocate_blocks(g, list(reversed(list(g.nodes))))


def _random_spans(seed: int):
    rng = random.Random(seed)
    n, steps = rng.randint(8, 16), rng.randint(6, 12)
    spans = []
    for _ in range(n):
        a = rng.randrange(steps)
        b = rng.randrange(a, steps)
        spans.append((rng.choice([1, 2, 3, 4, 5, 6, 8]) * 4, a, b))
    return spans


def test_window_placement_is_valid_and_reaches_the_peak_where_greedy_cannot():
    import importlib

    P = importlib.import_module("jaxmem.schedule.place")
    for seed in range(40):  # whatever it returns is a valid placement
        sp = _random_spans(seed)
        n = len(sp)
        by_size = sorted(range(n), key=lambda i: -sp[i][0])
        res = P._window_place(sp, P.peak_of_spans(sp), 1.0, 2, orders=[by_size])
        if res is not None:
            P.check_placement(sp, res[0])
            assert res[1] == max(a + sp[i][0] for i, a in enumerate(res[0]))
            assert res[1] >= P.peak_of_spans(sp)
    # an instance (found by search) where every greedy rule fragments the arena, and the
    # exact core around the peak + greedy completion reaches zero fragmentation
    sp = _random_spans(2909)
    lb = P.peak_of_spans(sp)
    by_size = sorted(range(len(sp)), key=lambda i: (-sp[i][0], -(sp[i][2] - sp[i][1]), sp[i][1]))
    assert P._greedy_by_size(sp, by_size)[1] > lb and P._first_fit(sp, by_size)[1] > lb
    addrs, arena = P._window_place(sp, lb, 5.0, 2, orders=[by_size])
    P.check_placement(sp, addrs)
    assert arena == lb
    info = P.place(sp, time_limit=5, return_info=True)
    P.check_placement(sp, info.addresses)
    assert info.arena_size == lb and info.optimal
