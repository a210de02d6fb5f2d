"""jaxmem.linen.convert: a real Linen Module, the same parameter tree, the same outputs and
gradients; the Linen fixes (caller kwargs, field activations, Dropout eval, Embed / Einsum /
DenseGeneral)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.measure import residual_bytes

RTOL, ATOL = 1e-5, 1e-6


def _x(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _init(model, seed, *args, **kw):
    """``model.init`` as one compiled program (run op by op it compiles every op)."""
    return jax.jit(functools.partial(model.init, **kw))(jax.random.PRNGKey(seed), *args)


def _close(a, b, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v),
                                                         rtol=rtol, atol=atol), a, b)


class Block(nn.Module):
    act: Callable = nn.relu
    features: int = 8

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(self.features)(x)
        h = self.act(h)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = nn.Dropout(0.25)(h, deterministic=not train)
        return nn.Dense(self.features)(h)


class Enc(nn.Module):
    def setup(self):
        self.d = nn.Dense(4)

    def __call__(self, x):
        return self.d(x)

    def encode(self, x):
        return nn.relu(self.d(x)) * 2.0


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = Block(act=nn.relu)(x, train)
        x = Block(act=functools.partial(nn.leaky_relu, negative_slope=0.2))(x, train=train)
        return nn.Dense(1)(nn.gelu(x))


X = _x(0, (6, 5))


def _grads(model, variables, x, train=False):
    def loss(p):
        out = model.apply({**variables, "params": p}, x, train,
                          rngs={"dropout": jax.random.PRNGKey(3)},
                          mutable=["batch_stats"] if train else False)
        y = out[0] if train else out
        return jnp.sum(jnp.sin(y))
    return jax.jit(jax.value_and_grad(loss))(variables["params"])


def test_convert_is_real_module_with_same_tree():
    net = Net()
    conv = jaxmem.linen.convert(net)
    assert isinstance(conv, Net) and isinstance(conv, nn.Module)
    assert type(conv).__name__ == "Net" and conv is not net and type(net) is Net
    v0 = _init(net, 0, X)
    v1 = _init(conv, 0, X)
    _close(v0, v1, 0, 0)
    _close(_grads(net, v0, X), _grads(conv, v0, X))
    _close(_grads(net, v0, X, True), _grads(conv, v0, X, True))
    # clone keeps the conversion; bind works; tabulate works
    assert jaxmem.linen.is_converted(conv.clone())
    bound = conv.bind(v0)
    np.testing.assert_allclose(np.asarray(bound(X)), np.asarray(net.apply(v0, X)), RTOL, ATOL)
    assert "Dense_0" in conv.tabulate(jax.random.PRNGKey(0), X)
    with pytest.raises(TypeError, match="flax.linen.Module"):
        jaxmem.linen.convert(object())
    with pytest.raises(ValueError, match="fewbit"):
        jaxmem.linen.convert(net, fewbit=7)


def test_converted_other_method_and_as_submodule():
    enc = jaxmem.linen.convert(Enc())
    v = _init(Enc(), 0, X)
    np.testing.assert_allclose(np.asarray(jax.jit(enc.apply, static_argnames="method")(
        v, X, method="encode")), np.asarray(Enc().apply(v, X, method="encode")), RTOL, ATOL)
    jaxpr = str(jax.make_jaxpr(lambda p: enc.apply(p, X, method="encode"))(v))
    assert "custom_vjp" in jaxpr  # the method ran inside the scope

    class Outer(nn.Module):
        inner: nn.Module

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(self.inner(x))

    o0, o1 = Outer(Block()), Outer(jaxmem.linen.convert(Block()))
    v0 = _init(o0, 1, X)
    _close(v0, _init(o1, 1, X), 0, 0)
    loss = lambda o, p: jnp.sum(o.apply(p, X) ** 2)
    _close(*jax.jit(lambda p: [jax.grad(loss, 1)(o, p) for o in (o0, o1)])(v0))
    # the converted inner module really converts: its residuals are smaller
    r0 = residual_bytes(functools.partial(loss, o0), v0)
    r1 = residual_bytes(functools.partial(loss, o1), v0)
    assert r1.activation_bytes < r0.activation_bytes


@pytest.mark.parametrize("lift", ["jit", "remat", "scan"])
def test_lifted_transforms(lift):
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, c, _=None):
            c = nn.relu(nn.Dense(5)(c))
            return (c, None) if lift == "scan" else c

    if lift == "scan":
        class M(nn.Module):
            @nn.compact
            def __call__(self, x):
                s = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=3)
                return s()(x, None)[0]
        model = M()
    else:
        t = nn.jit(Layer) if lift == "jit" else nn.remat(Layer)
        model = t()
    conv = jaxmem.linen.convert(model)
    v = _init(model, 0, X)
    _close(v, _init(conv, 0, X), 0, 0)
    f = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, X)))))(v)
    _close(f(model), f(conv))
    # the converted model traces the selective ReLU (a custom_vjp)
    assert "custom_vjp" in str(jax.make_jaxpr(lambda p: conv.apply(p, X))(v))


def test_field_activations_and_partials_converted():
    """1 of 17 ReLUs of a ResNet were converted: the ones held in fields were not."""
    net = Net()
    v = _init(net, 0, X)
    rep = jaxmem.report(lambda p: jax.grad(
        lambda p: jnp.sum(jaxmem.linen.convert(net).apply(p, X)))(p), v)
    # the ReLU and the leaky-ReLU partial held in fields: exact 1-bit masks in their blocks
    masks = [e for e in rep.by_kind("activation") if "1-bit mask" in e.reason]
    assert [e.status for e in masks] == ["converted", "converted"], str(rep)
    assert {e.path.split("/")[0] for e in masks} == {"Block_0", "Block_1"}  # + jit names
    # the partial keeps its keyword (negative_slope=0.2): gradients equal the original
    _close(_grads(net, v, X), _grads(jaxmem.linen.convert(net), v, X))


def test_caller_kwargs_not_mutated_dropout_eval_and_rate_zero():
    """Regression: the Dropout/BatchNorm handlers popped keywords out of the caller's dict,
    so the fallback ran without them ("Parameter 'deterministic' must be passed")."""
    x = _x(1, (4, 3))
    kw = {"deterministic": True}
    with jaxmem.scope():
        y = nn.Dropout(0.3).apply({}, x, **kw)
        y0 = nn.Dropout(0.0).apply({}, x, deterministic=False)
    assert kw == {"deterministic": True}
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(x))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, **kw):
            return nn.BatchNorm(axis_name=None)(nn.Dropout(0.0)(x, **kw), **kw2)

    kw2 = {"use_running_average": True}
    m = M()
    v = _init(m, 0, x, deterministic=True)
    out = jaxmem.linen.convert(m).apply(v, x, deterministic=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(m.apply(v, x, deterministic=True)),
                               RTOL, ATOL)
    assert kw2 == {"use_running_average": True}


@pytest.mark.parametrize("layer,inp", [
    (lambda: nn.DenseGeneral((2, 3), axis=(-2, -1)), lambda: _x(2, (4, 3, 5))),
    (lambda: nn.DenseGeneral(4, axis=1, batch_dims=0), lambda: _x(3, (2, 3, 5))),
    (lambda: nn.Einsum((5, 3, 4), "abd,dch->abch"), lambda: _x(4, (2, 3, 5))),
])
def test_dense_general_and_einsum_equal_and_smaller(layer, inp):
    x = inp()
    m = layer()
    v = _init(m, 0, x)
    conv = jaxmem.linen.convert(m)
    f = lambda mod, p, x: jnp.sum(jnp.sin(mod.apply(p, x)))
    _close(*jax.jit(lambda v, x: [jax.grad(f, (1, 2))(mod, v, x) for mod in (m, conv)])(v, x))
    # weights frozen, input differentiated: no input-sized residual of the kernel product
    r0 = residual_bytes(lambda x: f(m, v, x), x)
    r1 = residual_bytes(lambda x: f(conv, v, x), x)
    assert r1.activation_bytes <= r0.activation_bytes
    rep = jaxmem.report(lambda x: f(conv, v, x), x)
    assert [e.status for e in rep.by_kind("dot")] == ["converted"], str(rep)


def test_embed_call_nothing_to_save_and_attend_converted():
    class LM(nn.Module):
        @nn.compact
        def __call__(self, tok):
            e = nn.Embed(11, 6)
            return e.attend(jnp.tanh(e(tok)))

    tok = jnp.asarray(np.random.default_rng(5).integers(0, 11, (3, 4)))
    m = LM()
    v = _init(m, 0, tok)
    conv = jaxmem.linen.convert(m)
    f = lambda mod, p: jnp.sum(jnp.sin(mod.apply(p, tok)))
    (g0, y0), (g1, y1) = jax.jit(lambda v: [(jax.grad(f, 1)(mod, v), mod.apply(v, tok))
                                            for mod in (m, conv)])(v)
    _close(g0, g1)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), RTOL, ATOL)
    rep = jaxmem.report(lambda p: f(conv, p), v)
    # the lookup is a gather of integer indices (nothing to convert); attend is a product
    assert [(e.path, e.status) for e in rep.by_kind("dot")] == [("Embed_0.attend", "converted")], \
        str(rep)


def test_functions_inside_sequential_are_converted():
    """``nn.Sequential([nn.Dense(8), nn.relu, ...])`` holds the activation in a list field:
    it is converted (1-bit mask instead of the ReLU's input), exactly."""
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(8), jax.nn.gelu, nn.Dense(1)])
    x = _x(6, (4, 5))
    params = _init(model, 1, x)
    conv = jaxmem.linen.convert(model)
    f = lambda m: lambda p: jnp.sum(m.apply(p, x) ** 2)
    (ya, ga), (yb, gb) = jax.jit(lambda p: [(m.apply(p, x), jax.grad(f(m))(p))
                                            for m in (conv, model)])(params)
    np.testing.assert_allclose(ya, yb, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "1-bit mask" in str(jaxmem.report(f(conv), params))
    r_conv, r_model = residual_bytes(f(conv), params), residual_bytes(f(model), params)
    assert r_conv.activation_bytes < r_model.activation_bytes
    assert model.layers[1] is nn.relu  # the caller's module is untouched
