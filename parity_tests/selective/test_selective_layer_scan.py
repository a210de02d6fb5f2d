"""Selective conversion under layer scans: ``nn.scan``, ``nn.scan(nn.remat)``, ``lax.scan``.

Under ``lax.scan`` JAX fixes the residuals of one layer in the jaxpr and stacks each of them
over the layers; XLA cannot recompute an elementwise value in the backward pass across the
while loop as it does in an unrolled network. A LayerNorm followed by a Dense therefore kept
two input-sized tensors per layer (the norm's input for the norm's backward, the norm's output
for the Dense's weight gradient) where the unrolled network keeps one. The Dense now recomputes
its input from the norm's residuals (``_core.recipe``), so one is stacked.
"""
from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close, scaled_atol
from _data import normal
from jax import lax

import jaxmem.selective as S
from jaxmem.linen import convert as _linen_convert
from jaxmem.measure import compiled_memory, residual_bytes
from jaxmem.models.transformer import SelfAttention


def _convert(model):
    """The one way in, selective part only."""
    return _linen_convert(model, selective=True, fewbit=None, attention=False)


B, T, D = 4, 16, 32
F32 = 4


class _Block(nn.Module):
    attention: bool = True

    @nn.compact
    def __call__(self, x, _):
        if self.attention:
            x = x + SelfAttention(2, True, name="attn")(nn.LayerNorm(name="ln_1")(x))
        h = nn.Dense(4 * D, name="c_fc")(nn.LayerNorm(name="ln_2")(x))
        return x + nn.Dense(D, name="c_proj")(nn.relu(h)), None


class _Net(nn.Module):
    """``mode``: 'unrolled' (a Python loop), 'scan' (``nn.scan``), 'scan_remat'."""

    mode: str
    depth: int
    attention: bool = True

    @nn.compact
    def __call__(self, x):
        if self.mode == "unrolled":
            for i in range(self.depth):
                x, _ = _Block(self.attention, name=f"h_{i}")(x, None)
        else:
            blk = nn.remat(_Block, prevent_cse=False) if self.mode == "scan_remat" else _Block
            x, _ = nn.scan(blk, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.depth)(self.attention, name="h")(x, None)
        return nn.LayerNorm(name="ln_f")(x)


@functools.cache
def _data(mode, depth, attention):
    """``(x, ct, params)`` of one configuration, made once: the converted and the default
    model share them (conversion changes no parameter); a jitted ``init`` is one compile where
    an eager one is one per initialiser op."""
    model = _Net(mode, depth, attention)
    x = normal(0, (B, T, D))
    ct = normal(1, (B, T, D))
    return x, ct, jax.jit(model.init)(jax.random.key(2), x)["params"]


def _setup(mode, depth, attention=True, convert=False):
    model = _Net(mode, depth, attention)
    x, ct, params = _data(mode, depth, attention)
    m = _convert(model) if convert else model

    def loss(p, x):
        return jnp.sum(m.apply({"params": p}, x) * ct)
    return loss, params, x


def _param_bytes_per_layer(params):
    return sum(a.nbytes for a in jax.tree.leaves(params["h"])) // jax.tree.leaves(
        params["h"])[0].shape[0]


def _close(a, b, rtol=1e-5):
    """Leaf by leaf, with an absolute slack of ``rtol`` times the leaf's largest entry (sums
    that cancel to ~0 differ by float32 rounding of their terms)."""
    assert_tree_close(a, b, rtol=rtol, atol=scaled_atol(rtol, floor=1e-30))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------ gradients
@pytest.mark.slow
@pytest.mark.parametrize("mode,attention", [("scan", True), ("scan_remat", False)])
def test_grads_under_nn_scan_equal_unconverted(mode, attention):
    ref_loss, params, x = _setup(mode, 2, attention)
    our_loss, _, _ = _setup(mode, 2, attention, convert=True)
    # the loss itself (the primal path, not the forward of the differentiated one) and its
    # gradient, in one program a side
    both = lambda loss: jax.jit(lambda p, x: (jax.grad(loss, (0, 1))(p, x), loss(p, x)))
    g_ref, v_ref = both(ref_loss)(params, x)
    g_our, v_our = both(our_loss)(params, x)
    _close(g_our, g_ref)
    np.testing.assert_allclose(v_our, v_ref, rtol=1e-5)


@pytest.mark.parametrize("norm", ["layer", "rms", "layer_no_affine"])
def test_norm_then_dense_under_lax_scan_and_checkpoint(norm):
    """The Dense that recomputes its input from the norm's residuals gives JAX's gradients,
    also when only some of (input, scale, kernel) are differentiated (jax#16614: the scan
    fixpoint sees other ``.perturbed`` flags) and under ``jax.checkpoint``."""
    x = normal((3, 0), (6, 8))
    s = normal((3, 1), (3, 8), 0.1, 1.0)
    w = normal((3, 2), (3, 8, 8), 0.3)

    def ln(h, sc, ours):
        if norm == "rms":
            return S.rms_norm(h, sc) if ours else nn.RMSNorm(epsilon=1e-6).apply(
                {"params": {"scale": sc}}, h)
        if norm == "layer_no_affine":
            return S.layer_norm(h) if ours else nn.LayerNorm(
                use_bias=False, use_scale=False).apply({}, h)
        return S.layer_norm(h, sc, 0.5 * sc) if ours else nn.LayerNorm().apply(
            {"params": {"scale": sc, "bias": 0.5 * sc}}, h)

    def make(ours, remat):
        def body(h, p):
            sc, wi = p
            y = ln(h, sc, ours)
            z = S.dense(y, wi) if ours else y @ wi
            return h + jnp.tanh(z), None
        if remat:
            body = jax.checkpoint(body)

        def loss(x, s, w):
            h, _ = lax.scan(body, x, (s, w))
            return jnp.sum(h * jnp.cos(h))
        return loss

    cases = [(False, (0, 1, 2)), (True, (0, 1, 2))]
    if norm == "layer":
        cases += [(False, (0,)), (False, (1,)), (False, (2,))]

    def all_grads(ours):
        # one jit a side for all cases: each case is its own trace (its own ``.perturbed``
        # flags), compiled together
        return jax.jit(lambda *a: [jax.grad(make(ours, remat), argnums)(*a)
                                   for remat, argnums in cases])(x, s, w)

    for case, got, want in zip(cases, all_grads(True), all_grads(False)):
        assert_tree_close(got, want, rtol=1e-5, atol=scaled_atol(1e-5, floor=1e-30),
                          err_msg=f"remat, argnums = {case}")


def test_norm_output_not_kept_twice():
    """LayerNorm -> Dense keeps one input-sized tensor (the norm's input), not also the norm's
    output; bias-only training of the Dense keeps nothing input-sized."""
    x, w = normal((4, 0), (16, 32)), normal((4, 1), (32, 8))
    s, b = jnp.ones(32), jnp.zeros(32)
    f = lambda x, s, b, w: jnp.sum(jnp.sin(S.dense(S.layer_norm(x * 2.0, s, b), w)))
    big = lambda r: [e for e in r.entries if e.kind == "activation" and e.nbytes >= x.nbytes]
    assert len(big(residual_bytes(f, x, s, b, w, argnums=(0, 1, 2, 3)))) == 1
    assert len(big(residual_bytes(f, x, s, b, w, argnums=(3,)))) == 1  # frozen norm: y
    assert len(big(residual_bytes(f, x, s, b, w, argnums=(2,)))) == 0


# ----------------------------------------------------------------- compiled bytes (slope)
def _slope(mode, convert, attention, depth=2):
    """Compiled bytes per added layer of the jitted gradient (temp + output + argument -
    alias), and residual bytes per added layer."""
    def at(d):
        loss, params, x = _setup(mode, d, attention, convert)
        c = compiled_memory(jax.grad(loss), params, x)
        r = residual_bytes(loss, params, x)
        return c.total_bytes, r.activation_bytes, _param_bytes_per_layer(params)
    (c1, r1, p), (c2, r2, _) = at(depth), at(2 * depth)
    return (c2 - c1) / depth, (r2 - r1) / depth, p


@pytest.mark.slow
@pytest.mark.xla_cpu
def test_scan_stacks_one_tensor_per_norm_and_keeps_the_saving():
    """Under ``nn.scan`` (two or more layers: XLA removes a loop of one trip) XLA keeps
    exactly the stacked residuals (no copies of the carry, no
    extra update buffers): compiled slope = residual slope + parameters + their gradients,
    for the default model and the converted one, so the residual saving is the compiled
    saving. The converted MLP block stacks per layer: the norm's input (B T D f32) and
    statistics, the 1-bit ReLU mask and the ReLU output (the second Dense's input)."""
    c_def, r_def, p = _slope("scan", False, False)
    c_our, r_our, _ = _slope("scan", True, False)
    assert c_def == pytest.approx(r_def + 2 * p, rel=0.01)
    assert c_our == pytest.approx(r_our + 2 * p, rel=0.01)
    hidden = B * T * 4 * D
    budget = B * T * D * F32 + hidden * F32 + hidden // 8 + 4 * B * T * F32 + 4 * D * F32
    assert c_our - 2 * p <= budget, (c_our - 2 * p, budget)  # the norm's output: + B T D f32
    assert c_def - c_our >= 0.98 * (r_def - r_our)


def _lax_scan_mlp(depth, ours):
    """``depth`` pre-LN ReLU MLP blocks under a hand-written ``lax.scan`` (functional)."""
    params = {"s": normal((5, 0), (depth, D), 0.1, 1.0),
              "b": normal((5, 1), (depth, D), 0.1),
              "w1": normal((5, 2), (depth, D, 4 * D), 0.2),
              "w2": normal((5, 3), (depth, 4 * D, D), 0.2)}
    x = normal(6, (B * T, D))

    def body(h, p):
        if ours:
            y = S.dense(S.relu(S.dense(S.layer_norm(h, p["s"], p["b"]), p["w1"])), p["w2"])
        else:
            y = jax.nn.relu(nn.LayerNorm().apply({"params": {"scale": p["s"], "bias": p["b"]}},
                                                 h) @ p["w1"]) @ p["w2"]
        return h + y, None

    def loss(params, x):
        return jnp.sum(jnp.sin(lax.scan(body, x, params)[0]))
    return loss, params, x


@pytest.mark.xla_cpu
def test_lax_scan_stacks_one_tensor_per_norm():
    """Hand-written ``lax.scan``: per layer the compiled plan holds the parameters and their
    gradients plus exactly: the norm's input (B T D f32) and statistics, the ReLU mask (1 bit)
    and the ReLU output (the second Dense's input) -- not also the norm's output."""
    def at(d):
        loss, params, x = _lax_scan_mlp(d, True)
        return compiled_memory(jax.grad(loss), params, x).total_bytes
    c = (at(4) - at(2)) / 2
    p = (2 * D + 8 * D * D) * F32
    hidden = B * T * 4 * D
    budget = B * T * D * F32 + hidden * F32 + hidden // 8 + 4 * B * T * F32 + 4 * D * F32
    assert c - 2 * p <= budget, (c - 2 * p, budget)
    loss, params, x = _lax_scan_mlp(2, True)
    ref, _, _ = _lax_scan_mlp(2, False)
    _close(jax.jit(jax.grad(loss))(params, x), jax.jit(jax.grad(ref))(params, x))
