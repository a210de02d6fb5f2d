"""jaxmem._prims.ties: the exact, shard-local data dependency of backward recomputations.

``tie(x, dep)`` (and ``tie_elementwise``, its scalar-barrier form off CPU, and
``tie_on_cpu``, nothing off CPU) must return ``x`` bit for bit (``-0.0``, ``inf`` and
``NaN`` included, whatever ``dep`` holds), keep every dtype and pytree leaf kind, work at
size 0 and under jit / vmap / grad / scan / checkpoint, and leave a real dependency on
``dep`` in the compiled program. The collective counts under sharding are checked in
parity_tests/distributed/multidevice.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmem.selective as S
from jaxmem._prims import ties
from jaxmem._prims.ties import tie, tie_elementwise, tie_on_cpu, together, typed_struct, vary_like

SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.5, -2.25, 3e-8], np.float32)
TIES = pytest.mark.parametrize("tie", [tie, tie_elementwise, tie_on_cpu],
                              ids=["tie", "tie_elementwise", "tie_on_cpu"])


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("first", [0.0, -0.0, np.inf, -np.inf, np.nan, 7.0])
@TIES
def test_tie_is_bit_exact_for_any_cotangent(dtype, first, tie):
    x = jnp.asarray(SPECIAL, dtype)
    dep = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), dtype).at[0, 0].set(first)
    _bits_equal(tie(x, dep), x)
    _bits_equal(jax.jit(tie)(x, dep), x)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3),
       dshape=st.lists(st.integers(0, 3), min_size=0, max_size=3),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       seed=st.integers(0, 2 ** 16))
def test_tie_exact_random_shapes(shape, dshape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.choice(SPECIAL, size=shape), dtype)
    dep = jnp.asarray(rng.choice(SPECIAL, size=dshape), dtype)
    _bits_equal(jax.jit(tie)(x, dep), x)


@TIES
def test_tie_leaf_kinds_and_structure(tie):
    dep = jnp.ones((2, 3))
    key = jax.random.key(3)
    tree = {"f": jnp.float32(-0.0), "i": jnp.arange(4), "u": jnp.arange(3, dtype=jnp.uint32),
            "b": jnp.array([True, False]), "k": key, "none": None,
            "raw_key": jax.random.PRNGKey(1)}
    out = jax.jit(tie)(tree, dep)
    assert jax.tree.structure(out, is_leaf=lambda a: a is None) == \
        jax.tree.structure(tree, is_leaf=lambda a: a is None)
    for name in ("f", "i", "u", "b", "raw_key"):
        _bits_equal(out[name], tree[name])
    assert out["none"] is None
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(key))
    # a key as the dependency is allowed too
    _bits_equal(tie(jnp.arange(3.0), key), jnp.arange(3.0))


@pytest.mark.parametrize("xshape,dshape", [((0, 3), (2, 2)), ((2, 2), (0, 3)), ((0,), (0,)),
                                            ((), ()), ((3,), ())])
@TIES
def test_tie_zero_size_and_scalars(xshape, dshape, tie):
    x = jnp.asarray(np.random.default_rng(1).normal(size=xshape), jnp.float32)
    dep = jnp.full(dshape, jnp.nan, jnp.float32)
    _bits_equal(jax.jit(tie)(x, dep), x)
    g = jax.grad(lambda x: jnp.sum(tie(x, dep) * 3.0))(x)
    np.testing.assert_array_equal(g, np.full(xshape, 3.0, np.float32))


@TIES
def test_tie_derivatives_pass_through_to_x(tie):
    x, dep = jnp.array([1.0, -2.0, 3.0]), jnp.array([jnp.inf, 1.0])
    gx, gd = jax.grad(lambda x, d: jnp.sum(tie(x, d) ** 2), (0, 1))(x, dep)
    np.testing.assert_array_equal(gx, 2 * x)
    np.testing.assert_array_equal(gd, np.zeros(2, np.float32))
    h = jax.jit(jax.grad(jax.grad(lambda a: jnp.sum(tie(a, dep) ** 3))))(2.0)
    assert float(h) == 12.0
    _, tan = jax.jvp(lambda x: tie(x, dep), (x,), (jnp.ones(3),))
    np.testing.assert_array_equal(tan, np.ones(3, np.float32))


@TIES
def test_tie_under_vmap_scan_checkpoint(tie):
    xs = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)), jnp.float32)
    ds = jnp.asarray(np.random.default_rng(3).normal(size=(4, 2)), jnp.float32)
    _bits_equal(jax.vmap(tie)(xs, ds), xs)
    _bits_equal(jax.vmap(tie, (0, None))(xs, ds[0]), xs)
    _bits_equal(jax.vmap(tie, (None, 0))(xs[0], ds), jnp.broadcast_to(xs[0], (4, 5)))

    def body(c, xd):
        x, d = xd
        return c + jnp.sum(jax.checkpoint(tie)(x, d) ** 2), None

    f = lambda xs: jax.lax.scan(body, 0.0, (xs, ds))[0]
    np.testing.assert_allclose(jax.jit(jax.grad(f))(xs), 2 * xs, rtol=1e-6)
    gv = jax.jit(jax.vmap(jax.grad(lambda x, d: jnp.sum(tie(x, d) ** 2))))(xs, ds)
    np.testing.assert_allclose(gv, 2 * xs, rtol=1e-6)


@pytest.mark.parametrize("op", [tie, tie_on_cpu], ids=["tie", "tie_on_cpu"])
@pytest.mark.parametrize("dep", [jnp.ones((2,)), jnp.arange(2, dtype=jnp.uint32),
                                 jax.random.key(0)], ids=["f32", "u32", "key"])
def test_tie_leaves_a_dependency_in_the_compiled_program(dep, op):
    """XLA must not fold the zero away: the dependency stays an operand of the result."""
    txt = jax.jit(op).lower(jnp.ones((4, 4)), dep).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    dep_param = re.search(r"%(\S+) = [a-z0-9]+\[2\]\{0\} parameter\(1\)", entry).group(1)
    assert entry.count(dep_param) >= 2, entry


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32,
                                   jnp.uint8, jnp.bool_])
def test_off_cpu_bodies_return_x_bit_for_bit(dtype):
    """The bodies XLA:GPU runs (a barrier over ``(x, dep)``; a barrier over a scalar zero
    and ``x * (1 + z)``), run here on CPU: ``x`` bit for bit, ``-0.0``, ``inf`` and ``NaN``
    included, under ``jit`` too."""
    rng = np.random.default_rng(4)
    if jnp.issubdtype(dtype, jnp.floating):
        x = jnp.asarray(rng.choice(SPECIAL, size=(5, 7)), dtype)
    elif dtype == jnp.bool_:
        x = jnp.asarray(rng.integers(0, 2, (5, 7)).astype(bool))
    else:
        x = jnp.asarray(rng.integers(0, 100, (5, 7)), dtype)
    dep = jnp.asarray([np.nan, 1.0], jnp.float32)
    for body in (ties._arith_barrier, ties._scalar_barrier):
        _bits_equal(body(x, dep), x)
        _bits_equal(jax.jit(body)(x, dep), x)


def test_elementwise_tie_barrier_holds_a_scalar_off_cpu():
    """Off CPU the elementwise tie's barrier holds a scalar beside the dependency, not ``x``
    (``x`` is read where it is, so no slice of a larger buffer is copied for it); the
    plain tie's holds ``x`` itself."""
    x, dep = jnp.ones((8, 16)), jnp.ones((4,))
    for body, held in ((ties._scalar_barrier, [(), (4,)]), (ties._arith_barrier,
                                                            [(8, 16), (4,)])):
        eqns = [e for e in jax.make_jaxpr(body)(x, dep).jaxpr.eqns
                if e.primitive.name == "optimization_barrier"]
        assert len(eqns) == 1
        assert [tuple(v.aval.shape) for v in eqns[0].invars] == held


def test_tie_is_traced_once_per_operand_types_and_inlined(monkeypatch):
    """Repeated ties of one shape replay one trace (the op is three nested custom rules,
    traced per call otherwise); the caller's jaxpr holds the op's own equations, not a
    ``jit`` call, and the values are the operand's."""
    from jaxmem._prims import ties

    calls = []
    arith = ties._arith
    monkeypatch.setattr(ties, "_arith", lambda x, d: calls.append(x.shape) or arith(x, d))
    jax.clear_caches()  # a trace of these shapes made by an earlier test would be replayed
    xs = [jnp.full((3, 7, 5), float(i)) for i in range(6)]
    dep = jnp.ones((2, 9))

    def f(xs, dep):
        return [tie(x, dep) for x in xs]

    jaxpr = jax.make_jaxpr(f)(xs, dep)
    assert calls == [(3, 7, 5)]            # six ties, one trace of the body
    names = {e.primitive.name for e in jaxpr.eqns}
    assert "jit" not in names and "pjit" not in names, names
    assert sum(e.primitive.name == "custom_jvp_call" for e in jaxpr.eqns) == 6
    for got, want in zip(jax.jit(f)(xs, dep), xs):
        _bits_equal(got, want)


def test_tie_rejects_non_array_dependency():
    with pytest.raises(TypeError, match="tie: dep must be an array"):
        tie(jnp.ones(2), [object()])


def test_shard_map_type_helpers_are_identity_outside_shard_map():
    a = jnp.ones((2, 3), jnp.bfloat16)
    assert vary_like(a, jnp.ones(3)) is a
    assert vary_like(None, a) is None
    s = typed_struct(a)
    assert s.shape == (2, 3) and s.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_norm_gradients_with_nonfinite_cotangent_stay_local(dtype):
    """An inf in one cotangent entry reaches, through the tied recomputation, only the
    gradient entries that plain autodiff also makes non-finite."""
    x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 6)), dtype)
    ct = jnp.asarray(np.random.default_rng(5).normal(size=(4, 6)), dtype).at[0, 0].set(jnp.inf)

    def plain(x):
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, -1, keepdims=True)
        var = jnp.maximum(0.0, jnp.mean(xf * xf, -1, keepdims=True) - mu * mu)
        return ((xf - mu) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype)

    (ds,) = jax.vjp(lambda x: S.layer_norm(x), x)[1](ct)
    (dp,) = jax.vjp(plain, x)[1](ct)
    finite = np.isfinite(np.asarray(dp, np.float32))
    np.testing.assert_array_equal(np.isfinite(np.asarray(ds, np.float32)), finite)
    assert finite[1:].all()
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(ds, np.float32)[1:], np.asarray(dp, np.float32)[1:],
                               rtol=tol, atol=tol)


def test_together_returns_both_bit_exact_under_grad_vmap_scan():
    rng = np.random.default_rng(6)
    a = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16)
    ra, rb = jax.jit(together)(a, b)
    _bits_equal(ra, a)
    _bits_equal(rb, b)
    assert rb.dtype == jnp.bfloat16
    # scalars, empty arrays and None pass through with their shapes
    s, e = together(jnp.float32(2.5), jnp.zeros((0, 3)))
    assert s.shape == () and float(s) == 2.5 and e.shape == (0, 3)
    assert together(None, a)[0] is None and together(a, None)[1] is None
    # derivatives pass through to each side
    ga, gb = jax.grad(lambda a, b: jnp.sum(together(a, b)[0] ** 2)
                      + jnp.sum(together(a, b)[1].astype(jnp.float32) * 3.0), (0, 1))(a, b)
    np.testing.assert_array_equal(ga, 2 * a)
    np.testing.assert_array_equal(gb.astype(jnp.float32), np.full((4, 3), 3.0, np.float32))
    # vmap with either side unbatched
    for axes in ((0, 0), (0, None), (None, 0)):
        va, vb = jax.vmap(together, axes)(a, b.astype(jnp.float32))
        _bits_equal(va, a if axes[0] == 0 else jnp.broadcast_to(a, (4, 4, 5)))
        assert vb.shape == ((4, 3) if axes[1] == 0 else (4, 4, 3))

    def body(c, ab):
        x, y = jax.checkpoint(together)(*ab)
        return c + jnp.sum(x * y), None

    f = lambda a, b: jax.lax.scan(body, 0.0, (a, b))[0]
    bf = b.astype(jnp.float32)
    ga, gb = jax.jit(jax.grad(f, (0, 1)))(a[:, :3], bf)
    np.testing.assert_allclose(ga, bf, rtol=1e-6)
    np.testing.assert_allclose(gb, a[:, :3], rtol=1e-6)
