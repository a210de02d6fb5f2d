"""Flax's attention computed by jaxmem's exact core (jaxmem.fewbit.flax_attention).

Forward: Flax's own arithmetic, bit-for-bit on CPU.  Gradients: Flax's autodiff gradients
(float32 rtol 1e-5, float64 1e-10), with masks, bias, attention dropout (the keep mask
regenerated from the key), fully masked rows.  Memory: no ``T x S`` residual.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close
from flax import nnx

from jaxmem._compat import saved_residuals
from jaxmem.fewbit import flax_attention as fa
from jaxmem.measure import compiled_memory

B, T, S, H, D = 2, 5, 4, 3, 4


def _rand(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _inputs(dtype=jnp.float32):
    q, k, v = _rand(0, (B, T, H, D), dtype), _rand(1, (B, S, H, D), dtype), \
        _rand(2, (B, S, H, D), dtype)
    bias = _rand(3, (1, H, T, S), dtype)
    mask = jnp.asarray(np.random.default_rng(4).random((B, 1, T, S)) > 0.4)
    mask = mask.at[0, 0, 1].set(False)               # one fully masked query row
    return q, k, v, bias, mask, _rand(5, (B, T, H, D), dtype)


CASES = {
    "bias_mask": {"bias": True, "mask": True},
    "dropout": {"dropout_rate": 0.3},
    "dropout_full_bias_mask": {"dropout_rate": 0.3, "broadcast_dropout": False,
                               "bias": True, "mask": True},
    "dropout_deterministic": {"dropout_rate": 0.3, "deterministic": True, "mask": True},
}


def _call(fn, case, q, k, v, bias, mask, rng, **extra):
    kw = dict(case)
    kw["bias"] = bias if kw.pop("bias", False) else None
    kw["mask"] = mask if kw.pop("mask", False) else None
    if kw.get("dropout_rate"):
        kw["dropout_rng"] = rng
    return fn(q, k, v, **kw, **extra)


def _vjp(f, args, ct):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)


def _compare(pairs, args, ct, rtol=1e-5, atol=1e-6, exact=True):
    """For each ``(mine, flax)`` of ``pairs`` (a dict: name -> pair), the outputs (equal when
    ``exact``) and the input cotangents (close) of the two, all in one compiled program.
    Returns ``{name: ((o, grads), (o0, grads0))}``."""
    def run(args, ct):
        return {name: (_vjp(mine, args, ct), _vjp(flax, args, ct))
                for name, (mine, flax) in pairs.items()}

    res = jax.jit(run)(args, ct)
    for name, ((o, grads), (o0, grads0)) in res.items():
        if exact:
            np.testing.assert_array_equal(np.asarray(o), np.asarray(o0), err_msg=name)
        else:
            np.testing.assert_allclose(np.asarray(o), np.asarray(o0), rtol=rtol, atol=atol,
                                       err_msg=name)
        assert_tree_close(grads, grads0, rtol=rtol, atol=atol, err_msg=name)
    return res


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_drop_in_matches_flax_float32(flavour):
    """Every case of ``CASES``, in one compiled program per flavour."""
    q, k, v, bias, mask, ct = _inputs()
    rng = jax.random.PRNGKey(7) if flavour == "linen" else jax.random.key(7)
    mine, ref = ((fa.dot_product_attention, nn.dot_product_attention) if flavour == "linen"
                 else (fa.nnx_dot_product_attention, nnx.dot_product_attention))
    _compare({name: (lambda q, k, v, b, c=case: _call(mine, c, q, k, v, b, mask, rng),
                     lambda q, k, v, b, c=case: _call(ref, c, q, k, v, b, mask, rng))
              for name, case in CASES.items()}, (q, k, v, bias), ct)


def test_nnx_is_causal():
    """is_causal with dropout rates 0 and 0.25 (one compiled program)."""
    q, k, v, _, mask, ct = _inputs()

    def kw(dropout):
        return {"is_causal": True, "mask": mask, "dropout_rate": dropout,
                "dropout_rng": jax.random.key(1)}

    _compare({f"dropout={d}": (
        lambda q, k, v, d=d: fa.nnx_dot_product_attention(q, k, v, **kw(d)),
        lambda q, k, v, d=d: nnx.dot_product_attention(q, k, v, **kw(d)))
        for d in (0.0, 0.25)}, (q, k, v), ct)


@pytest.mark.slow
def test_float64_gradients_equal_flax():
    with jax.enable_x64(True):
        q, k, v, bias, mask, ct = _inputs(jnp.float64)
        pairs = {}
        for flavour, mine, ref, rng in [
                ("linen", fa.dot_product_attention, nn.dot_product_attention,
                 jax.random.PRNGKey(3)),
                ("nnx", fa.nnx_dot_product_attention, nnx.dot_product_attention,
                 jax.random.key(3))]:
            for name in ("bias_mask", "dropout_full_bias_mask"):
                if flavour == "nnx" and name == "bias_mask":
                    continue    # nnx/JAX: float32 softmax even for float64 (covered above)
                pairs[f"{flavour}-{name}"] = (
                    lambda q, k, v, b, f=mine, c=CASES[name], r=rng:
                    _call(f, c, q, k, v, b, mask, r),
                    lambda q, k, v, b, f=ref, c=CASES[name], r=rng:
                    _call(f, c, q, k, v, b, mask, r))
        _compare(pairs, (q, k, v, bias), ct, rtol=1e-10, atol=1e-12, exact=False)


def test_fully_masked_rows_uniform_and_no_query_gradient():
    """Flax's masked softmax gives a row with no key uniform weights 1/S; no score of that
    row depends on q or k, so its dq is 0 -- the drop-in returns exactly that."""
    q, k, v, _, _, ct = _inputs()
    mask = jnp.ones((B, 1, T, S), bool).at[:, :, 2].set(False)
    res = _compare({"": (lambda q, k, v: fa.dot_product_attention(q, k, v, mask=mask),
                         lambda q, k, v: nn.dot_product_attention(q, k, v, mask=mask))},
                   (q, k, v), ct)
    (o, (dq, _, _)), _ = res[""]
    np.testing.assert_allclose(np.asarray(o[:, 2]), np.asarray(jnp.mean(v, axis=1)),
                               rtol=1e-6)
    assert np.all(np.asarray(dq[:, 2]) == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_low_precision_forward_equal_flax(dtype):
    """Three configurations, each drop-in and its Flax original, in one compiled program."""
    q, k, v, _, mask, _ = _inputs(dtype)
    configs = [(fa.dot_product_attention, nn.dot_product_attention, {}),
               (fa.dot_product_attention, nn.dot_product_attention,
                {"force_fp32_for_softmax": True}),
               (fa.nnx_dot_product_attention, nnx.dot_product_attention, {})]

    @jax.jit
    def run(q, k, v):
        def out_and_grad(f, kw):
            def loss(q):
                return jnp.sum(f(q, k, v, mask=mask, **kw).astype(jnp.float32))
            return f(q, k, v, mask=mask, **kw), jax.grad(loss)(q)
        return [(out_and_grad(mine, kw), out_and_grad(ref, kw)) for mine, ref, kw in configs]

    for i, ((o, g), (o0, g0)) in enumerate(run(q, k, v)):
        assert o.dtype == o0.dtype
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o0, np.float32),
                                      err_msg=str(i))
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g0, np.float32),
                                   rtol=5e-2, atol=5e-2, err_msg=str(i))


def test_fallbacks_run_flax():
    q, k, v, _, mask, _ = _inputs()
    # custom einsums: Flax's function
    ein = jnp.einsum
    o = fa.dot_product_attention(q, k, v, mask=mask, qk_attn_weights_einsum=ein,
                                 attn_weights_value_einsum=ein)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(nn.dot_product_attention(
        q, k, v, mask=mask)))
    # grouped-query attention (nnx): Flax's function
    kg, vg = k[:, :, :1], v[:, :, :1]
    np.testing.assert_array_equal(np.asarray(fa.nnx_dot_product_attention(q, kg, vg)),
                                  np.asarray(nnx.dot_product_attention(q, kg, vg)))
    with pytest.raises(ValueError, match="key and value lengths must match"):
        fa.dot_product_attention(q, k, v[:, :2])


def test_dropout_mask_is_not_a_residual():
    """Only the key, q, k, v, mask and O(T) row statistics are saved: nothing (T, S)."""
    q, k, v, _, mask, _ = _inputs()
    t_s = (T, S)

    def f(q, k, v):
        return jnp.sum(fa.dot_product_attention(q, k, v, mask=mask, dropout_rate=0.4,
                                                dropout_rng=jax.random.PRNGKey(0),
                                                broadcast_dropout=False))

    def f0(q, k, v):
        return jnp.sum(nn.dot_product_attention(q, k, v, mask=mask, dropout_rate=0.4,
                                                dropout_rng=jax.random.PRNGKey(0),
                                                broadcast_dropout=False))

    def big(fun):
        return [a.shape for a, why in saved_residuals(fun, q, k, v)
                if jnp.issubdtype(a.dtype, jnp.floating) and tuple(a.shape[-2:]) == t_s]

    assert big(f0)                 # Flax keeps (B, H, T, S) arrays ...
    assert not big(f)              # ... the drop-in none


@pytest.mark.xla_cpu
def test_compiled_bytes_slope_with_dropout():
    """Per stacked attention layer with dropout, at least one float32 (B, H, T, T) array
    fewer in XLA's plan."""
    b, t, h, d = 2, 64, 4, 8

    def step(fn, n):
        def loss(x):
            for i in range(n):
                x = x + fn(x, x, x, dropout_rate=0.2, dropout_rng=jax.random.PRNGKey(i))
                x = jnp.tanh(x)
            return jnp.sum(x)
        return compiled_memory(jax.grad(loss), _rand(0, (b, t, h, d))).total_bytes

    def slope(fn):
        return (step(fn, 4) - step(fn, 2)) / 2

    tt = b * h * t * t * 4
    assert slope(nn.dot_product_attention) - slope(fa.dot_product_attention) >= 0.95 * tt


@pytest.mark.slow
def test_under_jit_vmap_scan_checkpoint():
    q, k, v, _, mask, _ = _inputs()
    rng = jax.random.PRNGKey(2)

    def loss_of(fn):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(fn(q, k, v, mask=mask, dropout_rate=0.2, dropout_rng=rng)))
        return loss

    def grads(loss):
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def per_example(fn):
        return lambda q, k, v: jnp.sum(jax.vmap(
            lambda q, k, v, m: fn(q, k, v, mask=m))(q, k, v, mask))

    def scanned(fn):
        def loss(q, k, v):
            out, _ = jax.lax.scan(lambda c, _: (fn(c, k, v, mask=mask), None), q, None,
                                  length=2)
            return jnp.sum(jnp.sin(out))
        return loss

    mine = loss_of(fa.dot_product_attention)

    @jax.jit  # every variant and its Flax reference in one compiled program
    def run():
        return {"plain": (grads(mine), grads(loss_of(nn.dot_product_attention))),
                "checkpoint": (grads(jax.checkpoint(mine)),
                               grads(loss_of(nn.dot_product_attention))),
                "vmap": (grads(per_example(fa.dot_product_attention)),
                         grads(per_example(nn.dot_product_attention))),
                "scan": (grads(scanned(fa.dot_product_attention)),
                         grads(scanned(nn.dot_product_attention)))}

    for name, (got, want) in run().items():
        assert_tree_close(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


# ------------------------------------------------------------- as a module's attention_fn

def _cores(fn, *args):
    """Number of custom_vjp calls in a trace of ``fn``."""
    return str(jax.make_jaxpr(fn)(*args)).count("custom_vjp")


def test_linen_module_with_the_drop_in_and_dropout_equals_flax():
    x = _rand(0, (2, 6, 8))
    kw = {"num_heads": 2, "dropout_rate": 0.3, "deterministic": False}
    m0 = nn.MultiHeadDotProductAttention(**kw)
    m1 = nn.MultiHeadDotProductAttention(**kw, attention_fn=fa.dot_product_attention)
    p = m0.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x)
    mask = nn.make_causal_mask(x[..., 0])

    def loss(m):
        return lambda p: jnp.sum(m.apply(p, x, mask=mask,
                                         rngs={"dropout": jax.random.PRNGKey(2)}) ** 2)

    (y0, g0), (y1, g1) = jax.jit(lambda p: (jax.value_and_grad(loss(m0))(p),
                                            jax.value_and_grad(loss(m1))(p)))(p)
    assert _cores(loss(m1), p) == _cores(loss(m0), p) + 1
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    assert_tree_close(g1, g0, rtol=1e-5, atol=1e-5)


def test_nnx_module_with_the_drop_in_and_dropout_equals_flax():
    x = _rand(0, (2, 6, 8))

    def loss_and_state(fn):
        net = nnx.MultiHeadAttention(2, 8, dropout_rate=0.2, decode=False, keep_rngs=False,
                                     attention_fn=fn, rngs=nnx.Rngs(0))
        gd, params, rest = nnx.split(net, nnx.Param, ...)

        def loss(params, rest, x):
            y = nnx.merge(gd, params, rest)(x, deterministic=False,
                                            rngs=nnx.Rngs(dropout=jax.random.key(4)))
            return jnp.sum(y ** 2)
        return loss, params, rest

    loss0, p0, r0 = loss_and_state(nnx.dot_product_attention)
    loss1, p1, r1 = loss_and_state(fa.nnx_dot_product_attention)
    assert _cores(loss1, p1, r1, x) == _cores(loss0, p0, r0, x) + 1
    g0, g1 = jax.jit(lambda p0, r0, p1, r1: (jax.grad(loss0)(p0, r0, x),
                                             jax.grad(loss1)(p1, r1, x)))(p0, r0, p1, r1)
    assert_tree_close(g1, g0, rtol=1e-5, atol=1e-5)
