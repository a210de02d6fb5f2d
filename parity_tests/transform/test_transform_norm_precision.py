"""A converted normalisation computes JAX's own forward, bit for bit, under differentiation
(XLA:CPU), so gradients through ReLUs after it are JAX's too.

A ReLU's derivative jumps at 0: a forward that differs from JAX's by rounding alone flips the
mask wherever a ReLU input is that close to 0, and the gradient with it (a converted
ResNet-50's gradients were 3e-2 off JAX's on XLA:CPU, its forward 1e-5). The cause was
``1/sqrt(var + eps)`` (torch's spelling, ``TorchBatchNorm``): JAX's autodiff keeps the
``sqrt`` for its backward, so XLA computes ``divide(1, sqrt)``; in the converted forward
the ``sqrt`` had one use and XLA rewrote ``1/sqrt`` to ``rsqrt``, which differs in the last
bit for about a third of all inputs. Likewise the dividing spellings
``(x - mu) / sqrt(var + eps) * scale + bias`` (hand-written / PyTorch-style batch and layer
norms), ``scale * (x - mu) / sqrt(var + eps) + bias`` and a hand-written GPT block's
``(x - mu) * (scale / sqrt(var + eps)) + bias``: re-emitted as a multiplication by ``1/sqrt``
they differed in the last bit; they are re-emitted as divisions in the user's order
(``inv_mode='divide'`` / ``'scale_divide'`` / ``'scale_over_sd'``). Fresh random inputs per
run (``_util``)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.selective import normalize
from jaxmem.selective.norm import _recompute_out
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

pytestmark = pytest.mark.xla_cpu

C = 64


def _torch_bn(x, scale, bias, eps=1e-5):
    """``TorchBatchNorm``'s train-mode forward: two-pass variance, ``1/sqrt``."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.mean(jnp.square(x - mu), (0, 1, 2))
    return (x - mu) * (jnp.reciprocal(jnp.sqrt(var + eps)) * scale) + bias


def _flax_bn(x, scale, bias, eps=1e-5):
    """Flax's spelling: ``var = max(0, E[x^2] - E[x]^2)``, ``rsqrt``."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.maximum(0.0, jnp.mean(x * x, (0, 1, 2)) - mu * mu)
    return (x - mu) * (jax.lax.rsqrt(var + eps) * scale) + bias


def _div_bn(x, scale, bias, eps=1e-5):
    """A hand-written batch norm dividing the centred batch: ``(x - mu) / sqrt(var + eps)``,
    then ``* scale + bias``."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.mean(jnp.square(x - mu), (0, 1, 2))
    return (x - mu) / jnp.sqrt(var + eps) * scale + bias


def _scale_div_bn(x, scale, bias, eps=1e-5):
    """``scale * (x - mu) / sqrt(var + eps) + bias`` (the scale before the division), fast
    variance."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.maximum(0.0, jnp.mean(x * x, (0, 1, 2)) - mu * mu)
    return scale * (x - mu) / jnp.sqrt(var + eps) + bias


def _div_ln(x, scale, bias, eps=1e-5):
    """A PyTorch-style layer norm over the features: ``jnp.var``, ``(x - mu) / sqrt``."""
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.var(x, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * scale + bias


def _flax_ln(x, scale, bias, eps=1e-5):
    """Flax's layer norm spelling (``rsqrt``), the residual reference for :func:`_div_ln`."""
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
    return (x - mu) * (jax.lax.rsqrt(var + eps) * scale) + bias


def _eqx_ln(x, scale, bias, eps=1e-5):
    """Equinox's ``LayerNorm`` order: ``rstd`` times the centred input first, then the
    weight: ``weight * ((x - mu) * rsqrt(var + eps)) + bias``."""
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x, -1, keepdims=True))
    return scale * ((x - mu) * jax.lax.rsqrt(var + eps)) + bias


def _then_scale_bn(x, scale, bias, eps=1e-5):
    """``(x - mu) * (1 / sqrt(var + eps)) * scale + bias``: ``1/sqrt``, then the scale."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.mean(jnp.square(x - mu), (0, 1, 2))
    return (x - mu) * (1.0 / jnp.sqrt(var + eps)) * scale + bias


def _eqx_module_ln(x, scale, bias):
    """``eqx.nn.LayerNorm`` itself (vmapped), with this weight and bias."""
    eqx = pytest.importorskip("equinox")
    ln = eqx.nn.LayerNorm(x.shape[-1], eps=1e-5)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln, (scale, bias))
    return jax.vmap(jax.vmap(jax.vmap(jax.vmap(ln))))(x[None])[0]


#: the spellings multiplying by ``rstd`` before the scale (``inv_mode='*_then_scale'``)
THEN_SCALE = {"eqx-ln": _eqx_ln, "then-scale-1/sqrt-bn": _then_scale_bn,
              "eqx-module-ln": _eqx_module_ln}
_THEN_ARGS = [pytest.param(bn, id=name) for name, bn in THEN_SCALE.items()]

#: the dividing spellings: id -> (spelling, kind reported)
def _scale_over_sd_ln(x, scale, bias, eps=1e-5):
    """A hand-written GPT block's layer norm: ``(x - mu) * (scale / sqrt(var + eps)) + bias``
    (the scale divided first, an x-sized factor by broadcasting)."""
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * (scale / jnp.sqrt(var + eps)) + bias


DIVIDING = {"divide-bn": (_div_bn, "batch norm"), "scale-divide-bn": (_scale_div_bn, "batch norm"),
            "divide-ln": (_div_ln, "layer norm"),
            "scale-over-sd-ln": (_scale_over_sd_ln, "layer norm")}
_DIV_ARGS = [pytest.param(bn, id=name) for name, (bn, _) in DIVIDING.items()]


def _params():
    return {"w": normal((C, C), scale=C ** -0.5), "scale": normal((C,), scale=0.3) + 1.0,
            "bias": normal((C,), scale=0.3), "v": normal((C,))}


def _net(bn):
    """``relu(bn(x @ w) + skip)`` weighted; the normalised output is returned too."""
    def f(p, x, skip):
        y = bn(x @ p["w"], p["scale"], p["bias"])
        return jnp.sum(jax.nn.relu(y + skip) * p["v"]), y
    return f


def _value_grad_fn(fn):
    """One compiled program: ``((loss, y), (dp, dx))`` with ``x`` differentiated (the same
    jitted function for every call: traced once)."""
    return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))


def _value_grad(fn, p, x, skip):
    """:func:`_value_grad_fn` at ``(p, x, skip)``."""
    return _value_grad_fn(fn)(p, x, skip)


@pytest.mark.parametrize("bn", [pytest.param(_torch_bn, id="torch-1/sqrt"),
                                pytest.param(_flax_bn, id="flax-rsqrt"), *_DIV_ARGS,
                                *_THEN_ARGS])
def test_forward_under_grad_is_jaxs_bit_for_bit(bn):
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))     # per-channel offsets
    skip = normal(x.shape[:-1] + (C,))
    f = _net(bn)
    g = transform(f)
    rows = g.report(p, x, skip).by_kind("norm")
    assert [r.converted for r in rows] == [True]
    ((lg, yg), gg), ((lf, yf), gf) = _value_grad(g, p, x, skip), _value_grad(f, p, x, skip)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lf))
    close(gg, gf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bn", [pytest.param(_torch_bn, id="torch-1/sqrt"), *_DIV_ARGS,
                                *_THEN_ARGS])
def test_relu_at_its_kink_gets_jaxs_gradient(bn):
    """Half of the ReLU inputs exactly 0 in JAX's forward (``skip = -y``): the converted
    gradient is JAX's only if its forward is JAX's bit for bit (before the fix: O(1) off)."""
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    f = _net(bn)
    g = transform(f)
    zero = jnp.zeros(x.shape[:-1] + (C,))
    vg_f = _value_grad_fn(f)
    y = vg_f(p, x, zero)[0][1]          # JAX's forward, same program
    half = np.arange(y.size).reshape(y.shape) % 2 == 0
    skip = jnp.asarray(np.where(half, -np.asarray(y), np.asarray(normal(y.shape))))
    (_, yf), gf = vg_f(p, x, skip)
    np.testing.assert_array_equal(np.asarray(yf), np.asarray(y))
    _, gg = _value_grad(g, p, x, skip)
    close(gg, gf, rtol=1e-5, atol=1e-5)


def test_keeps_what_the_rsqrt_spelling_keeps():
    """``sqrt(var + eps)`` is kept instead of ``1/sqrt(var + eps)`` (same size): the
    ``1/sqrt`` spelling keeps what Flax's ``rsqrt`` one does, and less than JAX."""
    p = _params()
    x = normal((8, 4, 4, C))
    skip = jnp.zeros(x.shape)
    kept = {}
    for bn in (_torch_bn, _flax_bn):
        f = lambda p, x, bn=bn: _net(bn)(p, x, skip)[0]
        kept[bn] = residual_bytes(transform(f), p, x, argnums=(0, 1)).activation_bytes
        assert kept[bn] < residual_bytes(f, p, x, argnums=(0, 1)).activation_bytes
    assert kept[_torch_bn] == kept[_flax_bn], kept


def _converted_net(bn):
    """``(params, x, skip, f, transform(f), the report's norm rows)`` of :func:`_net`."""
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    skip = normal(x.shape)
    f = _net(bn)
    g = transform(f)
    return p, x, skip, f, g, g.report(p, x, skip).by_kind("norm")


@pytest.mark.parametrize("name", sorted(DIVIDING))
def test_dividing_spellings_converted_and_forward_is_jaxs(name):
    """The dividing spellings are converted (reported with their kind) and their plain
    jitted forward, without differentiation, is JAX's bit for bit too."""
    bn, kind = DIVIDING[name]
    p, x, skip, f, g, rows = _converted_net(bn)
    assert [r.converted for r in rows] == [True]
    assert rows[0].matched.startswith(kind) and "scale, bias" in rows[0].matched
    assert rows[0].became == "jaxmem.selective.normalize"
    (lg, yg), (lf, yf) = jax.jit(g)(p, x, skip), jax.jit(f)(p, x, skip)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lf))


@pytest.mark.parametrize("name", sorted(DIVIDING))
def test_dividing_spellings_keep_what_the_rsqrt_spelling_keeps(name):
    """No more than Flax's ``rsqrt`` spelling of the same norm (``x`` and two statistics),
    and less than JAX."""
    bn, kind = DIVIDING[name]
    p = _params()
    x = normal((8, 4, 4, C))
    skip = normal(x.shape)
    kept = {}
    for b in (bn, _flax_bn if kind == "batch norm" else _flax_ln):
        f = lambda p, x, skip, b=b: _net(b)(p, x, skip)[0]
        kept[b] = residual_bytes(transform(f), p, x, skip, argnums=(0, 1)).activation_bytes
        assert kept[b] < residual_bytes(f, p, x, skip, argnums=(0, 1)).activation_bytes
    assert kept[bn] <= min(kept.values()), kept


@pytest.mark.parametrize("argnums", [(0, 1, 2), (1, 2), (0,), (2,)],
                         ids=["all", "scale-bias", "x", "bias"])
@pytest.mark.parametrize("inv_mode", ["rsqrt", "recip_sqrt", "divide", "scale_divide",
                                      "scale_over_sd", "rsqrt_then_scale",
                                      "recip_sqrt_then_scale"])
def test_normalize_forward_and_recompute_are_the_spellings(inv_mode, argnums):
    """``normalize(inv_mode=...)`` under differentiation of any of its inputs computes the
    spelling's own forward bit for bit (JAX's program of it), its gradients JAX's to f32
    rounding; where ``x`` is differentiated, the output a following product recomputes
    (``_recompute_out``) is that forward bit for bit."""
    spell = {"rsqrt": lambda c, v, s, b: c * (jax.lax.rsqrt(v + 1e-5) * s) + b,
             "recip_sqrt": lambda c, v, s, b: c * (1.0 / jnp.sqrt(v + 1e-5) * s) + b,
             "divide": lambda c, v, s, b: c / jnp.sqrt(v + 1e-5) * s + b,
             "scale_divide": lambda c, v, s, b: s * c / jnp.sqrt(v + 1e-5) + b,
             "scale_over_sd": lambda c, v, s, b: c * (s / jnp.sqrt(v + 1e-5)) + b,
             "rsqrt_then_scale": lambda c, v, s, b: c * jax.lax.rsqrt(v + 1e-5) * s + b,
             "recip_sqrt_then_scale":
                 lambda c, v, s, b: c * (1.0 / jnp.sqrt(v + 1e-5)) * s + b}[inv_mode]
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    scale, bias, w = normal((C,), scale=0.3) + 1.0, normal((C,), scale=0.3), normal(x.shape)

    def jaxs(x, s, b, w=w):
        mu = jnp.mean(x, (0, 1, 2))
        y = spell(x - mu, jnp.mean(jnp.square(x - mu), (0, 1, 2)), s, b)
        return jnp.sum(jax.nn.relu(y) * w), (y, y)

    def ours(x, s, b):
        y, mu, var = normalize(x, s, b, axes=(0, 1, 2), feature_axes=(3,), eps=1e-5,
                               fast_variance=False, inv_mode=inv_mode)
        again = _recompute_out((1e-5, inv_mode), y.dtype, *jax.lax.stop_gradient(
            (x, mu, var)), s.reshape(1, 1, 1, C), b.reshape(1, 1, 1, C))
        return jnp.sum(jax.nn.relu(y) * w), (y, again)

    run = lambda fn: jax.jit(jax.value_and_grad(fn, argnums, has_aux=True))(x, scale, bias)
    ((_, (yg, again)), gg), ((_, (yf, _)), gf) = run(ours), run(jaxs)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    if 0 in argnums:
        np.testing.assert_array_equal(np.asarray(again), np.asarray(yf))
    close(gg, gf, rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        # the float64 program's gradients, through the f32 forward's ReLU mask (one program
        # per spelling: every input differentiated, the mask an argument)
        mw = np.where(np.asarray(yf) > 0, np.asarray(w, np.float64), 0.0)
        args = [np.asarray(a, np.float64) for a in (x, scale, bias)]
        g64 = jax.jit(jax.grad(lambda x, s, b, mw: jaxs(x, s, b, mw)[0], (0, 1, 2)))(*args, mw)
        g64 = tuple(np.asarray(g64[i], np.float32) for i in argnums)
    close(gg, g64, rtol=1e-5, atol=1e-5)


def _scale_first_bn(x, scale, bias, eps=1e-5):
    """``((x - mu) * scale) * rsqrt(var + eps) + bias``: an order no ``inv_mode`` rounds as."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.mean(jnp.square(x - mu), (0, 1, 2))
    return (x - mu) * scale * jax.lax.rsqrt(var + eps) + bias


def _bf16_stats_bn(x, scale, bias, eps=1e-5):
    """The variance rounded to bfloat16 and back inside the normalisation."""
    mu = jnp.mean(x, (0, 1, 2))
    var = jnp.mean(jnp.square(x - mu), (0, 1, 2)).astype(jnp.bfloat16).astype(jnp.float32)
    return (x - mu) * (jax.lax.rsqrt(var + eps) * scale) + bias


@pytest.mark.parametrize("bn,why", [
    pytest.param(_scale_first_bn, "order of operations", id="scale-first"),
    pytest.param(_bf16_stats_bn, "casts f32[", id="bf16-variance")])
def test_unreproducible_spellings_are_left_with_a_reason(bn, why):
    """A normalisation whose rounding no conversion reproduces (another order of
    operations; a cast to a narrower dtype inside it) is left as it is, reported with
    why; the program computes JAX's forward and gradients then."""
    p, x, skip, f, g, rows = _converted_net(bn)
    assert rows and not any(r.converted for r in rows), rows
    assert why in rows[0].reason and "bit-identical" in rows[0].reason, rows[0].reason
    ((lg, yg), gg), ((lf, yf), gf) = _value_grad(g, p, x, skip), _value_grad(f, p, x, skip)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lf))
    close(gg, gf, rtol=1e-5, atol=1e-5)


def _bf16_round_trip_ln(x, scale, bias, eps=1e-5):
    """``(x - mu) * rsqrt(var + eps)`` rounded to bfloat16 and back, then ``* scale +
    bias`` in float32."""
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    xhat = ((x - mu) * jax.lax.rsqrt(var + eps)).astype(jnp.bfloat16)
    return xhat.astype(jnp.float32) * scale + bias


def test_narrowing_cast_ends_the_normalisation():
    """A cast to bfloat16 and back after ``(x - mu) * rstd``: the conversion stops at the
    bfloat16 output (a normalisation without scale / bias, its output cast as the
    program's), the ``* scale + bias`` after the round trip stays JAX's; before the fix the
    whole region was one float32 layer norm, its gradients 1e-2 off. At the ReLU's kink."""
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    f = _net(_bf16_round_trip_ln)
    g = transform(f)
    rows = g.report(p, x, jnp.zeros(x.shape)).by_kind("norm")
    assert [r.converted for r in rows] == [True]
    assert "scale" not in rows[0].matched and "bias" not in rows[0].matched, rows[0].matched
    vg_f = _value_grad_fn(f)
    y = vg_f(p, x, jnp.zeros(x.shape))[0][1]
    half = np.arange(y.size).reshape(y.shape) % 2 == 0
    skip = jnp.asarray(np.where(half, -np.asarray(y), np.asarray(normal(y.shape))))
    ((lg, yg), gg), ((lf, yf), gf) = _value_grad(g, p, x, skip), vg_f(p, x, skip)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lf))
    close(gg, gf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [0.0, 0.5], ids=["zeros", "halves"])
def test_relu_after_a_uniform_constant_skip_is_converted(value):
    """``relu(norm(x) + skip)`` with ``skip`` a closed-over uniform constant of ``x``'s
    shape: the ReLU (with the ``+ skip``) is a 1-bit mask; its probe evaluated the constant
    at its traced shape against a flat probe before ("add: arrays must have the same number
    of dimensions")."""
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    skip = jnp.full(x.shape, value)
    f = lambda p, x: _net(_flax_bn)(p, x, skip)
    g = transform(f)
    rep = g.report(p, x)
    assert [r.converted for r in rep.by_kind("norm")] == [True]
    acts = [r for r in rep.by_kind("activation") if "custom_jvp_call" in r.matched]
    assert acts and all(r.converted for r in acts), [(r.matched, r.reason) for r in acts]
    run = lambda fn: jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(p, x)
    ((lg, yg), gg), ((lf, yf), gf) = run(g), run(f)
    np.testing.assert_array_equal(np.asarray(yg), np.asarray(yf))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lf))
    close(gg, gf, rtol=1e-5, atol=1e-5)
