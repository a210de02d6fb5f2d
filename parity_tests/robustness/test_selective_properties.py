"""Property-based parity of jaxmem.selective with plain JAX / Flax.

For generated shapes (sizes 0 and 1 included), dtypes (f32, f64, bf16, f16), strides,
dilations, paddings, feature groups and masks, each selective primitive must give the same
values, output dtype and gradients -- w.r.t. every non-empty subset of its differentiable
arguments -- as the plain function. f32 / f64 are compared with the plain function at the
same dtype. Half precision is compared through a float32 reference computed from the same
(rounded) inputs: the selective error may not exceed twice the plain function's own error
plus a small slack, so a half-precision rounding difference passes and a wrong formula does
not.
"""
from __future__ import annotations

import contextlib
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from _assert import assert_tree_close, scaled_atol
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax

import jaxmem.selective as S

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
DTYPES = ("float32", "float64", "bfloat16", "float16")
# f32 / f64: tolerance relative to the largest reference value; half: slack on top of 2x
# the plain function's own error.
TOL = {"float32": 2e-5, "float64": 1e-11, "bfloat16": 2e-2, "float16": 4e-3}


@contextlib.contextmanager
def x64_if(dtype):
    """Enable float64 for the block when ``dtype`` is float64; restore the setting after."""
    old = jax.config.jax_enable_x64
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def rand(seed, shape, dtype, scale=1.0, shift=0.0):
    """Fresh normal values (numpy, float64), rounded to ``dtype`` (half precision: through
    float32), on the host: no compiled conversion per shape."""
    v = np.random.default_rng(seed).normal(size=shape) * scale + shift
    if dtype in ("bfloat16", "float16"):
        v = v.astype(np.float32)
    return jnp.asarray(v.astype(jnp.dtype(dtype)))


def _subsets(n):
    return [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r)]


def _outputs(fn, args, ct):
    """``fn(*args)`` and ``grad(sum(fn * ct))`` for every non-empty subset of ``args``."""
    acc = jnp.float64 if ct.dtype == jnp.float64 else jnp.float32

    def loss(*a):
        return jnp.sum((fn(*a) * ct).astype(acc))

    def go(*a):
        return fn(*a), [jax.grad(loss, s)(*a) for s in _subsets(len(a))]

    y, gs = jax.jit(go)(*args)
    return [y] + [g for sub in gs for g in sub]


def _close(got, want, tol, what):
    assert_tree_close(got, want, rtol=0, atol=scaled_atol(tol, plus=1.0, finite_only=True),
                      equal_nan=True, err_msg=what)


def check_parity(sel_fn, ref_fn, args, dtype, seed=99):
    """Values, output dtype and all-subset gradients of ``sel_fn`` vs ``ref_fn``."""
    out = jax.eval_shape(ref_fn, *args)
    ct = rand(seed, out.shape, dtype)
    try:
        ref = _outputs(ref_fn, args, ct)
    except (ValueError, TypeError):  # plain JAX's own gradient fails: nothing to compare
        assume(False)
    sel = _outputs(sel_fn, args, ct)
    names = ["value"] + [f"grad{s}[{i}]" for s in _subsets(len(args)) for i in s]
    assert len(sel) == len(ref) == len(names)
    for a, b, what in zip(sel, ref, names):
        assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    if dtype in ("float32", "float64"):
        for a, b, what in zip(sel, ref, names):
            _close(a, b, TOL[dtype], what)
        return
    # half precision: both against a float32 reference from the same rounded inputs
    # (exact conversions, on the host)
    args32 = [jnp.asarray(np.asarray(a, np.float32)) for a in args]
    ref32 = _outputs(ref_fn, args32, jnp.asarray(np.asarray(ct, np.float32)))
    for a, b, r, what in zip(sel, ref, ref32, names):
        a, b, r = (np.asarray(v, np.float64) for v in (a, b, r))
        finite = np.isfinite(r) & np.isfinite(b)
        if not finite.any():
            continue
        scale = 1.0 + np.max(np.abs(r[finite]))
        err_sel = np.max(np.abs(a - r)[finite], initial=0.0)
        err_ref = np.max(np.abs(b - r)[finite], initial=0.0)
        assert err_sel <= 2 * err_ref + TOL[dtype] * scale, (what, err_sel, err_ref, scale)


def _valid(ref_fn, args):
    """Whether plain JAX accepts the configuration, values and gradients (else the example
    is skipped)."""
    loss = lambda *a: jnp.sum(ref_fn(*a).astype(jnp.float32))
    try:
        jax.eval_shape(jax.grad(loss, tuple(range(len(args)))), *args)
    except (ValueError, TypeError):
        return False
    return True


dtypes = st.sampled_from(DTYPES)
small = st.integers(0, 3)


# ------------------------------------------------------------------------------ conv
@st.composite
def conv_cases(draw):
    nsp = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cin_g, cout_g = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n = draw(st.sampled_from([0, 1, 2]))
    spatial = tuple(draw(st.integers(0, 6)) for _ in range(nsp))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nsp))
    strides = tuple(draw(st.integers(1, 3)) for _ in range(nsp))
    dil = tuple(draw(st.integers(1, 2)) for _ in range(nsp))
    in_dil = tuple(draw(st.sampled_from([1, 1, 2])) for _ in range(nsp))
    padding = draw(st.one_of(
        st.sampled_from(["SAME", "VALID"]),
        st.lists(st.tuples(st.integers(-1, 2), st.integers(-1, 2)), min_size=nsp,
                 max_size=nsp).map(tuple)))
    use_bias = draw(st.booleans())
    return {"nsp": nsp, "groups": groups, "cin": cin_g * groups, "cout": cout_g * groups,
            "n": n, "spatial": spatial, "kernel": kernel, "strides": strides, "dil": dil,
            "in_dil": in_dil, "padding": padding, "use_bias": use_bias, "dtype": draw(dtypes),
            "seed": draw(st.integers(0, 2**16))}


_DN = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}


@SETTINGS
@given(conv_cases())
def test_conv_matches_lax(c):
    dt = c["dtype"]
    with x64_if(dt):
        x = rand(c["seed"], (c["n"], *c["spatial"], c["cin"]), dt)
        w = rand(c["seed"] + 1, (*c["kernel"], c["cin"] // c["groups"], c["cout"]), dt, 0.5)
        args = [x, w] + ([rand(c["seed"] + 2, (c["cout"],), dt)] if c["use_bias"] else [])
        kw = {"strides": c["strides"], "padding": c["padding"], "dilation": c["dil"],
                  "input_dilation": c["in_dil"], "feature_group_count": c["groups"]}
        pad = c["padding"]

        def ref(x, w, b=None):
            y = lax.conv_general_dilated(
                x, w, c["strides"], pad, lhs_dilation=c["in_dil"], rhs_dilation=c["dil"],
                dimension_numbers=_DN[c["nsp"]], feature_group_count=c["groups"])
            return y if b is None else y + b

        assume(_valid(ref, args))
        check_parity(lambda x, w, b=None: S.conv(x, w, b, **kw), ref, args, dt)


@st.composite
def conv_t_cases(draw):
    nsp = draw(st.integers(1, 2))
    return {
        "nsp": nsp, "n": draw(st.sampled_from([0, 1, 2])), "cin": draw(st.integers(1, 3)),
        "cout": draw(st.integers(1, 3)),
        "spatial": tuple(draw(st.integers(0, 4)) for _ in range(nsp)),
        "kernel": tuple(draw(st.integers(1, 3)) for _ in range(nsp)),
        "strides": tuple(draw(st.integers(1, 3)) for _ in range(nsp)),
        "dil": tuple(draw(st.integers(1, 2)) for _ in range(nsp)),
        "padding": draw(st.one_of(
            st.sampled_from(["SAME", "VALID"]),
            st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=nsp,
                     max_size=nsp).map(tuple))),
        "transpose_kernel": draw(st.booleans()), "use_bias": draw(st.booleans()),
        "dtype": draw(dtypes), "seed": draw(st.integers(0, 2**16))}


@SETTINGS
@given(conv_t_cases())
def test_conv_transpose_matches_lax(c):
    dt = c["dtype"]
    with x64_if(dt):
        x = rand(c["seed"], (c["n"], *c["spatial"], c["cin"]), dt)
        io = (c["cout"], c["cin"]) if c["transpose_kernel"] else (c["cin"], c["cout"])
        w = rand(c["seed"] + 1, (*c["kernel"], *io), dt, 0.5)
        args = [x, w] + ([rand(c["seed"] + 2, (c["cout"],), dt)] if c["use_bias"] else [])
        kw = {"strides": c["strides"], "padding": c["padding"], "dilation": c["dil"],
                  "transpose_kernel": c["transpose_kernel"]}

        def ref(x, w, b=None):
            y = lax.conv_transpose(x, w, c["strides"], c["padding"], rhs_dilation=c["dil"],
                                   dimension_numbers=_DN[c["nsp"]],
                                   transpose_kernel=c["transpose_kernel"])
            return y if b is None else y + b

        assume(_valid(ref, args))
        check_parity(lambda x, w, b=None: S.conv_transpose(x, w, b, **kw), ref, args, dt)


# ----------------------------------------------------------------------------- dense
@SETTINGS
@given(batch=st.lists(small, max_size=2), fin=small, fout=small, use_bias=st.booleans(),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_dense_matches_dot(batch, fin, fout, use_bias, dtype, seed):
    with x64_if(dtype):
        x = rand(seed, (*batch, fin), dtype)
        w = rand(seed + 1, (fin, fout), dtype)
        args = [x, w] + ([rand(seed + 2, (fout,), dtype)] if use_bias else [])

        def ref(x, w, b=None):
            y = jnp.dot(x, w)
            return y if b is None else y + b

        check_parity(lambda x, w, b=None: S.dense(x, w, b), ref, args, dtype)


# ----------------------------------------------------------------------------- norms
@SETTINGS
@given(kind=st.sampled_from(["layer", "rms", "group"]), n=st.sampled_from([0, 1, 3]),
       spatial=st.lists(st.integers(1, 3), max_size=2), groups=st.integers(1, 3),
       per_group=st.integers(1, 3), use_scale=st.booleans(), use_bias=st.booleans(),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_norms_match_flax(kind, n, spatial, groups, per_group, use_scale, use_bias, dtype,
                          seed):
    c = groups * per_group
    if kind == "rms":
        use_bias = False
    with x64_if(dtype):
        x = rand(seed, (n, *spatial, c), dtype, 2.0, 0.5)
        params = {}
        if use_scale:
            params["scale"] = rand(seed + 1, (c,), dtype, shift=1.0)
        if use_bias:
            params["bias"] = rand(seed + 2, (c,), dtype)
        names = sorted(params)
        if kind == "layer":
            mod = nn.LayerNorm(use_scale=use_scale, use_bias=use_bias, param_dtype=dtype)
            sel = lambda x, p: S.layer_norm(x, p.get("scale"), p.get("bias"))
        elif kind == "rms":
            mod = nn.RMSNorm(use_scale=use_scale, param_dtype=dtype)
            sel = lambda x, p: S.rms_norm(x, p.get("scale"))
        else:
            mod = nn.GroupNorm(num_groups=groups, use_scale=use_scale, use_bias=use_bias,
                               param_dtype=dtype)
            sel = lambda x, p: S.group_norm(x, p.get("scale"), p.get("bias"),
                                            num_groups=groups)
        args = [x] + [params[k] for k in names]

        def ref(x, *ps):
            return mod.apply({"params": dict(zip(names, ps))}, x)

        check_parity(lambda x, *ps: sel(x, dict(zip(names, ps))), ref, args, dtype)


# ----------------------------------------------------------------------- activations
@SETTINGS
@given(kind=st.sampled_from(["relu", "leaky_relu", "relu6", "hard_tanh"]),
       shape=st.lists(st.integers(0, 5), max_size=3), slope=st.sampled_from([0.01, 0.3, -2.0]),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_activations_match_jax_nn(kind, shape, slope, dtype, seed):
    with x64_if(dtype):
        x = rand(seed, tuple(shape), dtype, 4.0)
        # include the kinks themselves: 0, 6, -1, 1
        if x.size:
            kinks = jnp.asarray([0.0, 6.0, -1.0, 1.0], dtype)
            flat = x.reshape(-1)
            flat = flat.at[: min(4, flat.size)].set(kinks[: min(4, flat.size)])
            x = flat.reshape(x.shape)
        if kind == "leaky_relu":
            sel, ref = (lambda v: S.leaky_relu(v, slope)), (lambda v: jax.nn.leaky_relu(v, slope))
        else:
            sel, ref = getattr(S, kind), getattr(jax.nn, kind)
        check_parity(sel, ref, [x], dtype)


# -------------------------------------------------------------------------- max pool
@st.composite
def pool_cases(draw):
    nsp = draw(st.integers(1, 2))
    window = tuple(draw(st.integers(1, 3)) for _ in range(nsp))
    strides = draw(st.one_of(st.none(), st.tuples(*[st.integers(1, 3)] * nsp)))
    padding = draw(st.one_of(
        st.sampled_from(["SAME", "VALID"]),
        st.lists(st.tuples(st.integers(-1, 2), st.integers(-1, 2)), min_size=nsp,
                 max_size=nsp).map(tuple)))
    return {"nsp": nsp, "n": draw(st.sampled_from([0, 1, 2])), "c": draw(st.integers(0, 2)),
            "spatial": tuple(draw(st.integers(0, 6)) for _ in range(nsp)), "window": window,
            "strides": strides, "padding": padding, "dtype": draw(dtypes),
            "seed": draw(st.integers(0, 2**16))}


@SETTINGS
@given(pool_cases())
def test_max_pool_matches_flax(c):
    dt = c["dtype"]
    with x64_if(dt):
        x = rand(c["seed"], (c["n"], *c["spatial"], c["c"]), dt)
        ref = lambda x: nn.max_pool(x, c["window"], c["strides"], c["padding"])
        if not isinstance(c["padding"], str):  # a negative padded size is refused (below)
            assume(all(n + lo + hi >= 0 for n, (lo, hi) in zip(c["spatial"], c["padding"])))
        assume(_valid(ref, [x]))
        sel = lambda x: S.max_pool(x, c["window"], c["strides"], c["padding"])
        check_parity(sel, ref, [x], dt)


# --------------------------------------------------------------------------- dropout
@SETTINGS
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       rate=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), bdims=st.sets(st.integers(-3, 2)),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_dropout_matches_bernoulli_formula(shape, rate, bdims, dtype, seed):
    bdims = tuple(d for d in bdims if -len(shape) <= d < len(shape))
    key = jax.random.key(seed)
    with x64_if(dtype):
        x = rand(seed, tuple(shape), dtype)

        def ref(x):
            if rate == 1.0:
                return jnp.zeros_like(x)
            if rate == 0.0:
                return x
            bshape = [1 if i in {d % x.ndim for d in bdims} else s
                      for i, s in enumerate(x.shape)]
            m = jnp.broadcast_to(jax.random.bernoulli(key, 1.0 - rate, bshape), x.shape)
            return lax.select(m, x / (1.0 - rate), jnp.zeros_like(x))

        sel = lambda x: S.dropout(key, x, rate, broadcast_dims=bdims)
        check_parity(sel, ref, [x], dtype)


# ---------------------------------------------------------------------- second order
def _second_order_cases():
    r = lambda i, s: rand(i, s, "float32")
    x, s3, b3 = r(0, (2, 5, 5, 3)), r(1, (3,)) + 1, r(2, (3,))
    dn = _DN[2]
    key = jax.random.key(1)
    return {
        "conv": (lambda x, w, b: S.conv(x, w, b, strides=2),
                 lambda x, w, b: lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                          dimension_numbers=dn) + b,
                 (x, r(3, (3, 3, 3, 4)), r(4, (4,)))),
        "conv_transpose": (lambda x, w: S.conv_transpose(x, w, strides=2),
                           lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME",
                                                           dimension_numbers=dn),
                           (x, r(3, (3, 3, 3, 4)))),
        "dense": (S.dense, lambda x, w, b: jnp.dot(x, w) + b, (x, r(5, (3, 4)), r(6, (4,)))),
        "layer_norm": (S.layer_norm, lambda x, s, b: nn.LayerNorm().apply(
            {"params": {"scale": s, "bias": b}}, x), (x, s3, b3)),
        "group_norm": (lambda x, s, b: S.group_norm(x, s, b, num_groups=3),
                       lambda x, s, b: nn.GroupNorm(num_groups=3).apply(
                           {"params": {"scale": s, "bias": b}}, x), (x, s3, b3)),
        "rms_norm": (S.rms_norm, lambda x, s: nn.RMSNorm().apply({"params": {"scale": s}}, x),
                     (x, s3)),
        "leaky_relu": (lambda x: S.leaky_relu(x, 0.1), lambda x: jax.nn.leaky_relu(x, 0.1),
                       (x,)),
        "dropout": (lambda x: S.dropout(key, x, 0.3),
                    lambda x: lax.select(jax.random.bernoulli(key, 0.7, x.shape), x / 0.7,
                                         jnp.zeros_like(x)), (x,)),
    }


def test_second_order_matches_plain():
    """grad of (grad(L) . v) w.r.t. all arguments, under jit, equals plain JAX's, for every
    primitive (one jit per side for all of them)."""
    cases = _second_order_cases()
    names = sorted(cases)

    def second(pick):
        def one(fn, args, seed):
            vs = [rand(seed + i, a.shape, "float32") for i, a in enumerate(args)]
            argnums = tuple(range(len(args)))
            loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))

            def hvp(*a):
                return sum(jnp.sum(g * v) for g, v in zip(jax.grad(loss, argnums)(*a), vs))

            return jax.grad(hvp, argnums)(*args)

        return jax.jit(lambda: [one(cases[k][pick], cases[k][2], 20 + 5 * i)
                                for i, k in enumerate(names)])()

    for name, got, want in zip(names, second(0), second(1)):
        for a, b in zip(got, want):
            _close(a, b, 1e-5, name)
