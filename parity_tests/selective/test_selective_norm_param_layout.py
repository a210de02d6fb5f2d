"""A selective norm's scale and bias pass through one layout op shared by all their uses.

The op is the identity (bit for bit, derivative passed through); these tests pin that the
norm + dense pair stays exact under the transformations it meets: ``vmap`` (batched
parameters), grad of grad, bf16, ``shard_map`` with replicated parameters, and that the
residuals are those of the norm alone (input + statistics, no extra copy).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close, scaled_atol
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxmem.selective as S
from jaxmem.measure import residual_bytes


def _rand(seed, shape, scale=1.0, shift=0.0):
    return jnp.asarray(shift + np.random.default_rng(seed).normal(size=shape) * scale,
                       jnp.float32)


def _args():
    return (_rand(0, (4, 3, 16)), _rand(1, (16,), 0.1, 1.0), _rand(2, (16,), 0.1),
            _rand(3, (16, 8), 0.3))


def _plain_ln(x, s, b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
    return (x - mu) * (lax.rsqrt(var + 1e-6) * s) + b


def _loss(ln, dense, x, s, b, w):
    return jnp.sum(jnp.tanh(dense(ln(x, s, b), w)) ** 2)


ours = functools.partial(_loss, S.layer_norm, S.dense)
plain = functools.partial(_loss, _plain_ln, lambda x, w: x @ w)
ALL = (0, 1, 2, 3)


def _close(got, want, rtol=2e-5):
    assert_tree_close(got, want, rtol=rtol, atol=scaled_atol(rtol, floor=1.0))


def test_grads_under_vmap_of_batched_parameters():
    x, s, b, w = _args()
    ss, bs = jnp.stack([s, 2 * s]), jnp.stack([b, -b])
    f = lambda g: jax.jit(jax.vmap(jax.grad(g, ALL), in_axes=(None, 0, 0, None)))
    _close(f(ours)(x, ss, bs, w), f(plain)(x, ss, bs, w))


def test_grad_of_grad_through_scale():
    x, s, b, w = _args()
    gg = lambda g: jax.jit(jax.grad(lambda s: jnp.sum(jax.grad(g)(x, s, b, w) ** 2)))(s)
    _close(gg(ours), gg(plain), rtol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_dtypes(dtype):
    args = tuple(a.astype(dtype) for a in _args())
    got = jax.jit(jax.grad(ours, ALL))(*args)
    want = jax.jit(jax.grad(plain, ALL))(*args)
    for a, c in zip(got, want):
        assert a.dtype == dtype
        _close(a.astype(jnp.float32), c.astype(jnp.float32), rtol=5e-2)


def test_replicated_parameters_under_shard_map():
    """Replicated scale/bias with a per-device batch: their gradients are summed over the
    devices, as through plain JAX operations."""
    x, s, b, w = _args()
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def sharded(g):
        f = jax.shard_map(lambda *a: lax.psum(g(*a), "d"), mesh=mesh,
                          in_specs=(P("d"), P(), P(), P()), out_specs=P())
        return jax.jit(jax.grad(f, ALL))

    _close(sharded(ours)(x, s, b, w), jax.jit(jax.grad(plain, ALL))(x, s, b, w))


def test_residuals_are_the_norms_own():
    """Norm + dense with everything differentiated keep x, the per-row statistics (mean,
    variance, 1/std) and scale/bias (parameter-sized, in the norm's broadcast shape): no copy
    of the norm output, nothing input-sized for the parameters."""
    x, s, b, w = _args()
    lin = lambda x, s, b, w: jnp.sum(S.dense(S.layer_norm(x, s, b), w))
    rep = residual_bytes(lin, x, s, b, w, argnums=ALL)
    rows = x.size // x.shape[-1]
    assert rep.activation_bytes == 4 * (x.size + 3 * rows + s.size + b.size), rep.entries
