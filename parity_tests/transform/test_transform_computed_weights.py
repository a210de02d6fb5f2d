"""``jaxmem.transform(..., computed_weights=True)``: a dense product's weight computed from the
function's inputs (a merged LoRA weight ``W + A B / r``, a cast ``W.astype(bfloat16)``) is
recomputed from them in the backward pass instead of kept.

Checked: the report says which products recompute their weight (not the adapter's own
``A B``, not a weight that is an input or a mere relayout of one, not a weight made from an
activation); loss and gradients equal the untouched function's (rtol 1e-5 against the
largest entry; float64 within 1e-4); the merged weights leave the residuals (their bytes,
exactly) and the compiled temp on both plans; ``computed_weights=False`` keeps them; ``jit``,
``vmap``, ``scan`` + ``checkpoint`` (a scan body's weights are not recorded: exact there too),
a scanned LoRA stack (the scan policy recomputes the merged weights: none is stacked) and
bf16 casts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.measure.residuals import residual_bytes

D, F, L, RANK = 32, 64, 3, 4
RECOMPUTED = "recomputed from them where x is"


def _setup(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)
    frozen = [{"w1": f(D, F, scale=D ** -0.5), "w2": f(F, D, scale=F ** -0.5),
               "g": 1 + f(D, scale=0.1)} for _ in range(L)]
    lora = [{k: (f(v.shape[0], RANK, scale=0.1), f(RANK, v.shape[1], scale=0.1))
             for k, v in layer.items() if v.ndim == 2} for layer in frozen]
    x = f(4, 16, D)
    return lora, frozen, x


def loss(lora, frozen, x):
    """A pre-norm MLP stack with LoRA adapters merged into its weights, as JAX LoRA code is
    usually written."""
    for fl, ll in zip(frozen, lora):
        w1 = fl["w1"] + ll["w1"][0] @ ll["w1"][1] / RANK
        w2 = fl["w2"] + ll["w2"][0] @ ll["w2"][1] / RANK
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * fl["g"]
        x = x + jax.nn.gelu(h @ w1) @ w2
    return jnp.mean(x ** 2)


def _close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   atol=rtol * scale, rtol=0)


def _recomputed_rows(f, *args):
    return [r for r in f.report(*args) if r.kind == "dot" and RECOMPUTED in r.reason]


def test_lora_weights_recomputed_exact_and_reported():
    lora, frozen, x = _setup()
    lean = jaxmem.transform(loss)
    rows = _recomputed_rows(lean, lora, frozen, x)
    assert len(rows) == 2 * L  # the two products per layer; the adapters' own A B are not
    assert all("f32[4,16," in r.matched for r in rows)
    v0, g0 = jax.value_and_grad(loss)(lora, frozen, x)
    v1, g1 = jax.jit(jax.value_and_grad(lean))(lora, frozen, x)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    _close(g1, g0)
    with jax.enable_x64():
        l64, f64, x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (lora, frozen, x))
        _close(g1, jax.grad(loss)(l64, f64, x64), rtol=1e-4)


def test_merged_weights_leave_the_residuals():
    lora, frozen, x = _setup()
    on = residual_bytes(jaxmem.transform(loss), lora, frozen, x, argnums=0)
    off = residual_bytes(jaxmem.transform(loss, computed_weights=False), lora, frozen, x,
                         argnums=0)
    assert not _recomputed_rows(jaxmem.transform(loss, computed_weights=False), lora, frozen, x)
    # every merged weight but the first layer's ``w1`` (its input, from ``x``, is not
    # differentiated: nothing keeps it); kept instead: the frozen weights, step arguments
    merged = (2 * L - 1) * D * F * 4
    assert off.activation_bytes - on.activation_bytes == merged, (off, on)
    assert on.argument_bytes - off.argument_bytes >= merged  # the parameters, instead


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_compiled_step_keeps_less(target):
    if target != "cpu" and not gpu_plan_available():
        pytest.skip("the GPU plan needs the CUDA compiler plugin (.venv/gpu-plan)")
    rng = np.random.default_rng(3)
    d, f = 256, 1024  # one merged weight is 1 MiB
    frozen = [{"w1": jnp.asarray(rng.standard_normal((d, f)) / 16, jnp.float32),
               "w2": jnp.asarray(rng.standard_normal((f, d)) / 32, jnp.float32),
               "g": jnp.ones(d)} for _ in range(L)]
    lora = [{k: (jnp.asarray(rng.standard_normal((v.shape[0], RANK)) * .1, jnp.float32),
                 jnp.asarray(rng.standard_normal((RANK, v.shape[1])) * .1, jnp.float32))
             for k, v in layer.items() if v.ndim == 2} for layer in frozen]
    x = jnp.asarray(rng.standard_normal((4, 64, d)), jnp.float32)

    def temp(fn):
        return compiled_memory(jax.grad(fn), lora, frozen, x, target=target).temp_bytes

    on, off = temp(jaxmem.transform(loss)), temp(jaxmem.transform(loss,
                                                                  computed_weights=False))
    assert off - on >= 2 * d * f * 4, (off / 2**20, on / 2**20)


def test_not_recorded():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((D, F)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((128, D)), jnp.float32)  # more elements than w
    cases = {
        "input": lambda w, x: jnp.sum(jnp.tanh(x @ w)),
        "relayout": lambda w, x: jnp.sum(jnp.tanh(x @ w.T.T.reshape(D, F))),
        "from a larger array": lambda w, x: jnp.sum(jnp.tanh(x @ (w * jnp.mean(x)))),
    }
    for name, fn in cases.items():
        lean = jaxmem.transform(fn)
        assert not _recomputed_rows(lean, w, x), name
        _close(jax.grad(lean, (0, 1))(w, x), jax.grad(fn, (0, 1))(w, x))


def test_bf16_cast_weights():
    """Mixed precision: f32 parameters cast to bf16 where they are used; the casts are
    recomputed, the gradients are the untouched function's (both bf16 arithmetic)."""
    _, frozen, x = _setup(2)

    def mixed(frozen, x):
        x = x.astype(jnp.bfloat16)
        for fl in frozen:
            h = jax.nn.gelu(x @ fl["w1"].astype(jnp.bfloat16))
            x = x + h @ fl["w2"].astype(jnp.bfloat16)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    lean = jaxmem.transform(mixed)
    assert len(_recomputed_rows(lean, frozen, x)) == 2 * L
    g0 = jax.grad(mixed)(frozen, x)
    g1 = jax.jit(jax.grad(lean))(frozen, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=2e-2 * float(jnp.max(jnp.abs(b))), rtol=0)
    on = residual_bytes(lean, frozen, x).activation_bytes
    off = residual_bytes(jaxmem.transform(mixed, computed_weights=False), frozen,
                         x).activation_bytes
    assert off - on == (2 * L - 1) * D * F * 2  # not the first (its input is not differentiated)


def test_vmap_scan_checkpoint():
    lora, frozen, x = _setup(4)
    lean = jaxmem.transform(loss)
    xs = jnp.stack([x, 2 * x])
    per = jax.vmap(jax.grad(lean), (None, None, 0))(lora, frozen, xs)
    want = jax.vmap(jax.grad(loss), (None, None, 0))(lora, frozen, xs)
    _close(per, want)

    stack = jax.tree.map(lambda *a: jnp.stack(a), *frozen)
    adapters = jax.tree.map(lambda *a: jnp.stack(a), *lora)

    def scanned(adapters, stack, x):
        def body(x, layer):
            ll, fl = layer
            return jax.checkpoint(lambda x: _block(x, ll, fl))(x), None
        return jnp.mean(jax.lax.scan(body, x, (adapters, stack))[0] ** 2)

    lean_scan = jaxmem.transform(scanned)
    assert not _recomputed_rows(lean_scan, adapters, stack, x)  # inside a scan body
    _close(jax.jit(jax.grad(lean_scan))(adapters, stack, x),
           jax.grad(scanned)(adapters, stack, x))


def test_scanned_lora_stack_stacks_no_merged_weight():
    """LoRA in a ``lax.scan`` over stacked layers (``nn.scan``, ``nnx.scan``): the merged
    weight is made in the body from its slices, not from the function's inputs, so it is not
    recorded; the converted body runs under the scan policy, which recomputes it (an ``add``
    of slices the scan forwards) instead of stacking it. Untouched, JAX stacks both merged
    weights of every layer."""
    lora, frozen, x = _setup(6)
    stack = jax.tree.map(lambda *a: jnp.stack(a), *frozen)
    adapters = jax.tree.map(lambda *a: jnp.stack(a), *lora)

    def scanned(adapters, stack, x):
        def body(x, layer):
            ll, fl = layer
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * fl["g"]
            return _block(h, ll, fl) - h + x, None
        return jnp.mean(jax.lax.scan(body, x, (adapters, stack))[0] ** 2)

    merged = {(L, D, F), (L, F, D)}

    def stacked_weights(fn):
        rep = residual_bytes(fn, adapters, stack, x)
        return {e.shape for e in rep.by_kind("activation")} & merged

    lean = jaxmem.transform(scanned)
    assert stacked_weights(scanned) == merged
    assert stacked_weights(lean) == set()
    v0, g0 = jax.value_and_grad(scanned)(adapters, stack, x)
    v1, g1 = jax.jit(jax.value_and_grad(lean))(adapters, stack, x)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    _close(g1, g0)


def _block(x, ll, fl):
    w1 = fl["w1"] + ll["w1"][0] @ ll["w1"][1] / RANK
    w2 = fl["w2"] + ll["w2"][0] @ ll["w2"][1] / RANK
    return x + jax.nn.gelu(x @ w1) @ w2


def test_option_checked_and_kept_apart():
    lora, frozen, x = _setup(5)
    with pytest.raises(TypeError, match="computed_weights"):
        jaxmem.transform(loss, computed_weights=1)
    on, off = jaxmem.transform(loss), jaxmem.transform(loss, computed_weights=False)
    for f, n in ((on, 2 * L), (off, 0), (on, 2 * L)):
        assert len(_recomputed_rows(f, lora, frozen, x)) == n
