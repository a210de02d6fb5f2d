"""A bottleneck's 1x1 expansion recomputed by the norm it feeds, on the H100 plan.

``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + x)`` with 1x1 ``conv1``
(``4C -> C``), 3x3 ``conv2`` and 1x1 ``conv3`` (``C -> 4C``), only the input differentiated
(ResNet-50's "Input" case): ``bn3`` keeps ``bn2``'s residuals and ``conv3``'s kernel instead of
``c3`` (``jaxmem._prims.recipes.extend``) and recomputes ``conv3`` in its backward pass, tied
to the cotangent so that XLA:GPU does not hoist it into the forward pass (where it would keep
the very array). Per added unit the plan keeps ``c1`` and ``c2`` (``2C`` channels, f32) and the
masks: it kept ``c3`` (``4C`` more) before."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from _gp_util import plan, rand

import jaxmem.selective as S
from jaxmem.measure import slope
from jaxmem.selective.linear import conv_with_recipe

C = 16
SHAPE = (8, 16, 16, 4 * C)
PIX = SHAPE[0] * SHAPE[1] * SHAPE[2]
DN = ("NHWC", "HWIO", "NHWC")


def _unit(x, p, rec):
    def conv(v, w):
        pad = "SAME" if w.shape[0] > 1 else "VALID"
        return conv_with_recipe(v, w, rec, (1, 1), pad, dimension_numbers=DN)

    def bn(v, s, b):
        return S.batch_norm(v, s, b, train=True)[0]

    (w1, s1, b1), (w2, s2, b2), (w3, s3, b3) = p
    h = S.relu(bn(conv(x, w1), s1, b1))
    h = S.relu(bn(conv(h, w2), s2, b2))
    return S.relu(bn(conv(h, w3), s3, b3) + x)


def _params(depth):
    def layer(i, k, cin, cout):
        return (rand(i, (k, k, cin, cout), (k * k * cin) ** -0.5), jnp.ones((cout,)),
                jnp.zeros((cout,)))
    return [(layer(10 * d, 1, 4 * C, C), layer(10 * d + 1, 3, C, C), layer(10 * d + 2, 1, C, 4 * C))
            for d in range(depth)]


def _per_unit(rec):
    x = rand(0, SHAPE)

    def measure(d):
        ps = _params(d)

        def loss(x):
            for p in ps:
                x = _unit(x, p, rec)
            return jnp.sum(x * x)
        c = plan(jax.grad(loss), x)
        return c.temp_bytes + c.output_bytes
    return slope(measure, 2) / PIX


def test_expansion_output_is_recomputed_not_kept():
    kept, recomputed = _per_unit(False), _per_unit(True)
    # c3 is 4C f32 channels per pixel: at least three quarters of it saved per unit
    assert kept - recomputed >= 0.75 * 4 * 4 * C, (kept, recomputed)
    # what is left: c1, c2 (C channels each) and the masks, within one C-channel array
    assert recomputed <= 4 * 3 * C, (kept, recomputed)
