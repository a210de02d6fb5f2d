"""Bad input to jaxmem.rowconv is refused clearly, naming the argument and what is allowed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import rowconv as rc
from jaxmem.rowconv import layers as rc_layers
from jaxmem.rowconv.flax import RowSequential

SHAPE = (1, 8, 4, 2)
LAYERS = [rc.Conv(2, 3), rc.Act(jax.nn.relu)]


def _setup():
    params = rc.init(LAYERS, jax.random.PRNGKey(1), SHAPE)
    x = jax.random.normal(jax.random.PRNGKey(0), SHAPE)
    return params, x


def _height_norm(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=1, keepdims=True))


def test_act_refuses_a_height_normalisation():
    # regression: a silently different result (0.86 off untiled, no error)
    with pytest.raises(ValueError, match=r"Act\(_height_norm\) is not elementwise.*"
                                         r"elementwise=True"):
        rc.Act(_height_norm)
    with pytest.raises(TypeError, match="Act.fn must be a callable"):
        rc.Act(3.0)


def test_act_known_functions_skip_the_probe(monkeypatch):
    from jaxmem.fewbit import factory

    def boom(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(factory, "check_elementwise", boom)
    for fn in (jax.nn.relu, jax.nn.gelu, jnp.tanh, jax.nn.silu):
        rc.Act(fn)
    from flax import linen as nn

    from jaxmem import fewbit, selective
    rc.Act(nn.relu), rc.Act(fewbit.gelu), rc.Act(selective.relu)
    rc.Act(_height_norm, elementwise=True)  # the caller's word


def test_act_probes_other_callables_also_under_jit():
    fn = lambda x: 2.0 * jnp.tanh(x) + 1.0

    @jax.jit
    def f(x):
        return rc.apply([rc.Act(fn)], [{}], x, rows=2)

    x = jax.random.normal(jax.random.PRNGKey(0), SHAPE)
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(fn(x)), rtol=1e-6)


@pytest.mark.parametrize("rows", [2.5, 2.0, True, "2", None, [2.5]])
def test_rows_must_be_integers(rows):
    params, x = _setup()
    with pytest.raises(TypeError, match=r"rows(\[0\])? must be an int >= 1"):
        rc.apply(LAYERS, params, x, rows=rows)


def test_numpy_integer_rows_are_accepted():
    params, x = _setup()
    want = rc.apply(LAYERS, params, x, rows=2)
    for rows in (np.int64(2), np.int32(2), [np.int64(2)], np.array(2)):
        np.testing.assert_array_equal(np.asarray(rc.apply(LAYERS, params, x, rows=rows)),
                                      np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(rc.apply(LAYERS, params, x, rows=2, rows_bp=np.int64(4))), np.asarray(want))
    with pytest.raises(TypeError, match="rows_bp must be an int"):
        rc.apply(LAYERS, params, x, rows=2, rows_bp=2.5)
    with pytest.raises(ValueError, match="rows must be an int >= 1.*got 0"):
        rc.apply(LAYERS, params, x, rows=0)
    assert rc.halos(LAYERS, SHAPE, np.int64(2)).rows == 2
    assert rc.segment_rows(LAYERS, SHAPE, np.int64(2)) == [2]
    with pytest.raises(TypeError, match="rows must be an int"):
        rc.segment_rows(LAYERS, SHAPE, 2.5)


def test_nchw_input_names_the_layout():
    params, x = _setup()
    with pytest.raises(ValueError, match=r"layers\[0\] \(Conv\).*input \(1, 2, 8, 4\).*NHWC"):
        rc.apply(LAYERS, params, jnp.transpose(x, (0, 3, 1, 2)), rows=2)
    # no kernel to compare with: the row-count error says how the shape was read
    with pytest.raises(ValueError, match=r"more than the 2 output rows.*\(1, 2, 8, 4\).*NHWC"):
        rc.apply([rc.Act(jax.nn.relu)], [{}], jnp.transpose(x, (0, 3, 1, 2)), rows=4)
    with pytest.raises(ValueError, match="NHWC array"):
        rc.apply(LAYERS, params, x[0], rows=2)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_non_float_input_is_refused(dtype):
    params, x = _setup()
    for layers, p in ((LAYERS, params), ([rc.Pool("max", 2)], [{}])):
        with pytest.raises(TypeError, match=r"x must be a floating array.*astype"):
            rc.apply(layers, p, x.astype(dtype), rows=2)


def test_params_missing_or_extra_entries_name_the_layer():
    params, x = _setup()
    with pytest.raises(ValueError, match=r"layers\[0\] \(Conv\): params has no 'kernel'"):
        rc.apply(LAYERS, [{"bias": params[0]["bias"]}, {}], x, rows=2)
    with pytest.raises(ValueError, match=r"layers\[0\] \(Conv\): params has no 'kernel'"):
        rc.apply(LAYERS, [{"bias": params[0]["bias"]}, {}], x, rows=1)
    nobias = [rc.Conv(2, 3, use_bias=False), rc.Act(jax.nn.relu)]
    with pytest.raises(ValueError, match=r"entries \['bias'\] this layer does not use"):
        rc.apply(nobias, params, x, rows=2)
    bad = [dict(params[0], bias=jnp.zeros(3)), {}]
    with pytest.raises(ValueError, match=r"params\['bias'\] has shape \(3,\), expected \(2,\)"):
        rc.apply(LAYERS, bad, x, rows=2)
    res = [rc.Residual([rc.Conv(2, 3), rc.Affine(2)])]
    rp = rc.init(res, jax.random.PRNGKey(0), SHAPE)
    rp[0]["branch"][1] = {"scale": rp[0]["branch"][1]["scale"]}
    with pytest.raises(ValueError, match=r"layers\[0\]\.branch\[1\] \(Affine\): params has no "
                                         r"'bias'"):
        rc.apply(res, rp, x, rows=2)
    with pytest.raises(ValueError, match=r"Affine\): features=3 but its input"):
        rc.apply([rc.Affine(3)], [{"scale": jnp.ones(3), "bias": jnp.ones(3)}], x)


def test_tile_smaller_than_halo_and_other_arguments():
    params, x = _setup()
    deep = [rc.Conv(2, 3)] * 4
    dp = rc.init(deep, jax.random.PRNGKey(0), SHAPE)
    with pytest.raises(ValueError, match="smaller than its halo"):
        rc.apply(deep, dp, x, rows=4)
    with pytest.raises(ValueError, match="unroll must be an int >= 1"):
        rc.apply(LAYERS, params, x, rows=2, unroll=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        rc.apply(LAYERS, params, x, rows=2, mode="rows")
    with pytest.raises(ValueError, match="input_shape must be an NHWC shape"):
        rc.init(LAYERS, jax.random.PRNGKey(0), (8, 4, 2))
    with pytest.raises(ValueError, match="input_shape must be an NHWC shape"):
        rc.init(LAYERS, jax.random.PRNGKey(0), (1, 8.0, 4, 2))


def test_planner_arguments():
    with pytest.raises(TypeError, match="max_rows must be an int"):
        rc.plan(LAYERS, SHAPE, 10**9, max_rows=2.5, verify=False)
    with pytest.raises(ValueError, match="budget_bytes must be a number > 0"):
        rc.plan(LAYERS, SHAPE, "1000", verify=False)
    with pytest.raises(ValueError, match="input_shape must be an NHWC shape"):
        rc.plan(LAYERS, SHAPE[1:], 10**9, verify=False)
    assert rc.plan(LAYERS, SHAPE, 10**9, modes="share", verify=False).mode == "share"
    for bad in ("tpu", "H200x", None):
        with pytest.raises(ValueError, match="rowconv.plan: `target` must be one of"):
            rc.plan(LAYERS, SHAPE, 10**9, target=bad)
    assert rc.plan(LAYERS, SHAPE, 10**9, verify=False, target="H100").target == "h100"
    with pytest.raises(TypeError, match=r"rows\[0\] must be an int"):
        rc.estimate(LAYERS, SHAPE, "overlap", [2.5])
    assert rc.estimate(LAYERS, SHAPE, "overlap", np.int64(2)) == \
        rc.estimate(LAYERS, SHAPE, "overlap", [2])


def test_flax_wrapper_refuses_int_input_and_accepts_numpy_rows():
    from flax import linen as nn
    m = RowSequential([nn.Conv(2, (3, 3)), nn.relu], rows=np.int64(2))
    x = jax.random.normal(jax.random.PRNGKey(0), SHAPE)
    v = m.init(jax.random.PRNGKey(1), x)
    y = m.apply(v, x)
    y1 = RowSequential([nn.Conv(2, (3, 3)), nn.relu], rows=1).apply(v, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="x must be a floating array"):
        m.apply(v, x.astype(jnp.int32))
    with pytest.raises(ValueError, match="not elementwise"):
        RowSequential([nn.Conv(2, (3, 3)), _height_norm], rows=2).init(jax.random.PRNGKey(1), x)


def test_check_params_is_shared_by_the_untiled_path():
    assert rc_layers.check_params(LAYERS, rc.init(LAYERS, jax.random.PRNGKey(0), SHAPE),
                                  SHAPE) is None
