"""jaxmem.rowconv on the H100 plan: a row-tiled conv trunk's compiled bytes fall as the
number of row tiles grows, in both tiling modes."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from _gp_util import plan, rand

from jaxmem import rowconv as rc

SHAPE = (1, 64, 32, 8)
LAYERS = [rc.Conv(8, 3), rc.Act(jax.nn.relu)] * 4
ROWS = {"overlap": (1, 2, 8), "share": (1, 8)}


@pytest.fixture(scope="module")
def temp():
    p = rc.init(LAYERS, jax.random.PRNGKey(0), SHAPE)
    x = rand(1, SHAPE)

    def step(rows, mode):
        return lambda p, x: jax.grad(
            lambda p: jnp.mean(rc.apply(LAYERS, p, x, rows=rows, mode=mode) ** 2))(p)

    return {(mode, n): plan(step(n, mode), p, x).temp_bytes
            for mode, rows in ROWS.items() for n in rows}


@pytest.mark.parametrize("mode", sorted(ROWS))
def test_trunk_bytes_fall_with_rows(temp, mode):
    b = [temp[(mode, n)] for n in ROWS[mode]]
    assert all(hi > lo for hi, lo in itertools.pairwise(b)), (mode, b)
    assert b[0] >= 1.5 * b[-1], (mode, b)  # 8 tiles: at least a third less
