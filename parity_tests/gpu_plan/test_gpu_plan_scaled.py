"""Layer-scaled products keep their output, not split-K partial sums, on the H100 plan.

A layer scale ``x + gamma * (h W + b)`` (BEiT, DINOv2, CaiT) makes autodiff keep the
product's output for ``gamma``'s gradient. XLA:GPU computes the product of a short output
row and a long contraction as a split-K GEMM and fuses the reduction of its partial sums
into every reader -- the backward's ``sum(g * out)`` too -- so the ``S``-times larger
partial sums stay alive instead of the output (measured here: per added layer of the stack
below, 8.0 MiB on the H100 plan with ``scaled_products=False`` against 4.5 with it, the
XLA:CPU figure; the down projection's partial sums are several times its 0.5 MiB output).
``jaxmem.transform`` materialises the output once (:mod:`jaxmem.transform.scaled`): per added layer at least
three output-sized arrays less, the same values and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _gp_util import plan

from jaxmem.measure import slope
from jaxmem.transform import transform

B, T, D, F, LAYERS = 4, 256, 128, 1024, 2


def _ln(x, s, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-6) * s + b


def loss(params, x):
    for p in params:
        h = jax.nn.gelu(_ln(x, p["s"], p["c"]) @ p["w1"] + p["b1"])
        x = x + p["gamma"] * (h @ p["w2"] + p["b2"])
    return jnp.sum(x ** 2)


def _params(layers):
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
    return [{"s": 1 + f(D) / 8, "c": f(D) / 8, "w1": f(D, F), "b1": f(F) / 8, "w2": f(F, D),
             "b2": f(D) / 8, "gamma": 0.1 + f(D) / 8} for _ in range(layers)]


def test_layer_scaled_products_keep_their_output_on_the_h100_plan():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)

    def per_layer(**kw):
        g = jax.grad(transform(loss, **kw))
        return slope(lambda n: plan(g, _params(n), x).temp_bytes, LAYERS)

    out = B * T * D * 4
    on, off = per_layer(), per_layer(scaled_products=False)
    assert off - on >= 3 * out, (off / 2**20, on / 2**20)
