"""jaxmem.selective primitives vs plain JAX: values and gradients for every combination of
differentiated inputs, check_grads, transformations, dtypes, bad input."""
from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from _lazy import once
from jax import lax
from jax.test_util import check_grads

import jaxmem
import jaxmem.selective as S


def rnd(i, shape, scale=1.0, shift=0.0, dtype=jnp.float32):
    """Normal test data of stream ``i``, drawn with NumPy (``jax.random`` op by op compiles a
    program per shape), rounded to float32, then to ``dtype``."""
    x = np.random.default_rng(42 + i).normal(size=shape) * scale + shift
    return jnp.asarray(x.astype(np.float32), dtype=dtype)


def _cmp_grads(f, g, args, subsets, rtol=1e-5, atol=1e-6):
    """Gradients of sum(f(*)*ct) and sum(g(*)*ct) agree for each tuple of argnums in
    ``subsets`` (a tuple of ints is one subset). One jit for both sides and all subsets, so
    every subset gets its own trace (its own ``.perturbed`` flags) but one compile."""
    if isinstance(subsets[0], int):
        subsets = [subsets]
    ct = rnd(7, jax.eval_shape(g, *args).shape)

    def all_grads(fn, a):
        return [jax.grad(lambda *b: jnp.sum(fn(*b) * ct), s)(*a) for s in subsets]

    ga, gb = jax.jit(lambda *a: (all_grads(f, a), all_grads(g, a)))(*args)
    for sa, sb, sub in zip(ga, gb, subsets):
        assert_tree_close(sa, sb, rtol=rtol, atol=atol, err_msg=f"argnums={sub}")


SUBSETS2 = [(0,), (1,), (0, 1)]


# --------------------------------------------------------------------------- linear
ALL3 = [s for k in (1, 2, 3) for s in itertools.combinations(range(3), k)]


def test_dense_matches_jax():
    x, w, b = rnd(0, (3, 5, 6)), rnd(1, (6, 4)), rnd(2, (4,))
    _cmp_grads(S.dense, lambda x, w, b: x @ w + b, (x, w, b), ALL3, rtol=0, atol=0)


CONV_CASES = [
    # (x shape, w shape, kwargs)
    ((2, 9, 3), (3, 3, 4), {"strides": 2, "padding": "SAME"}),
    ((2, 9, 8, 4), (3, 3, 2, 6), {"strides": (2, 1), "padding": ((1, 2), (0, 1)),
                                  "dilation": (1, 2), "feature_group_count": 2}),
    ((1, 5, 6, 7, 2), (3, 2, 3, 2, 3), {"padding": ((0, 0), (1, 0), (0, 2)),
                                        "input_dilation": (1, 2, 1)}),
    ((2, 7, 7, 3), (3, 3, 3, 5), {"padding": 1}),
]


def _lax_conv(x, w, strides=1, padding="SAME", dilation=1, input_dilation=1,
              feature_group_count=1):
    n = x.ndim - 2
    t = lambda v: (v,) * n if isinstance(v, int) else tuple(v)
    if isinstance(padding, int):
        padding = [(padding, padding)] * n
    sp = "DHW"[-n:]
    return lax.conv_general_dilated(x, w, t(strides), padding, t(input_dilation), t(dilation),
                                    ("N" + sp + "C", sp + "IO", "N" + sp + "C"),
                                    feature_group_count)


@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_conv_matches_jax(case):
    xs, ws, kw = CONV_CASES[case]
    x, w = rnd(0, xs), rnd(1, ws)
    # Bit-identical to JAX, except the input gradient of a plain strided conv (case 0): it is
    # computed per output phase (linear._phase_input_grad) -- the same products summed in
    # another order, so equal up to f32 rounding.
    tol = 2e-6 if case == 0 else 0
    if jax.default_backend() != "cpu":
        # GPU: cuDNN picks its algorithm per program, so two equal convolutions may differ
        # in the last bits (a few ulp of the accumulated sum); CPU is bit-identical
        tol = max(tol, 1e-5)
    _cmp_grads(lambda x, w: S.conv(x, w, **kw), lambda x, w: _lax_conv(x, w, **kw), (x, w),
               SUBSETS2, rtol=tol, atol=tol)


@pytest.mark.parametrize("nd,strides,padding", [(1, 2, "SAME"), (2, (2, 1), "VALID"),
                                                (2, 2, ((1, 0), (2, 1))), (3, 1, "SAME")])
def test_conv_transpose_matches_jax(nd, strides, padding):
    x = rnd(0, (2,) + (5,) * nd + (3,))
    w = rnd(1, (3,) * nd + (3, 4))
    t = (strides,) * nd if isinstance(strides, int) else strides
    sp = "DHW"[-nd:]
    ref = lambda x, w: lax.conv_transpose(x, w, t, padding,
                                          dimension_numbers=("N" + sp + "C", sp + "IO",
                                                             "N" + sp + "C"))
    _cmp_grads(lambda x, w: S.conv_transpose(x, w, strides=strides, padding=padding), ref,
               (x, w), SUBSETS2, rtol=0, atol=0)


def _jax_rnd(i, shape):
    """``jax.random`` normal data: float32 finite differences (``check_grads``) stay within
    their tolerances on this data."""
    return jax.random.normal(jax.random.split(jax.random.key(42), 8)[i], shape)


def test_linear_check_grads():
    x, w = _jax_rnd(0, (2, 6, 6, 3)), _jax_rnd(1, (3, 3, 3, 4))
    # jitted: check_grads evaluates the function many times (op by op: many small compiles)
    check_grads(jax.jit(lambda x, w: S.conv(x, w, strides=2)), (x, w), order=1, modes=["rev"],
                atol=1e-2, rtol=1e-2)
    check_grads(jax.jit(S.dense), (_jax_rnd(0, (3, 4)), _jax_rnd(1, (4, 2))), order=1,
                modes=["rev"])


# ---------------------------------------------------------------------------- norms
def _flax(mod, variables, **kw):
    return lambda x, s, b: mod.apply(variables(s, b), x, **kw)


NORMS = {
    "layer": (lambda x, s, b: S.layer_norm(x, s, b),
              lambda x, s, b: nn.LayerNorm().apply({"params": {"scale": s, "bias": b}}, x)),
    "rms": (lambda x, s, b: S.rms_norm(x, s) + 0 * b,
            lambda x, s, b: nn.RMSNorm().apply({"params": {"scale": s}}, x) + 0 * b),
    "group": (lambda x, s, b: S.group_norm(x, s, b, num_groups=2),
              lambda x, s, b: nn.GroupNorm(num_groups=2).apply(
                  {"params": {"scale": s, "bias": b}}, x)),
    "batch_train": (lambda x, s, b: S.batch_norm(x, s, b, train=True)[0],
                    lambda x, s, b: nn.BatchNorm(use_running_average=False).apply(
                        {"params": {"scale": s, "bias": b},
                         "batch_stats": {"mean": jnp.zeros(4), "var": jnp.ones(4)}},
                        x, mutable=["batch_stats"])[0]),
    "batch_eval": (lambda x, s, b: S.batch_norm(x, s, b, RM(), RV(), train=False)[0],
                   lambda x, s, b: nn.BatchNorm(use_running_average=True).apply(
                       {"params": {"scale": s, "bias": b},
                        "batch_stats": {"mean": RM(), "var": RV()}}, x)),
}
RM = once(lambda: rnd(5, (4,)))
RV = once(lambda: jnp.asarray(np.random.default_rng(48).uniform(size=4).astype(np.float32) + 0.5))


@pytest.mark.parametrize("name", list(NORMS))
def test_norm_matches_flax(name):
    ours, ref = NORMS[name]
    x, s, b = rnd(0, (3, 5, 5, 4), 2.0, 1.0), rnd(1, (4,)), rnd(2, (4,))
    y, y0 = jax.jit(lambda *a: (ours(*a), ref(*a)))(x, s, b)
    np.testing.assert_allclose(y, y0, rtol=0, atol=1e-6)
    _cmp_grads(ours, ref, (x, s, b), ALL3, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["layer", "batch_train"])
def test_norm_error_vs_float64_no_worse_than_jax(name):
    """Our f32 gradient is as close to the float64 truth as JAX's own f32 gradient."""
    ours, ref = NORMS[name]
    x, s, b = rnd(0, (4, 5, 5, 4), 3.0, 2.0), rnd(1, (4,)), rnd(2, (4,))
    ct = rnd(7, x.shape)
    g32 = jax.jit(lambda *a: [jax.grad(lambda *b, f=f: jnp.sum(f(*b) * ct), (0, 1))(*a)
                              for f in (ours, ref)])(x, s, b)
    with jax.enable_x64():
        a64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, s, b, ct)]
        g64 = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * a64[3]), (0, 1)))(*a64[:3])
    for i in range(2):
        e_ours = float(np.max(np.abs(np.asarray(g32[0][i], np.float64) - np.asarray(g64[i]))))
        e_jax = float(np.max(np.abs(np.asarray(g32[1][i], np.float64) - np.asarray(g64[i]))))
        assert e_ours <= 4 * e_jax + 1e-6, (name, i, e_ours, e_jax)


def test_batch_norm_running_stats_and_stat_outputs():
    x = rnd(0, (6, 3, 4), 2.0, 1.0)
    _, m, v = jax.jit(lambda x: S.batch_norm(x, None, None, jnp.zeros(4), jnp.ones(4),
                                             train=True, momentum=0.9))(x)
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(m, 0.1 * np.mean(xn, (0, 1)), rtol=1e-5)
    np.testing.assert_allclose(v, 0.9 + 0.1 * np.var(xn, (0, 1)), rtol=1e-5)
    # gradients through the returned statistics are exact too
    f = lambda x: jnp.sum(S.normalize(x, axes=(0, 1), feature_axes=(2,))[1] ** 2) + jnp.sum(
        jnp.sin(S.normalize(x, axes=(0, 1), feature_axes=(2,))[2]))
    r = lambda x: jnp.sum(jnp.mean(x, (0, 1)) ** 2) + jnp.sum(jnp.sin(jnp.var(x, (0, 1))))
    gf, gr = jax.jit(lambda x: (jax.grad(f)(x), jax.grad(r)(x)))(x)
    np.testing.assert_allclose(gf, gr, rtol=1e-4, atol=1e-6)


def test_norm_check_grads():
    x = rnd(0, (3, 6), 2.0, 1.0)
    check_grads(jax.jit(lambda x, s, b: S.layer_norm(x, s, b)), (x, rnd(1, (6,)), rnd(2, (6,))),
                order=1, modes=["rev"], atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------- activations
ACTS = [(S.relu, jax.nn.relu), (S.leaky_relu, jax.nn.leaky_relu), (S.relu6, jax.nn.relu6),
        (S.hard_tanh, jax.nn.hard_tanh)]


@pytest.mark.parametrize("ours,ref", ACTS)
def test_activation_exact_including_kinks(ours, ref):
    x = jnp.concatenate([rnd(0, (997,), 4.0), jnp.array([0.0, 6.0, -1.0, 1.0, -0.0])])
    np.testing.assert_array_equal(ours(x), ref(x))
    _cmp_grads(ours, ref, (x,), (0,), rtol=0, atol=0)


def test_leaky_relu_slope():
    x = rnd(0, (50,))
    _cmp_grads(lambda x: S.leaky_relu(x, 0.3), lambda x: jax.nn.leaky_relu(x, 0.3), (x,), (0,),
               rtol=0, atol=0)


# -------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("shape,window,strides,padding", [
    ((2, 11, 10, 3), (3, 3), (2, 2), "SAME"),
    ((2, 11, 10, 3), (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((2, 11, 10, 3), (3, 2), (1, 2), "SAME"),
    ((2, 11, 10, 3), (2, 2), (3, 3), "VALID"),
    ((2, 9, 3), (3,), (2,), "SAME"),
    ((1, 5, 6, 7, 2), (2, 2, 2), (2, 2, 2), "VALID"),
])
def test_max_pool_matches_flax(shape, window, strides, padding):
    x0 = rnd(0, shape)
    # plain data, ties after relu (zeros), ties from rounding
    f = lambda x: jnp.stack([S.max_pool(v, window, strides, padding)
                             for v in (x, jax.nn.relu(x), jnp.round(x))])
    r = lambda x: jnp.stack([nn.max_pool(v, window, strides, padding)
                             for v in (x, jax.nn.relu(x), jnp.round(x))])
    np.testing.assert_array_equal(f(x0), r(x0))
    _cmp_grads(f, r, (x0,), (0,), rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------------------- dropout
def test_dropout_matches_flax_math():
    key = jax.random.key(3)
    x = rnd(0, (4, 16))
    ref = lambda x: jax.lax.select(jax.random.bernoulli(key, 0.7, x.shape), x / 0.7,
                                   jnp.zeros_like(x))
    np.testing.assert_array_equal(S.dropout(key, x, 0.3), ref(x))
    _cmp_grads(lambda x: S.dropout(key, x, 0.3), ref, (x,), (0,), rtol=1e-6, atol=0)
    # broadcast_dims share the mask
    y = S.dropout(key, jnp.ones((4, 6)), 0.5, broadcast_dims=(0,))
    assert bool(jnp.all((y == 0) == (y[:1] == 0)))
    np.testing.assert_array_equal(S.dropout(key, x, 0.3, deterministic=True), x)


def test_dropout_matches_flax_module():
    x = rnd(0, (4, 16))
    rngs = {"dropout": jax.random.key(9)}
    ref = nn.Dropout(0.25, deterministic=False).apply({}, x, rngs=rngs)
    with jaxmem.scope(attention=False):
        ours = nn.Dropout(0.25, deterministic=False).apply({}, x, rngs=rngs)
    np.testing.assert_array_equal(ours, ref)


# ------------------------------------------------------------------ transformations
def _net(x, w1, w2, s, b, key):
    h = S.conv(x, w1, strides=1)
    h = S.batch_norm(h, s, b, train=True)[0]
    h = S.relu(h)
    h = S.max_pool(h, (2, 2), (2, 2))
    h = S.dropout(key, h, 0.2)
    h = S.layer_norm(h)
    return S.dense(h.reshape(h.shape[0], -1), w2)


def _ref_net(x, w1, w2, s, b, key):
    h = _lax_conv(x, w1)
    h = nn.BatchNorm(use_running_average=False).apply(
        {"params": {"scale": s, "bias": b},
         "batch_stats": {"mean": jnp.zeros(4), "var": jnp.ones(4)}}, h,
        mutable=["batch_stats"])[0]
    h = jax.nn.relu(h)
    h = nn.max_pool(h, (2, 2), (2, 2))
    h = jax.lax.select(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, jnp.zeros_like(h))
    h = nn.LayerNorm(use_bias=False, use_scale=False).apply({}, h)
    return h.reshape(h.shape[0], -1) @ w2


def _net_args():
    return (rnd(0, (2, 8, 8, 3)), rnd(1, (3, 3, 3, 4)), rnd(2, (64, 5)), rnd(3, (4,)),
            rnd(4, (4,)), jax.random.key(5))


def test_network_grads_match_under_jit():
    args = _net_args()
    _cmp_grads(lambda *a: jnp.sin(_net(*a)), lambda *a: jnp.sin(_ref_net(*a)), args,
               [(0,), (1,), (2,), (3, 4), (0, 1, 2, 3, 4)], rtol=2e-5, atol=2e-5)


def test_vmap_of_grad():
    args = _net_args()
    xs = jnp.stack([args[0], args[0] * 2])
    f = lambda x: jax.grad(lambda w: jnp.sum(_net(x, w, *args[2:])))(args[1])
    r = lambda x: jax.grad(lambda w: jnp.sum(_ref_net(x, w, *args[2:])))(args[1])
    gf, gr = jax.jit(lambda xs: (jax.vmap(f)(xs), jax.vmap(r)(xs)))(xs)
    np.testing.assert_allclose(gf, gr, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("carry_weights", [False, True])
def test_scan_perturbed_flags_change_between_iterations(carry_weights):
    """jax#16614: under scan the fixpoint traces the custom_vjp with different .perturbed
    flags. Here the weight starts as a constant and becomes perturbed through the carry."""
    w0 = rnd(1, (6, 6)) * 0.3
    x = rnd(0, (3, 6))

    def body(dense, relu):
        def step(carry, _):
            h, w = carry
            h2 = relu(dense(h, w))
            w2 = w + 0.01 * jnp.mean(h2) if carry_weights else w
            return (h2, w2), None
        return step

    def loss(x, w, dense, relu):
        (h, _), _ = lax.scan(body(dense, relu), (x, w), None, length=4)
        return jnp.sum(h ** 2)

    _cmp_grads(lambda x, w: loss(x, w, S.dense, S.relu),
               lambda x, w: loss(x, w, lambda h, w: h @ w, jax.nn.relu), (x, w0),
               [(0,), (1,), (0, 1)], rtol=1e-5, atol=1e-6)


def test_checkpoint_and_names():
    args = _net_args()
    policy = jax.checkpoint_policies.save_only_these_names(
        "jaxmem.selective.relu.mask", "jaxmem.selective.conv.input")
    f = jax.checkpoint(lambda *a: jnp.sum(jnp.sin(_net(*a))), policy=policy)
    g, r = jax.jit(lambda *a: (jax.grad(f, (0, 1))(*a), jax.grad(
        lambda *b: jnp.sum(jnp.sin(_ref_net(*b))), (0, 1))(*a)))(*args)
    assert_tree_close(g, r, rtol=2e-5, atol=2e-5)
    from jaxmem._compat import saved_residuals
    names = [s for _, s in saved_residuals(f, *args[:5], args[5])]
    assert any("jaxmem.selective.relu.mask" in s for s in names), names


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    x, w = rnd(0, (2, 6, 6, 3), dtype=dtype), rnd(1, (3, 3, 3, 4), dtype=dtype)
    s = jnp.ones(4, jnp.float32)
    f = lambda x, w: jnp.sum(S.relu(S.layer_norm(S.conv(x, w), s)).astype(jnp.float32))
    r = lambda x, w: jnp.sum(jax.nn.relu(nn.LayerNorm(use_bias=False).apply(
        {"params": {"scale": s}}, _lax_conv(x, w))).astype(jnp.float32))
    ga, gb = jax.jit(lambda x, w: (jax.grad(f, (0, 1))(x, w), jax.grad(r, (0, 1))(x, w)))(x, w)
    for a, b in zip(ga, gb):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)
    p, q = jax.jit(lambda x: [jax.grad(lambda x, pool=pool: jnp.sum(
        pool(x, (2, 2), (2, 2)).astype(jnp.float32)))(x) for pool in (S.max_pool, nn.max_pool)])(x)
    np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(q, np.float32))


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("call,exc,match", [
    (lambda: S.conv(rnd(0, (1, 5, 5, 3)), rnd(1, (3, 3, 3, 2)), padding="CIRCULAR"),
     ValueError, "padding must be one of"),
    (lambda: S.conv(rnd(0, (1, 5, 5, 3)), rnd(1, (3, 3, 3, 2)), padding=[(1, 1)]),
     ValueError, "one entry per spatial"),
    (lambda: S.conv(rnd(0, (1, 5, 5, 3)), rnd(1, (3, 3, 4, 2))), ValueError, "channels"),
    (lambda: S.conv(jnp.ones((1, 5, 5, 3), jnp.int32), rnd(1, (3, 3, 3, 2))), TypeError,
     "floating"),
    (lambda: S.dense(rnd(0, (2, 3)), rnd(1, (4, 2))), ValueError, "last axis"),
    (lambda: S.relu(jnp.ones(3, jnp.int32)), TypeError, "floating"),
    (lambda: S.max_pool(rnd(0, (1, 4, 4, 1)), (2, 2), padding="FULL"), ValueError, "padding"),
    (lambda: S.group_norm(rnd(0, (1, 4, 6)), num_groups=4), ValueError, "num_groups"),
    (lambda: S.batch_norm(rnd(0, (4, 3)), train=False), ValueError, "running_mean"),
    (lambda: S.batch_norm(rnd(0, (4, 3)), train="yes"), TypeError, "train"),
    (lambda: S.layer_norm(rnd(0, (4, 3)), rnd(1, (5,))), ValueError, "scale"),
    (lambda: S.dropout(jax.random.key(0), rnd(0, (3,)), 1.5), ValueError, "rate"),
    (lambda: S.leaky_relu(rnd(0, (3,)), jnp.float32(0.1)), TypeError, "negative_slope"),
])
def test_bad_input_raises_named_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_all_subsets_of_three_for_bilinear_with_bias():
    """Every non-empty subset of (x, w, b) for a conv with bias."""
    x, w, b = rnd(0, (2, 6, 6, 3)), rnd(1, (3, 3, 3, 4)), rnd(2, (4,))
    _cmp_grads(lambda x, w, b: S.conv(x, w, b), lambda x, w, b: _lax_conv(x, w) + b,
               (x, w, b), ALL3, rtol=0, atol=0)
