"""Regression tests for rowconv configurations found by the wider hypothesis runs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _assert import assert_tree_close
from _rc_params import random_params
from _rc_util import normal, value_and_grads

from jaxmem import rowconv as rc


def _lagging_stack():
    # stride-2 'SAME' conv followed by a dilated VALID conv (effective height 11) that is
    # taller than its 10-row output: in share mode the output stream lags by 12 rows, so
    # with rows=2 a tile has 11 output rows, more than the whole 10-row output map (this
    # regression: failed at trace time with a TypeError from dynamic_slice).
    return [rc.Conv(2, 3, strides=1, kernel_dilation=1, padding="SAME", use_bias=True),
            rc.Conv(2, (2, 1), strides=2, kernel_dilation=(1, 1), padding="SAME",
                    use_bias=True),
            rc.Act(jax.nn.relu),
            rc.Conv(2, (6, 1), strides=1, kernel_dilation=(2, 1), padding="VALID",
                    use_bias=True),
            rc.Act(jax.nn.relu)]


SHAPE = (1, 40, 5, 2)


def _check(layers, shape, rows, mode, rows_bp=None):
    with jax.enable_x64(True):
        x = normal(shape, 7, jnp.float64)
        params = random_params(layers, shape, seed=3, dtype=jnp.float64)
        y1, (l1, g1) = value_and_grads(layers, params, x, 1)
        yn, (ln, gn) = value_and_grads(layers, params, x, rows, mode, rows_bp)
        assert yn.shape == y1.shape
        assert_tree_close((yn, ln, gn), (y1, l1, g1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rows,rows_bp", [(2, None), (2, 1), (1, 2)])
def test_tile_taller_than_output_exact(rows, rows_bp):
    # share mode only: at this height overlap admits no tiling (max_rows == 1, see below)
    layers = _lagging_stack()
    assert rc.output_shape(layers, SHAPE)[1] == 10
    assert rc.halos(layers, SHAPE, 2, "share").tile_rows > 10
    _check(layers, SHAPE, rows, "share", rows_bp)


@pytest.mark.parametrize("mode,rows", [("overlap", 2), ("share", 3)])
def test_tile_taller_than_output_too_many_rows_is_value_error(mode, rows):
    # rows beyond halos(...).max_rows: the tile is smaller than its halo -> a clear
    # ValueError naming rows (never an internal TypeError).
    layers = _lagging_stack()
    assert rows > rc.halos(layers, SHAPE, 1, mode).max_rows
    params = random_params(layers, SHAPE)
    x = normal(SHAPE, 0)
    with pytest.raises(ValueError, match="rows="):
        rc.apply(layers, params, x, rows=rows, mode=mode)


@pytest.mark.parametrize("mode", rc.MODES)
def test_lagging_stack_taller_image_exact(mode):
    # the same stack on a taller image, where both modes admit tiling
    layers = _lagging_stack()
    shape = (1, 64, 5, 2)
    rows = min(3, rc.halos(layers, shape, 1, mode).max_rows)
    assert rows >= 2
    _check(layers, shape, rows, mode)
