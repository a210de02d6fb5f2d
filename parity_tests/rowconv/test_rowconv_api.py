"""rowconv: bad input errors, compiled bytes falling with N, halos, plan, transforms, dtypes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from _rc_params import random_params
from _rc_util import normal

from jaxmem import rowconv as rc
from jaxmem.measure import compiled_memory

STACK = [rc.Conv(4, 3), rc.Act(jax.nn.relu), rc.Conv(4, 3), rc.Act(jax.nn.relu),
         rc.Pool("max", 2), rc.Conv(4, 3), rc.Act(jax.nn.relu)]


def _x(shape, seed=1, dtype=jnp.float32):
    return normal(shape, seed, dtype)


def test_rows_more_than_output_rows():
    shape = (1, 20, 8, 2)
    p = random_params(STACK, shape)
    with pytest.raises(ValueError, match=r"rows=11 is more than the 10 output rows"):
        rc.apply(STACK, p, _x(shape), rows=11)


def test_tile_smaller_than_halo():
    shape = (1, 40, 8, 2)
    p = random_params(STACK, shape)
    with pytest.raises(ValueError, match="smaller than its halo.*fewer rows"):
        rc.apply(STACK, p, _x(shape), rows=10, mode="overlap")
    with pytest.raises(ValueError, match="smaller than its halo"):
        rc.apply([rc.Conv(2, 7)], random_params([rc.Conv(2, 7)], shape),
                 _x(shape), rows=40, mode="share")


def test_unsupported_layer_and_args():
    shape = (1, 16, 8, 2)
    with pytest.raises(TypeError, match="unsupported layer.*Dense"):
        rc.init([rc.Conv(2, 3), "dense"], jax.random.PRNGKey(0), shape)
    p = random_params(STACK, shape)
    with pytest.raises(ValueError, match="mode must be one of"):
        rc.apply(STACK, p, _x(shape), rows=2, mode="diagonal")
    with pytest.raises(ValueError, match="NHWC"):
        rc.apply(STACK, p, jnp.ones((16, 8, 2)), rows=2)
    with pytest.raises(ValueError, match="padding.*allowed"):
        rc.init([rc.Conv(2, 3, padding="CIRCULAR")], jax.random.PRNGKey(0), shape)
    with pytest.raises(ValueError, match="rows has 3 entries but the stack has 2 segments"):
        ls = STACK[:2] + [rc.Checkpoint()] + STACK[2:]
        rc.apply(ls, random_params(ls, shape), _x(shape), rows=[2, 2, 2])
    with pytest.raises(ValueError, match="needs apply\\(..., rng=key\\)"):
        ls = [rc.Conv(2, 3), rc.Dropout(0.5)]
        rc.apply(ls, random_params(ls, shape), _x(shape), rows=2)


def test_train_mode_batchnorm_rejected():
    shape = (1, 32, 8, 2)
    ls = [rc.Conv(3, 3), rc.BatchNorm(3, use_running_average=False), rc.Act(jax.nn.relu)]
    p = random_params(ls, shape)
    # untiled: whole-batch statistics, fine
    jax.jit(lambda p, x: rc.apply(ls, p, x, rows=1))(p, _x(shape))
    for mode in rc.MODES:
        with pytest.raises(ValueError, match="train-mode BatchNorm.*use_running_average=True"):
            rc.apply(ls, p, _x(shape), rows=2, mode=mode)


def test_compiled_bytes_fall_with_rows():
    shape = (1, 128, 64, 8)
    ls = [rc.Conv(8, 3), rc.Act(jax.nn.relu)] * 4
    # compiled, never run: abstract arguments
    p = jax.eval_shape(lambda: rc.init(ls, jax.random.PRNGKey(0), shape))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)

    def step(rows, mode):
        return lambda p, x: jax.grad(
            lambda p: jnp.mean(rc.apply(ls, p, x, rows=rows, mode=mode) ** 2))(p)

    for mode in rc.MODES:
        b = [compiled_memory(step(n, mode), p, x).temp_bytes for n in (1, 2, 8)]
        assert b[0] > b[1] > b[2], (mode, b)
        assert b[0] > 2.5 * b[2], (mode, b)


def test_halos_report():
    shape = (1, 64, 8, 2)
    rep = rc.halos(STACK, shape, 4, "overlap")
    assert rep.tile_rows == 8 and len(rep.input_rows) == 4
    # first tile reads from the top border, last tile ends at the bottom border
    assert rep.input_rows[0][0] == 0 and rep.input_rows[-1][1] == 64
    # receptive field of 3x3, 3x3, pool2, 3x3 along H: 1 + 2 + 2 + 1 + 2*2 = 10
    assert rep.receptive_field == 10
    rep = rc.halos(STACK, shape, 4, "share")
    assert sum(b - a for a, b in rep.input_rows) == 64  # every input row read once
    assert all(h >= 0 for h in rep.halo_rows)


def test_plan_fits_budget():
    shape = (1, 128, 64, 3)
    ls = rc.trunks.vgg_layers(cfg=(8, 8, "M", 16, "M"), checkpoints_at_pools=True)
    untiled = rc.plan(ls, shape, 2**40)
    assert untiled.rows == [1, 1, 1] or max(untiled.rows) == 1
    budget = untiled.compiled_bytes // 2
    pl = rc.plan(ls, shape, budget)
    assert pl.fits and pl.compiled_bytes <= budget and max(pl.rows) > 1
    with pytest.raises(ValueError, match="fits budget_bytes"):
        rc.plan(ls, shape, 1000)


def test_under_jit_vmap_scan_checkpoint_and_dtypes():
    shape = (1, 48, 8, 2)
    ls = STACK
    p = random_params(ls, shape)
    x = _x((3,) + shape[1:])
    # the untiled reference and the transformed tiled stacks share one compiled program per
    # comparison (all compared by tolerance)
    ref, y, v = jax.jit(lambda p, x: (
        rc.apply(ls, p, x, rows=1), rc.apply(ls, p, x, rows=3, mode="share"),
        jax.vmap(lambda xi: rc.apply(ls, p, xi[None], rows=3)[0])(x)))(p, x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, ref, rtol=1e-5, atol=1e-5)
    gv, g1 = jax.jit(lambda p: (
        jax.grad(lambda p: jnp.sum(jax.vmap(
            lambda xi: rc.apply(ls, p, xi[None], rows=3)[0])(x) ** 2))(p),
        jax.grad(lambda p: jnp.sum(rc.apply(ls, p, x, rows=1) ** 2))(p)))(p)
    assert_tree_close(gv, g1, rtol=1e-4, atol=1e-4)

    def scan_loss(p):
        def body(c, xi):
            return c + jnp.sum(jax.checkpoint(
                lambda p, xi: rc.apply(ls, p, xi[None], rows=2, mode="share"))(p, xi)), None
        return jax.lax.scan(body, 0.0, x)[0]

    gs, g1 = jax.jit(lambda p: (jax.grad(scan_loss)(p), jax.grad(
        lambda p: jnp.sum(rc.apply(ls, p, x, rows=1)))(p)))(p)
    assert_tree_close(gs, g1, rtol=1e-4, atol=1e-4)
    for dt in (jnp.bfloat16, jnp.float16):
        def half(p, x, dt=dt):  # parameters and input cast to ``dt`` inside the program
            pd, xd = jax.tree.map(lambda a: a.astype(dt), p), x.astype(dt)
            g = jax.grad(lambda pd: jnp.sum(rc.apply(ls, pd, xd, rows=3)
                                            .astype(jnp.float32)))(pd)
            return rc.apply(ls, pd, xd, rows=3), rc.apply(ls, pd, xd, rows=1), g

        yt, yr, g = jax.jit(half)(p, x)
        assert yt.dtype == dt
        np.testing.assert_allclose(np.asarray(yt, np.float32), np.asarray(yr, np.float32),
                                   rtol=5e-2, atol=5e-2)
        assert all(l.dtype == dt for l in jax.tree.leaves(g))


def test_grad_wrt_params_only_matches():
    # the input cotangent is skipped when x is not differentiated (symbolic zeros)
    shape = (1, 40, 8, 2)
    p = random_params(STACK, shape)
    x = _x(shape)

    def grads(p):  # untiled and both modes in one compiled program
        return [jax.grad(lambda p, rows=rows, mode=mode: jnp.sum(jnp.sin(
            rc.apply(STACK, p, x, rows=rows, mode=mode))))(p)
            for rows, mode in [(1, "overlap")] + [(3, m) for m in rc.MODES]]

    g1, *gs = jax.jit(grads)(p)
    assert len(gs) == len(rc.MODES)
    for g in gs:
        assert_tree_close(g, g1, rtol=1e-4, atol=1e-5)


def test_public_surface_names_and_annotations():
    """The names rowconv exports exist, say what they are and carry type hints on every
    parameter and return; the geometry internals are not exported."""
    import inspect
    import typing

    from jaxmem.rowconv import flax as rc_flax
    from jaxmem.rowconv import halo

    assert all(hasattr(rc, n) for n in rc.__all__)
    assert not hasattr(rc, "Plan") and "Tiling" in rc.__all__
    assert isinstance(rc.plan(STACK, (1, 16, 8, 2), 2**40, verify=False), rc.Tiling)
    assert halo.__all__ == ["HaloReport", "halos"]
    assert not {"Geom", "Iv", "OvNode", "ShNode"} & set(dir(halo))
    layers = [rc.Conv(4, 3), rc.Pool("max", 2), rc.Act(jax.nn.relu), rc.Affine(4),
              rc.BatchNorm(4), rc.Dropout(0.1)]
    assert all(isinstance(layer, rc.RowLayer) for layer in layers)
    assert not isinstance(rc.Checkpoint(), rc.RowLayer)

    def check(fn, where):
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        missing = [p for p in sig.parameters if p not in ("self", "cls") and p not in hints]
        assert not missing and "return" in hints, f"{where}: missing hints for {missing}"

    objs = [(n, getattr(rc, n)) for n in rc.__all__]
    objs += [(n, getattr(rc_flax, n)) for n in rc_flax.__all__]
    objs += [("vgg_layers", rc.trunks.vgg_layers), ("resnet50_layers", rc.trunks.resnet50_layers)]
    n_checked = 0
    for name, obj in objs:
        if inspect.isfunction(obj):
            check(obj, name)
            n_checked += 1
        elif inspect.isclass(obj) and obj.__module__.startswith("jaxmem.rowconv"):
            for m_name, m in vars(obj).items():
                if inspect.isfunction(m) and (not m_name.startswith("_")
                                              or m_name in ("__call__",)):
                    check(m, f"{name}.{m_name}")
                    n_checked += 1
    assert n_checked >= 25


def test_vgg_checkpoint_placement():
    """``checkpoints_at_pools``: True cuts after every pool but the last, a sequence after
    the pools it names (1-based); the segments follow, and a bad placement is an error."""
    cfg = (4, "M", 8, "M", 8, "M")

    def cuts(ck):
        ls = rc.trunks.vgg_layers(cfg, checkpoints_at_pools=ck)
        kinds = [type(lay).__name__ for lay in ls]
        # the pool number each Checkpoint follows
        return [kinds[:i].count("Pool") for i, k in enumerate(kinds) if k == "Checkpoint"]

    assert cuts(False) == cuts(()) == [] and cuts(True) == [1, 2]
    assert cuts((2,)) == [2] and cuts([1, 3]) == [1]   # none after the last pool
    layers = rc.trunks.vgg_layers(cfg, checkpoints_at_pools=(2,))
    assert len(rc.split_segments(layers)) == 2
    assert rc.segment_rows(layers, (1, 64, 16, 3), 4) == [4, 4]
    for bad, err in (((0,), ValueError), ((4,), ValueError), (2, TypeError)):
        with pytest.raises(err, match="checkpoints_at_pools"):
            rc.trunks.vgg_layers(cfg, checkpoints_at_pools=bad)
