"""The backward ties of jaxmem's exact layers add no communication under sharding.

On a 4x2 ``('data', 'model')`` mesh of 8 CPU devices, for data parallel (batch over
``'data'``, parameters replicated), FSDP (parameters split over ``'data'`` too, XLA gathers
them per layer) and tensor parallel (conv output channels, Megatron dense pairs and attention
heads over ``'model'``): gradients equal the single-device step, and the compiled program has,
kind by kind, no more collectives than plain JAX's for the same sharding.  Under FSDP a
selective LayerNorm gathers its scale and bias once and shares them between its forward pass,
its backward pass and the following Dense layer's recomputation of the norm's output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem.selective as S
from jaxmem.distributed import collectives, compiled_collectives

MODES = ("dp", "fsdp", "tp")


@functools.cache
def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _put(a, spec):
    return jax.device_put(a, NamedSharding(_mesh(), P(*spec)))


def _lax_conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _plain_bn(x):
    mu = jnp.mean(x, (0, 1, 2), keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(x * x, (0, 1, 2), keepdims=True) - mu * mu)
    return (x - mu) * lax.rsqrt(var + 1e-5)


def _plain_ln(x, s, b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
    return (x - mu) * (lax.rsqrt(var + 1e-6) * s) + b


# ------------------------------------------------------------------------------ models
def _conv_frozen(conv):
    """Frozen-weight conv stack, only the input differentiated."""
    def loss(x, ws):
        for w in ws:
            x = jnp.tanh(conv(x, w))
        return jnp.sum(x * x)
    return jax.grad(loss)


def _conv_bn(conv, bn):
    def loss(x, ws):
        for w in ws:
            x = jnp.tanh(bn(conv(x, w)))
        return jnp.sum(x * x)
    return jax.grad(loss, (0, 1))


def _ln_mlp(dense, ln):
    def loss(x, w1, w2, s, b):
        for a, c, ss, bb in zip(w1, w2, s, b):
            x = x + dense(jnp.tanh(dense(ln(x, ss, bb), a)), c)
        return jnp.sum(x * x)
    return jax.grad(loss, (0, 1, 2, 3, 4))


def _attn(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), (0, 1, 2))


def _plain_attn(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _case(name, mode):
    """(jaxmem grad fn, plain grad fn, unsharded args, sharded args)."""
    if name in ("conv_frozen", "conv_bn"):
        args = (_rand(0, (8, 6, 6, 8)), [_rand(1 + i, (3, 3, 8, 8), 0.3) for i in range(3)])
        wspec = {"dp": (), "fsdp": (None, None, None, "data"),
                 "tp": (None, None, None, "model")}[mode]
        sharded = (_put(args[0], ("data",)), [_put(w, wspec) for w in args[1]])
        if name == "conv_frozen":
            return _conv_frozen(S.conv), _conv_frozen(_lax_conv), args, sharded
        sbn = lambda x: S.batch_norm(x, train=True)[0]
        return _conv_bn(S.conv, sbn), _conv_bn(_lax_conv, _plain_bn), args, sharded
    if name == "ln_mlp":
        d = 16
        args = (_rand(10, (8, 4, d)), [_rand(11 + i, (d, 2 * d), 0.2) for i in range(2)],
                [_rand(13 + i, (2 * d, d), 0.2) for i in range(2)],
                [1.0 + _rand(15 + i, (d,), 0.1) for i in range(2)],
                [_rand(17 + i, (d,), 0.1) for i in range(2)])
        s1 = {"dp": (), "fsdp": ("data",), "tp": (None, "model")}[mode]
        s2 = {"dp": (), "fsdp": ("data",), "tp": ("model", None)}[mode]
        sv = {"dp": (), "fsdp": ("data",), "tp": ()}[mode]
        sharded = (_put(args[0], ("data",)), [_put(a, s1) for a in args[1]],
                   [_put(a, s2) for a in args[2]], [_put(a, sv) for a in args[3]],
                   [_put(a, sv) for a in args[4]])
        ours = _ln_mlp(S.dense, lambda x, s, b: S.layer_norm(x, s, b))
        return ours, _ln_mlp(lambda x, w: x @ w, _plain_ln), args, sharded
    if name == "attention":
        args = tuple(_rand(20 + i, (8, 8, 4, 8)) for i in range(3))
        spec = ("data", None, "model") if mode == "tp" else ("data",)
        ours = _attn(lambda q, k, v: S.attention(q, k, v, causal=True))
        return ours, _attn(_plain_attn), args, tuple(_put(a, spec) for a in args)
    raise AssertionError(name)


def _assert_close(got, want, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


@functools.cache
def _reference(name):
    _, plain, args, _ = _case(name, "dp")
    return jax.jit(plain)(*args)  # one device: the arrays are not sharded


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["conv_frozen", "conv_bn", "ln_mlp", "attention"])
def test_no_more_collectives_than_plain_jax(name, mode):
    ours, plain, _, sharded = _case(name, mode)
    compiled = jax.jit(ours).lower(*sharded).compile()  # the program run is the one counted
    _assert_close(compiled(*sharded), _reference(name))
    c_ours = collectives(compiled.as_text())
    c_plain = compiled_collectives(plain, *sharded)
    assert c_ours <= c_plain, (c_ours.counts, c_plain.counts)


def _shard_mapped(dense, inside: bool):
    mesh = _mesh()
    if inside:  # gradient taken per device, summed explicitly
        def step(x, w):
            gx, gw = jax.grad(lambda x, w: jnp.sum(dense(x, w) ** 2), (0, 1))(x, w)
            return gx, lax.psum(gw, "data")
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()),
                                     out_specs=(P("data"), P())))
    f = jax.shard_map(lambda x, w: lax.psum(jnp.sum(dense(x, w) ** 2), "data"), mesh=mesh,
                      in_specs=(P("data"), P()), out_specs=P())
    return jax.jit(jax.grad(f, (0, 1)))


@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("layer", ["dense", "conv"])
def test_selective_layers_with_replicated_weights_under_shard_map(layer, inside):
    """A replicated weight meets a per-device batch: the custom rule gets the weight as
    varying (its cotangent is summed over 'data' as plain autodiff does)."""
    if layer == "dense":
        x, w = _rand(30, (8, 16)), _rand(31, (16, 4))
        ours, plain = S.dense, lambda x, w: x @ w
    else:
        x, w = _rand(32, (8, 4, 4, 3)), _rand(33, (3, 3, 3, 4))
        ours, plain = S.conv, _lax_conv
    c_ours, c_plain = (_shard_mapped(f, inside).lower(x, w).compile() for f in (ours, plain))
    _assert_close(c_ours(x, w), c_plain(x, w))
    assert collectives(c_ours.as_text()) <= collectives(c_plain.as_text())
