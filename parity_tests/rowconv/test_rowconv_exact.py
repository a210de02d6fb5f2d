"""rowconv outputs and gradients (input + every parameter) equal the untiled stack."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _assert import assert_tree_close
from _rc_params import random_params
from _rc_util import normal, value_and_grads
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxmem import rowconv as rc

MIXED = [rc.Conv(4, 3), rc.Act(jnp.tanh),
         rc.Conv(5, 3, strides=2), rc.Act(jax.nn.relu),
         rc.Pool("max", 2),
         rc.Conv(3, (5, 3), kernel_dilation=2, padding=((2, 3), (1, 1)),
                 feature_group_count=1)]
RESID = [rc.Conv(4, 3),
         rc.Residual([rc.Conv(4, 3), rc.Affine(4), rc.Act(jnp.tanh), rc.Conv(4, 5)]),
         rc.Pool("avg", 3, 2, "SAME"),
         rc.Residual([rc.Conv(6, 3, strides=2, feature_group_count=2), rc.BatchNorm(6)],
                     [rc.Conv(6, 1, strides=2)]),
         rc.Dropout(0.3),
         rc.Conv(2, 3, padding="VALID")]


_UNTILED = {}


def _check(layers, shape, rows, mode, rows_bp=None, rng=None, ref=None):
    """Tiled (``rows``, ``mode``, ``rows_bp``) equals untiled in float64. ``ref`` names the
    stack when several tests share it: its untiled result is computed (and compiled) once."""
    with jax.enable_x64(True):
        x = normal(shape, 1, jnp.float64)
        params = random_params(layers, shape, dtype=jnp.float64)
        if ref is None or ref not in _UNTILED:
            untiled = value_and_grads(layers, params, x, 1, rng=rng)
            if ref is not None:
                _UNTILED[ref] = untiled
        y1, (l1, g1) = _UNTILED[ref] if ref is not None else untiled
        yn, (ln, gn) = value_and_grads(layers, params, x, rows, mode, rows_bp, rng)
        assert yn.shape == y1.shape
        assert_tree_close((yn, ln, gn), (y1, l1, g1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", rc.MODES)
@pytest.mark.parametrize("rows,rows_bp", [(2, None), (3, 2)])
def test_mixed_stack_exact(mode, rows, rows_bp):
    # H=190 (not divisible by N), stride 2, dilation 2, asymmetric padding, max pool; two
    # tiles (first and last only) with N_bp = N_fp, and three forward tiles (a middle tile)
    # with a different backward tiling (more tile counts: test_random_stacks_exact)
    _check(MIXED, (2, 190, 13, 3), rows, mode, rows_bp, ref="mixed")


@pytest.mark.parametrize("mode", rc.MODES)
def test_residual_groups_dropout_exact(mode):
    _check(RESID, (1, 101, 9, 4), 3, mode, rng=jax.random.PRNGKey(7), ref="resid")


@pytest.mark.parametrize("mode", rc.MODES)
def test_hybrid_segments_exact(mode):
    layers = MIXED[:4] + [rc.Checkpoint()] + MIXED[4:]
    _check(layers, (1, 190, 13, 3), [3, 2], mode, rows_bp=[2, 3], ref="hybrid")


def test_float32_tolerance():
    # three tiles (first, middle, last): each more tile is more program to compile
    layers = MIXED
    shape = (1, 150, 13, 3)
    x = normal(shape, 1)
    params = random_params(layers, shape)
    y1, (_, g1) = value_and_grads(layers, params, x, 1)
    for mode in rc.MODES:
        yn, (_, gn) = value_and_grads(layers, params, x, 3, mode)
        assert_tree_close((yn, gn), (y1, g1), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- hypothesis

PADS = st.sampled_from(["SAME", "VALID", ((1, 0), (0, 1)), ((0, 2), (1, 1)), 1])


@st.composite
def layer_st(draw, c):
    kind = draw(st.sampled_from(["conv", "conv", "pool", "res"]))
    if kind == "conv":
        k = draw(st.integers(1, 7))
        return rc.Conv(c, (k, draw(st.integers(1, 3))), strides=draw(st.integers(1, 2)),
                       kernel_dilation=(draw(st.integers(1, 2)), 1), padding=draw(PADS))
    if kind == "pool":
        w = draw(st.integers(2, 3))
        return rc.Pool(draw(st.sampled_from(["max", "avg"])), w, draw(st.integers(1, 2)),
                       draw(st.sampled_from(["VALID", "SAME"])))
    s = draw(st.integers(1, 2))
    short = None if s == 1 else [rc.Conv(c, 1, strides=2)]
    return rc.Residual([rc.Conv(c, 3, strides=s), rc.Act(jnp.tanh),
                        rc.Conv(c, draw(st.sampled_from([1, 3, 5])))], short)


@st.composite
def stack_st(draw):
    c = draw(st.integers(2, 3))
    n = draw(st.integers(1, 3))
    layers = [rc.Conv(c, 3)]
    for _ in range(n):
        layers.append(draw(layer_st(c)))
        layers.append(rc.Act(jax.nn.relu))
    H = draw(st.integers(40, 90))
    W = draw(st.integers(5, 9))
    return layers, (1, H, W, 2)


# 6 examples (each compiles two programs): both modes, with and without a separate backward
# tile count, strided convs, pools and residual blocks all come up in the derandomized run
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(stack_st(), st.sampled_from(rc.MODES), st.integers(2, 6), st.data())
def test_random_stacks_exact(stack, mode, rows, data):
    layers, shape = stack
    try:
        out = rc.output_shape(layers, shape)
        rep = rc.halos(layers, shape, 1, mode)
    except ValueError:
        assume(False)
    rows = min(rows, rep.max_rows)
    assume(rows >= 2 and out[1] >= 2)
    rows_bp = data.draw(st.sampled_from([None, max(1, rows - 1)]))
    if rows_bp == 1:
        rows_bp = None
    _check(layers, shape, rows, mode, rows_bp)
