"""A converted normalisation computes JAX's own forward, bit for bit, under differentiation
(XLA:CPU), so gradients through ReLUs after it are JAX's too.

A ReLU's derivative jumps at 0: a forward that differs from JAX's by rounding alone flips the
mask wherever a ReLU input is that close to 0, and the gradient with it (a converted
ResNet-50's gradients were 3e-2 off JAX's on XLA:CPU, its forward 1e-5). The cause was
``1/sqrt(var + eps)`` (torch's spelling, ``TorchBatchNorm``): JAX's autodiff keeps the
``sqrt`` for its backward, so XLA computes ``divide(1, sqrt)``; in the converted forward
the ``sqrt`` had one use and XLA rewrote ``1/sqrt`` to ``rsqrt``, which differs in the last
bit for about a third of all inputs. Fresh random inputs per run (``_util``)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import residual_bytes
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


def _params():
    return {"w": normal((C, C), scale=C ** -0.5), "scale": normal((C,), scale=0.3) + 1.0,
            "bias": normal((C,), scale=0.3), "v": normal((C,))}


def _net(bn):
    """``relu(bn(x @ w) + skip)`` weighted; the normalised output is returned too."""
    def f(p, x, skip):
        y = bn(x @ p["w"], p["scale"], p["bias"])
        return jnp.sum(jax.nn.relu(y + skip) * p["v"]), y
    return f


def _value_grad(fn, p, x, skip):
    """One compiled program: ``((loss, y), (dp, dx))`` with ``x`` differentiated."""
    return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(p, x, skip)


@pytest.mark.parametrize("bn", [_torch_bn, _flax_bn], ids=["torch-1/sqrt", "flax-rsqrt"])
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


def test_relu_at_its_kink_gets_jaxs_gradient():
    """Half of the ReLU inputs exactly 0 in JAX's forward (``skip = -y``): the converted
    gradient is JAX's only if its forward is JAX's bit for bit (before the fix: O(1) off)."""
    p = _params()
    x = normal((8, 4, 4, C), scale=2.0) + normal((C,))
    f = _net(_torch_bn)
    g = transform(f)
    zero = jnp.zeros(x.shape[:-1] + (C,))
    y = _value_grad(f, p, x, zero)[0][1]          # JAX's forward, same program
    half = jnp.asarray(np.arange(y.size).reshape(y.shape) % 2 == 0)
    skip = jnp.where(half, -y, normal(y.shape))
    (_, yf), gf = _value_grad(f, p, x, skip)
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
