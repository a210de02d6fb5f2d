"""Products scaled by a parameter under ``jaxmem.transform`` (``scaled_products=True``).

A layer scale ``x + gamma * (h W + b)`` (BEiT, DINOv2, CaiT, ConvNeXt), however it is written,
gets the product's output materialised once before the ``mul`` (an ``optimization_barrier``
off CPU: :mod:`jaxmem.transform.scaled`), so XLA:GPU keeps that output for ``gamma``'s
gradient instead of a split-K GEMM's partial sums (the bytes are asserted on the H100 plan
in ``parity_tests/gpu_plan/test_gpu_plan_scaled.py``). Here: which products get it (one
``"scale"`` row each), that nothing else does, and that values and gradients are the
untouched function's under ``jit``, ``vmap``, ``scan``, ``checkpoint`` and in bf16."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

B, T, D, F, LAYERS = 2, 16, 16, 64, 2


class LayerScaled(nn.Module):
    """A pre-norm MLP block with BEiT's layer scale (``gamma`` a parameter); ``dinov2``
    multiplies the parameter by a constant first, as Hugging Face's DINOv2 does."""
    dinov2: bool = False

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            h = nn.gelu(nn.Dense(F, name=f"fc{i}")(nn.LayerNorm(name=f"ln{i}")(x)))
            gamma = self.param(f"gamma{i}", nn.initializers.constant(0.1), (D,))
            if self.dinov2:
                gamma = 1.0 * gamma * 1.0
            x = x + gamma * nn.Dense(D, name=f"fc_out{i}")(h)
        return x


def einsum_scaled(p, x):
    """Hand-written: the scale on the right, the output reshaped on the way."""
    for w1, w2, g in p:
        h = jnp.tanh(jnp.einsum("btd,df->btf", x, w1))
        y = jnp.einsum("btf,fd->btd", h, w2).reshape(B, T, 2, D // 2)
        x = x + (y * g.reshape(2, D // 2)).reshape(B, T, D)
    return x


def _flax(dinov2=False):
    m = LayerScaled(dinov2)
    x = normal((B, T, D))
    p = m.init(jax.random.key(0), x)
    p = jax.tree.map(lambda a: a + normal(a.shape, scale=0.05), p)
    return (lambda p, x: jnp.sum(m.apply(p, x) ** 2)), p, x


def _einsum():
    p = [(normal((D, F), scale=D ** -0.5), normal((F, D), scale=F ** -0.5),
          0.1 + normal((D,), scale=0.05)) for _ in range(LAYERS)]
    return (lambda p, x: jnp.sum(einsum_scaled(p, x) ** 2)), p, normal((B, T, D))


CASES = {"flax_beit": _flax, "flax_dinov2": lambda: _flax(True), "einsum": _einsum}


def _barriers(fn, *args) -> int:
    """``optimization_barrier`` equations in the gradient's jaxpr (bodies included)."""
    return str(jax.make_jaxpr(jax.grad(fn))(*args)).count("optimization_barrier")


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_scales_are_materialised_and_exact(name):
    loss, p, x = CASES[name]()
    g = transform(loss)
    rows = g.report(p, x).by_kind("scale")
    assert len(rows) == LAYERS and all(r.converted for r in rows), rows
    assert _barriers(g, p, x) > _barriers(transform(loss, scaled_products=False), p, x)
    (vg, gg), (vf, gf) = jax.jit(lambda p, x: tuple(
        jax.value_and_grad(fn)(p, x) for fn in (g, loss)))(p, x)
    close(vg, vf, rtol=1e-5)
    close(gg, gf, rtol=1e-5, atol=1e-6)


def test_other_products_and_factors_stay_as_written():
    w, x, a = normal((D, D), scale=D ** -0.5), normal((B, T, D)), normal((D,))
    frozen = 0.1 + normal((D,), scale=0.05)
    pos = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.ones((D,))
    spellings = {
        "rotary": lambda w, x, a: (x @ w) * jnp.cos(pos * a),  # a factor computed from others
        "constant": lambda w, x, a: (x @ w) * frozen,          # a closed-over constant
        "not a product": lambda w, x, a: jnp.tanh(x) * a,
        "literal": lambda w, x, a: (x @ w) * jnp.ones_like(x),  # a literal, spread
    }
    for name, fn in spellings.items():
        f = lambda w, x, a, fn=fn: jnp.sum(fn(w, x, a) ** 2)
        g = transform(f)
        assert not g.report(w, x, a).by_kind("scale"), name
        close(jax.grad(g, (0, 1, 2))(w, x, a), jax.grad(f, (0, 1, 2))(w, x, a), rtol=1e-5)


def test_under_vmap_scan_checkpoint_and_bf16():
    loss, p, x = _einsum()

    def scanned(p, x):
        def body(x, layer):
            return x + einsum_scaled([layer], x) - x, None
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *p)
        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, stacked)[0] ** 2)

    xs = jnp.stack([x, normal(x.shape)])
    batched = lambda p, xs: jnp.sum(jax.vmap(loss, (None, 0))(p, xs))
    for fn, args in ((scanned, (p, x)), (batched, (p, xs))):
        g = transform(fn)
        assert g.report(*args).by_kind("scale"), fn
        close(jax.jit(jax.grad(g))(*args), jax.jit(jax.grad(fn))(*args), rtol=1e-5, atol=1e-6)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (p, x))
    got = jax.grad(transform(loss))(*half)
    want = jax.grad(loss)(*half)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(got))
    close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
          jax.tree.map(lambda a: a.astype(jnp.float32), want), rtol=1e-2, atol=1e-2)


def test_option_is_checked_and_kept_apart():
    with pytest.raises(TypeError, match="scaled_products must be True or False"):
        transform(lambda x: x, scaled_products=None)
    loss, p, x = _flax()
    on, off = transform(loss), transform(loss, scaled_products=False)
    assert on.options != off.options and hash(on.options) != hash(off.options)
    # traced one after the other, each emits what its own option says
    counts = [_barriers(fn, p, x) for fn in (on, off, on)]
    assert counts[0] == counts[2] > counts[1], counts
    assert np.isfinite(float(jax.jit(off)(p, x)))
