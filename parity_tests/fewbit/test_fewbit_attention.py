"""Exact companions of the few-bit activations: selective.softmax / selective.attention.

Both must be exact (forward and gradient equal JAX's own autodiff, checked in float64 and
float32); only what autodiff stores changes (checked with the compiled-bytes slope).  In a
GPT converted with few-bit GELU + attention, everything but the GELU derivative stays exact.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close

import jaxmem
from jaxmem import selective
from jaxmem.measure import compiled_memory
from jaxmem.models import GPT, GPTConfig


def _rand(seed, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def _ref_attention(q, k, v, causal, scale=None):
    """Plain autodiff attention, the model zoo's arithmetic (heads-last layout)."""
    hd = q.shape[-1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    s = jnp.einsum("...thd,...shd->...hts", q, k) * jnp.asarray(scale, q.dtype)
    if causal:
        t, sl = s.shape[-2], s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((t, sl), bool), k=sl - t), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(s, axis=-1), v)


def _vjp_all(f, args, ct):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)


def _vjp_all_jit(f, args, ct):
    """:func:`_vjp_all` as one compiled program (op by op, a vjp is dozens of small
    compiles)."""
    return jax.jit(functools.partial(_vjp_all, f))(tuple(args), ct)


def _vjp_pair_jit(f, f0, args, ct, args0=None, ct0=None):
    """``(_vjp_all(f, args, ct), _vjp_all(f0, args0, ct0))`` -- a candidate and its reference
    -- as one compiled program (``args0`` / ``ct0`` default to ``args`` / ``ct``)."""
    args0 = args if args0 is None else args0
    ct0 = ct if ct0 is None else ct0

    def both(args, ct, args0, ct0):
        return _vjp_all(f, args, ct), _vjp_all(f0, args0, ct0)

    return jax.jit(both)(tuple(args), ct, tuple(args0), ct0)


# ------------------------------------------------------------------------------- softmax

def test_softmax_forward_and_gradient_match_jax_float64():
    """Axes -1, 0 and (0, 2), all in one compiled program."""
    axes = (-1, 0, (0, 2))
    with jax.enable_x64(True):
        x = _rand(0, (3, 5, 7), jnp.float64, 3.0)
        g = _rand(1, (3, 5, 7), jnp.float64)

        def all_axes(x, g):
            return [(_vjp_all(lambda x, a=a: selective.softmax(x, axis=a), (x,), g),
                     _vjp_all(lambda x, a=a: jax.nn.softmax(x, axis=a), (x,), g))
                    for a in axes]

        for axis, ((y, (dx,)), (y0, (dx0,))) in zip(axes, jax.jit(all_axes)(x, g)):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(y0), err_msg=str(axis))
            np.testing.assert_allclose(np.asarray(dx), np.asarray(dx0), rtol=1e-12, atol=1e-15,
                                       err_msg=str(axis))


def test_softmax_where_float32():
    """The forward (op by op) equals JAX's; the gradients (one compiled program) are close."""
    x = _rand(2, (4, 9), scale=2.0)
    where = jnp.asarray(np.random.default_rng(3).random((4, 9)) > 0.3)
    g = _rand(4, (4, 9))
    y = jax.vjp(lambda x: selective.softmax(x, where=where), x)[0]
    y0 = jax.nn.softmax(x, where=where)
    (_, (dx,)), (_, (dx0,)) = _vjp_pair_jit(lambda x: selective.softmax(x, where=where),
                                            lambda x: jax.nn.softmax(x, where=where), (x,), g)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    else:  # XLA:GPU may sum a row in another order inside another program: 1 ulp apart
        np.testing.assert_array_max_ulp(np.asarray(y), np.asarray(y0), maxulp=4)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx0), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(dx)[~np.asarray(where)] == 0)


@pytest.mark.filterwarnings("ignore::jaxmem.JaxmemDeprecationWarning")
def test_scope_patches_no_softmax():
    import flax.linen as nn
    orig = (jax.nn.softmax, nn.softmax)
    with jaxmem.scope(selective=False, attention=True):
        assert (jax.nn.softmax, nn.softmax) == orig
        x = _rand(5, (2, 6))
        np.testing.assert_array_equal(np.asarray(nn.softmax(x)), np.asarray(orig[0](x)))
    assert (jax.nn.softmax, nn.softmax) == orig


# ----------------------------------------------------------------------------- attention

def test_attention_matches_autodiff_float64():
    """(causal, T, S) in (False, 6, 6), (True, 6, 6), (True, 4, 7), (False, 5, 3), all in one
    compiled program."""
    cases = ((False, 6, 6), (True, 6, 6), (True, 4, 7), (False, 5, 3))
    with jax.enable_x64(True):
        data = [tuple(_rand(i, (2, n, 3, 4), jnp.float64) for i, n in enumerate((t, s, s, t)))
                for _, t, s in cases]

        def all_cases(data):
            out = []
            for (causal, _, _), (q, k, v, ct) in zip(cases, data):
                out.append((
                    _vjp_all(lambda q, k, v, c=causal: selective.attention(q, k, v, causal=c),
                             (q, k, v), ct),
                    _vjp_all(lambda q, k, v, c=causal: _ref_attention(q, k, v, c),
                             (q, k, v), ct)))
            return out

        for case, ((o, grads), (o0, grads0)) in zip(cases, jax.jit(all_cases)(data)):
            np.testing.assert_allclose(np.asarray(o), np.asarray(o0), rtol=1e-12, atol=1e-14,
                                       err_msg=str(case))
            assert_tree_close(grads, grads0, rtol=1e-10, atol=1e-12, err_msg=str(case))


def test_attention_float32_and_scale():
    """The forward, op by op, is bit-for-bit the model zoo's; the gradients (one compiled
    program) are close."""
    q, k, v = (_rand(i, (3, 8, 2, 4)) for i in range(3))
    ct = _rand(9, (3, 8, 2, 4))

    def f(q, k, v):
        return selective.attention(q, k, v, causal=True, scale=0.3)

    o = jax.vjp(f, q, k, v)[0]
    o0 = _ref_attention(q, k, v, True, 0.3)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o0))  # same forward arithmetic
    (_, grads), (_, grads0) = _vjp_pair_jit(
        f, lambda q, k, v: _ref_attention(q, k, v, True, 0.3), (q, k, v), ct)
    assert_tree_close(grads, grads0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_attention_low_precision_close_to_float32(dtype):
    q, k, v = (_rand(i, (2, 6, 2, 8)) for i in range(3))
    ct = _rand(7, (2, 6, 2, 8))
    low = [a.astype(dtype) for a in (q, k, v)]
    (o, grads), (o0, grads0) = _vjp_pair_jit(
        lambda q, k, v: selective.attention(q, k, v, causal=True),
        lambda q, k, v: _ref_attention(q, k, v, True), low, ct.astype(dtype), (q, k, v), ct)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = 6e-2 if dtype == jnp.bfloat16 else 1e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o0), rtol=tol, atol=tol)
    assert_tree_close(grads, grads0, rtol=tol, atol=tol)


def test_attention_under_jit_vmap_scan_checkpoint():
    """Gradients through jax.checkpoint, jax.vmap and lax.scan (all traced inside one jax.jit:
    one compile; the op-by-op custom_vjp is test_attention_float32_and_scale's)."""
    q, k, v = (_rand(i, (4, 5, 2, 3)) for i in range(3))

    def fa(q, k, v):
        return selective.attention(q, k, v, causal=True)

    def ra(q, k, v):
        return _ref_attention(q, k, v, True)

    def loss_of(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    def grads(f):
        return jax.grad(loss_of(f), argnums=(0, 1, 2))(q, k, v)

    # lax.scan: the same attention applied to a carried state
    def scan_of(f):
        def loss(q, k, v):
            out, _ = jax.lax.scan(lambda c, _: (f(c, k, v), None), q, None, length=3)
            return jnp.sum(jnp.sin(out))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    @jax.jit
    def everything():
        return {"ref": grads(ra), "plain": grads(fa), "checkpoint": grads(jax.checkpoint(fa)),
                # vmap over the batch axis of per-example calls
                "vmap": grads(jax.vmap(lambda q, k, v: fa(q[None], k[None], v[None])[0])),
                "scan": scan_of(fa), "scan_ref": scan_of(ra)}

    got = everything()
    ref, scan_ref = got.pop("ref"), got.pop("scan_ref")
    for name in ("plain", "checkpoint", "vmap"):
        assert_tree_close(got[name], ref, rtol=1e-5, atol=1e-6, err_msg=name)
    assert_tree_close(got["scan"], scan_ref, rtol=1e-5, atol=1e-6)


def test_attention_nonfinite_cotangent_stays_local():
    """A NaN in the cotangent of batch 0 must not leak into batch 1's gradients."""
    q, k, v = (_rand(i, (2, 5, 2, 3)) for i in range(3))
    ct = _rand(4, (2, 5, 2, 3)).at[0, 0, 0, 0].set(jnp.nan)
    (_, grads), (_, grads0) = _vjp_pair_jit(
        lambda q, k, v: selective.attention(q, k, v, causal=True),
        lambda q, k, v: _ref_attention(q, k, v, True), (q, k, v), ct)
    for a, b in zip(grads, grads0):
        assert np.all(np.isfinite(np.asarray(a[1])))
        np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-5, atol=1e-6)
        assert np.isnan(np.asarray(a[0])).any()


def test_attention_bad_input():
    q = _rand(0, (2, 4, 2, 3))
    with pytest.raises(TypeError, match="q must be float"):
        selective.attention(q.astype(jnp.int32), q, q)
    with pytest.raises(ValueError, match="must agree"):
        selective.attention(q, q[:, :, :1], q[:, :, :1])
    with pytest.raises(ValueError, match="rank"):
        selective.attention(q[0, 0], q[0, 0], q[0, 0])
    with pytest.raises(TypeError, match="causal must be a bool"):
        selective.attention(q, q, q, causal=1)
    with pytest.raises(TypeError, match="share a dtype"):
        selective.attention(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(TypeError, match="scale"):
        selective.attention(q, q, q, scale="x")
    with pytest.raises(TypeError, match="x must be float"):
        selective.softmax(jnp.arange(3))
    with pytest.raises(ValueError, match="axis 4 out of range"):
        selective.softmax(q, axis=4)
    with pytest.raises(TypeError, match="axis must be"):
        selective.softmax(q, axis=1.5)
    with pytest.raises(TypeError, match="where must be a boolean"):
        selective.softmax(q, where=jnp.ones(q.shape))


# -------------------------------------------------------------- GPT: only GELU' approximate

@functools.cache
def _gpt(n_layer, **convert):
    """(model, loss, params, tokens), the model ``jaxmem.linen.convert(GPT, **convert)`` when
    ``convert`` is given (with the untouched model's parameters: a conversion keeps the
    parameter tree); cached: every use wraps ``jax.grad(loss)`` anew, so each
    configuration is traced afresh."""
    cfg = GPTConfig(vocab=64, ctx=32, d_model=32, n_head=4, n_layer=n_layer)
    model = GPT(cfg)
    if convert:
        model = jaxmem.linen.convert(model, **convert)
        _, _, params, tok = _gpt(n_layer)
    else:
        tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, cfg.ctx)))
        params = jax.jit(model.init)(jax.random.PRNGKey(1), tok)

    def loss(p, tok):
        lp = jax.nn.log_softmax(model.apply(p, tok[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(lp, tok[:, 1:, None], -1))

    return model, loss, params, tok


def _cfg(bits=None, attn=False):
    """Few-bit GELU (the GPT's one smooth activation) and / or exact attention: the Linen
    calls traced inside run as ``jaxmem.linen.convert(model, selective=False, ...)``."""
    if bits is None and not attn:
        return contextlib.nullcontext()
    from jaxmem._glue.options import Options
    from jaxmem.linen import scope_options
    return scope_options(Options(selective=False, fewbit=bits, attention=attn))


def test_gpt_patched_attention_is_exact_only_gelu_derivative_approximate():
    # (the forward is checked bit-for-bit against the model zoo arithmetic in
    # test_attention_float32_and_scale; compiles are the cost here, so 4 gradients only)
    # one layer: its GELU, attention and MLP down-projection are what the check is about
    # (each gradient is its own program: test_attention_compiled_bytes_slope compiles the
    # one-layer few-bit ones again, loaded from the run's compilation cache)
    _, loss, params, tok = _gpt(1)
    _, loss_conv, _, _ = _gpt(1, fewbit=3)

    def grad(fn, **cfg):
        with _cfg(**cfg):
            return jax.jit(jax.grad(fn))(params, tok)

    g_exact = grad(loss)
    g_fb = grad(loss, bits=3)                       # few-bit GELU only
    # jaxmem.linen.convert(fewbit=3) runs jaxmem.transform: the GPT's one GELU is read by
    # the MLP's down-projection, and with a single such site the whole-program rule keeps
    # its 3-bit code (jaxmem.transform.fewbit_sites): the gradient is the few-bit one
    checks = [(grad(loss, bits=3, attn=True), g_fb), (grad(loss_conv), g_fb)]
    for got, want in checks:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert_tree_close(got, want, rtol=2e-5, atol=2e-6)
    # the few-bit gradient really differs from the exact one (the comparison can fail)
    diff = jax.tree_util.tree_map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))),
                                  g_fb, g_exact)
    assert max(jax.tree_util.tree_leaves(diff)) > 1e-4


def test_linen_scope_attention_scoped_and_restored():
    model, _, params, tok = _gpt(1)

    def jaxpr():
        return str(jax.make_jaxpr(model.apply)(params, tok))

    before = jaxpr()
    with _cfg(attn=True):
        inside = jaxpr()
    assert "custom_vjp" not in before and "custom_vjp" in inside
    assert jaxpr() == before


@pytest.mark.xla_cpu  # XLA:GPU plans differently: benchmarks/gpu, README
def test_attention_compiled_bytes_slope():
    """Per added layer, the exact attention removes at least one (B, H, T, T) float32 array
    (measured two on the benchmark GPT)."""
    def slope(ctx):
        tot = {}
        for n in (1, 2):
            _, loss, params, tok = _gpt(n)
            with ctx():
                tot[n] = compiled_memory(jax.grad(loss), params, tok).total_bytes
        return tot[2] - tot[1]

    b, h, t = 2, 4, 31
    tt = b * h * t * t * 4
    fb = slope(lambda: _cfg(bits=3))
    fb_attn = slope(lambda: _cfg(bits=3, attn=True))
    assert fb - fb_attn >= 0.95 * tt, (fb, fb_attn, tt)



# ------------------------------------------------------------- masked rows and empty sizes

def test_attention_causal_more_queries_than_keys_gradients():
    """causal with T > S: the first T - S query rows have no key.  Their weights are uniform
    (1 / S, as the masked softmax gives) and their dq is exactly 0; all gradients equal
    autodiff of the model zoo arithmetic."""
    with jax.enable_x64(True):
        q = _rand(0, (2, 5, 2, 4), jnp.float64)
        k, v = _rand(1, (2, 3, 2, 4), jnp.float64), _rand(2, (2, 3, 2, 4), jnp.float64)
        ct = _rand(3, (2, 5, 2, 4), jnp.float64)
        (o, grads), (o0, grads0) = _vjp_pair_jit(
            lambda q, k, v: selective.attention(q, k, v, causal=True),
            lambda q, k, v: _ref_attention(q, k, v, True), (q, k, v), ct)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o0), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(o[:, :2]),
                                   np.asarray(jnp.broadcast_to(v.mean(1, keepdims=True),
                                                               (2, 2, 2, 4))), rtol=1e-12)
        assert np.all(np.asarray(grads[0][:, :2]) == 0)
        assert_tree_close(grads, grads0, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("qs,ks", [((0, 3, 2, 4), (0, 3, 2, 4)), ((2, 0, 2, 4), (2, 3, 2, 4)),
                                   ((2, 3, 2, 4), (2, 0, 2, 4))])
def test_attention_zero_size(qs, ks):
    """Empty batch, T = 0 or S = 0 (zeros out, like plain JAX) forward and backward."""
    q, k = _rand(0, qs), _rand(1, ks)
    for causal in (False, True):
        (o, grads), (o0, grads0) = _vjp_pair_jit(
            lambda q, k, v, c=causal: selective.attention(q, k, v, causal=c),
            lambda q, k, v, c=causal: _ref_attention(q, k, v, c), (q, k, k), jnp.ones(qs))
        assert o.shape == qs
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o0))
        for a, b in zip(grads, grads0):
            assert a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_attention_bias_and_mask_match_jax():
    """bias/mask of the public attention against jax.nn.dot_product_attention (float64)."""
    with jax.enable_x64(True):
        q, k, v = (_rand(i, (2, 4, 3, 5), jnp.float64) for i in range(3))
        bias = _rand(3, (1, 3, 4, 4), jnp.float64)
        mask = jnp.asarray(np.random.default_rng(4).random((2, 1, 4, 4)) > 0.5)
        mask = mask.at[1, 0, 2].set(False)
        ct = _rand(5, (2, 4, 3, 5), jnp.float64)
        (o, grads), (o0, grads0) = _vjp_pair_jit(
            lambda q, k, v, b: selective.attention(q, k, v, bias=b, mask=mask),
            lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b, mask=mask),
            (q, k, v, bias), ct)
        # JAX's softmax runs in float32 even for float64 inputs
        np.testing.assert_allclose(np.asarray(o), np.asarray(o0), rtol=1e-6, atol=1e-7)
        assert_tree_close(grads, grads0, rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(grads[0][1, 2]) == 0)
    with pytest.raises(TypeError, match="mask must be a boolean"):
        selective.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                         mask=jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="bias of shape"):
        selective.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                         bias=jnp.ones((5, 4)))
