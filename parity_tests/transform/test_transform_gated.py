"""Gated linear units under ``jaxmem.transform`` (``gated_products=True``, the default).

``down(act(x W) * (x V))`` -- SwiGLU (Llama, Mistral), GeGLU (Gemma, T5 v1.1) -- however it is
written: its ``mul`` becomes :func:`jaxmem.selective.gated_product`, which keeps the
activation's input (kept by the exact activation anyway) and ``x V`` instead of ``act(x W)``,
and the down projection recomputes the product: two hidden-width arrays per unit less than
``gated_products=False`` keeps, the same values and gradients. Under ``fewbit`` the gating
activation stays exact (a code would not spare the factor the product needs)."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

B, T, D, F, LAYERS = 2, 16, 16, 64, 2


class GatedMLP(nn.Module):
    """A Llama block's MLP as Flax users write it (RMSNorm, bias-free projections)."""
    act: str = "silu"

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            h = nn.RMSNorm(name=f"norm{i}")(x)
            g = nn.Dense(F, use_bias=False, name=f"gate{i}")(h)
            u = nn.Dense(F, use_bias=False, name=f"up{i}")(h)
            a = nn.silu(g) if self.act == "silu" else nn.gelu(g, approximate=True)
            x = x + nn.Dense(D, use_bias=False, name=f"down{i}")(a * u)
        return x


def einsum_geglu(p, x):
    """Hand-written GeGLU with biases, the product in the other operand order."""
    for w, v, u in p:
        h = (x @ v["k"] + v["b"]) * jax.nn.gelu(jnp.einsum("btd,df->btf", x, w["k"]) + w["b"])
        x = x + h @ u
    return x


def _flax(act):
    m = GatedMLP(act)
    x = normal((B, T, D))
    return (lambda p, x: jnp.sum(m.apply(p, x) ** 2)), m.init(jax.random.key(0), x), x


def _einsum():
    p = [({"k": normal((D, F), scale=D ** -0.5), "b": normal((F,), scale=0.1)},
          {"k": normal((D, F), scale=D ** -0.5), "b": normal((F,), scale=0.1)},
          normal((F, D), scale=F ** -0.5)) for _ in range(LAYERS)]
    return (lambda p, x: jnp.sum(einsum_geglu(p, x) ** 2)), p, normal((B, T, D))


CASES = {"flax_swiglu": lambda: _flax("silu"), "flax_geglu_tanh": lambda: _flax("gelu"),
         "einsum_geglu": _einsum}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gated_units_exact_and_two_arrays_fewer(name):
    loss, p, x = CASES[name]()
    g, off = transform(loss), transform(loss, gated_products=False)
    rows = g.report(p, x).by_kind("gate")
    assert len(rows) == LAYERS and all(r.converted for r in rows), rows
    assert not off.report(p, x).by_kind("gate")
    (vg, gg), (vf, gf) = jax.jit(lambda p, x: tuple(
        jax.value_and_grad(fn)(p, x) for fn in (g, loss)))(p, x)
    close(vg, vf, rtol=1e-5)
    close(gg, gf, rtol=1e-5, atol=1e-6)
    on_b = residual_bytes(g, p, x).activation_bytes
    off_b = residual_bytes(off, p, x).activation_bytes
    hidden = B * T * F * 4
    assert off_b - on_b >= 2 * LAYERS * hidden, (off_b, on_b)


def test_fewbit_leaves_the_gating_activation_exact():
    loss, p, x = _flax("gelu")
    g = transform(loss, fewbit=3)
    acts = [r for r in g.report(p, x).by_kind("activation") if r.converted]
    assert len(acts) == LAYERS and all("gated product" in r.reason for r in acts), acts
    assert "bit code" not in " ".join(r.became for r in acts)
    coded = transform(loss, fewbit=3, gated_products=False)
    assert (residual_bytes(g, p, x).activation_bytes
            < residual_bytes(coded, p, x).activation_bytes)
    close(jax.grad(g)(p, x), jax.grad(loss)(p, x), rtol=1e-5, atol=1e-6)


def test_products_of_unrecorded_values_stay_as_written():
    a, b = normal((B, F)), normal((B, F))

    def f(a, b):        # no activation or norm output among the factors
        return jnp.sum(((2.0 * a + 1.0) * b) ** 2 + (a * b) ** 2)

    g = transform(f)
    assert not g.report(a, b).by_kind("gate")
    close(jax.grad(g, (0, 1))(a, b), jax.grad(f, (0, 1))(a, b), rtol=1e-5)


def test_option_is_checked_and_kept_apart():
    with pytest.raises(TypeError, match="gated_products must be True or False"):
        transform(lambda x: x, gated_products=1)
    loss, p, x = _flax("silu")
    on, off = transform(loss), transform(loss, gated_products=False)
    assert on.options != off.options and hash(on.options) != hash(off.options)
    # traced one after the other, each keeps what its own option says
    sizes = [residual_bytes(fn, p, x).activation_bytes for fn in (on, off, on)]
    assert sizes[0] == sizes[2] < sizes[1]
