"""A norm of a 1x1 convolution of another norm's output recomputes that convolution.

A ResNet bottleneck ``relu(bn3(conv3(relu(bn2(c2)))) + x)`` with a 1x1, stride-1 ``conv3``
(``C -> 4C``): ``bn3``'s backward reads ``c3 = conv3(...)`` at every element. The convolution
records its output as recomputable from ``bn2``'s residuals and the kernel
(``jaxmem._prims.recipes.extend``), and ``bn3`` keeps those (already kept by ``bn2``) instead
of ``c3``, recomputing the convolution in its backward pass: a unit keeps ``c1`` and ``c2``
(``C`` channels each) where it kept ``c1``, ``c2`` and ``c3`` (``6C``), the same gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
import jaxmem.selective as S
from jaxmem._prims import recipes
from jaxmem.measure import compiled_memory, residual_bytes, slope
from jaxmem.selective.linear import conv_with_recipe

C = 8
SHAPE = (4, 8, 8, 4 * C)
PIX = SHAPE[0] * SHAPE[1] * SHAPE[2]
DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, recompute):
    pad = "SAME" if w.shape[0] > 1 else "VALID"
    return conv_with_recipe(x, w, recompute, (1, 1), pad, dimension_numbers=DN)


def _bn(x, s, b):
    return S.batch_norm(x, s, b, train=True)[0]


def _unit(x, p, recompute):
    (w1, s1, b1), (w2, s2, b2), (w3, s3, b3) = p
    h = S.relu(_bn(_conv(x, w1, recompute), s1, b1))
    h = S.relu(_bn(_conv(h, w2, recompute), s2, b2))
    return S.relu(_bn(_conv(h, w3, recompute), s3, b3) + x)


def _plain_unit(x, p):
    def bn(v, s, b):
        mu = jnp.mean(v, (0, 1, 2), keepdims=True)
        var = jnp.maximum(jnp.mean(v * v, (0, 1, 2), keepdims=True) - mu * mu, 0)
        return (v - mu) * (jax.lax.rsqrt(var + 1e-5) * s) + b

    def conv(v, w):
        pad = "SAME" if w.shape[0] > 1 else "VALID"
        return jax.lax.conv_general_dilated(v, w, (1, 1), pad, dimension_numbers=DN)

    (w1, s1, b1), (w2, s2, b2), (w3, s3, b3) = p
    h = jax.nn.relu(bn(conv(x, w1), s1, b1))
    h = jax.nn.relu(bn(conv(h, w2), s2, b2))
    return jax.nn.relu(bn(conv(h, w3), s3, b3) + x)


def _params(depth, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)

    def layer(k, cin, cout):
        return (jnp.asarray(rng.normal(size=(k, k, cin, cout)) / np.sqrt(k * k * cin), dtype),
                jnp.asarray(1 + 0.1 * rng.normal(size=(cout,)), dtype),
                jnp.asarray(0.1 * rng.normal(size=(cout,)), dtype))

    return [(layer(1, 4 * C, C), layer(3, C, C), layer(1, C, 4 * C)) for _ in range(depth)]


def _loss(unit):
    def loss(ps, x):
        for p in ps:
            x = unit(x, p)
        return jnp.sum(jnp.sin(x) * jnp.linspace(-1, 1, x.size, dtype=x.dtype).reshape(x.shape))
    return loss


def _norms_of(ps):
    """The norms' ``(scale, bias)`` of every unit's three layers."""
    return [[(s, b) for _, s, b in p] for p in ps]


def _of_norms(loss, ps, x):
    """``loss`` as a function of the norms' parameters alone (kernels and input fixed)."""
    def f(norms):
        return loss([[(w, s, b) for (w, _, _), (s, b) in zip(p, n)]
                     for p, n in zip(ps, norms)], x)
    return f


def _case_grad(loss, case):
    """The gradient of ``loss(ps, x)`` the case asks for: the input only, the norms' scales
    and biases only, or everything."""
    if case == "input":
        return lambda ps, x: jax.grad(loss, argnums=1)(ps, x)
    if case == "norm":
        return lambda ps, x: jax.grad(_of_norms(loss, ps, x))(_norms_of(ps))
    return lambda ps, x: jax.grad(loss, argnums=(0, 1))(ps, x)


def _x(dtype=jnp.float32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=SHAPE), dtype)


@pytest.mark.parametrize("case", ["input", "norm", "all"])
def test_gradients_match_plain_jax_in_float64(case):
    with jax.enable_x64(True):
        ps, x = _params(2, jnp.float64), _x(jnp.float64)
        want = jax.jit(_case_grad(_loss(_plain_unit), case))(ps, x)
        got = jax.jit(_case_grad(_loss(lambda x, p: _unit(x, p, True)), case))(ps, x)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-10, atol=1e-12)


def test_recomputed_gradients_equal_the_stored_ones_under_vmap_and_checkpoint():
    """float32: the recomputed ``c3`` is the forward's own convolution of the same arrays;
    under ``vmap`` (a per-example batch of units) and ``jax.checkpoint`` too. One unit: the
    recipe (``c3`` from ``bn2``'s residuals) lives within a unit."""
    ps, x = _params(1), _x()
    xs = jnp.stack([x, _x(seed=2)])
    outs = {}
    for rec in (True, False):
        loss = _loss(lambda x, p, rec=rec: _unit(x, p, rec))
        per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0))
        outs[rec] = (jax.jit(per_example)(ps, xs),
                     jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(ps, x))
    for a, b in zip(jax.tree.leaves(outs[False]), jax.tree.leaves(outs[True])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                                   atol=1e-6 * float(np.max(np.abs(np.asarray(a)))))


def test_only_a_pointwise_convolution_of_a_norm_output_is_recorded():
    x = _x()
    p = _params(1)[0]
    y = S.relu(_bn(x, jnp.ones(4 * C), jnp.zeros(4 * C)))
    assert recipes.depth(_conv(y, p[0][0], True)) == 1            # 1x1, stride 1
    assert recipes.recipe(_conv(y, p[0][0], False)) is None        # conv_recompute=False
    assert recipes.recipe(_conv(y[..., :C], p[1][0], True)) is None    # 3x3
    strided = conv_with_recipe(y, p[0][0], True, (2, 2), "VALID", dimension_numbers=DN)
    assert recipes.recipe(strided) is None
    assert recipes.recipe(_conv(x, p[0][0], True)) is None         # input not a norm's output
    # the norm of a recorded convolution is recomputable through it (depth 1), but is not
    # extended by a second convolution: at most one convolution per recomputation
    y3 = _bn(_conv(y, p[0][0], True), jnp.ones(C), jnp.zeros(C))
    assert recipes.depth(y3) == 1
    assert recipes.recipe(_conv(y3, p[2][0], True)) is None


def _activation_bytes(case, rec, depth):
    ps, x = _params(depth), _x()
    loss = _loss(lambda x, p: _unit(x, p, rec))
    if case == "input":
        return residual_bytes(lambda x: loss(ps, x), x).activation_bytes
    return residual_bytes(_of_norms(loss, ps, x), _norms_of(ps)).activation_bytes


@pytest.mark.parametrize("case", ["input", "norm"])
def test_unit_keeps_two_narrow_arrays_instead_of_three(case):
    """Residuals JAX stores per added unit (``residual_bytes``, depth 2 minus depth 1):
    ``c1`` and ``c2`` (``C`` channels, f32) plus 1-bit masks and per-channel vectors; ``c3``
    (``4C``) too without the recipe."""
    per_unit = {rec: _activation_bytes(case, rec, 2) - _activation_bytes(case, rec, 1)
                for rec in (True, False)}
    # c3 less, a few per-channel vectors (bn2's variance and bias) more
    assert 4 * 4 * C * PIX - 4 * 4 * C <= per_unit[False] - per_unit[True] <= 4 * 4 * C * PIX
    assert per_unit[True] <= 4 * 2 * C * PIX + 6 * C * PIX / 8 + 64 * 4 * C, per_unit


@pytest.mark.xla_cpu
def test_compiled_bytes_per_unit_drop_by_the_expansion_on_cpu():
    """XLA:CPU's compiled plan (temp + output) per added unit, Input case: the recipe saves at
    least three quarters of ``c3``'s 4C channels x 4 B per pixel."""
    x = _x()
    per_unit = {}
    for rec in (True, False):
        loss = _loss(lambda x, p, rec=rec: _unit(x, p, rec))

        def measure(d, loss=loss):
            c = compiled_memory(jax.grad(loss, argnums=1), _params(d), x)
            return c.temp_bytes + c.output_bytes
        per_unit[rec] = slope(measure, 2) / PIX
    assert per_unit[False] - per_unit[True] >= 0.75 * 4 * 4 * C, per_unit


def test_transform_option_switches_it_off():
    """``jaxmem.transform(..., conv_recompute=False)`` keeps ``c3`` (the residuals of the
    untouched unit's transform differ by exactly that array); both give JAX's gradients."""
    ps, x = _params(1), _x()
    loss = _loss(_plain_unit)
    res = {}
    want = jax.jit(jax.grad(loss, argnums=1))(ps, x)
    for rec in (True, False):
        g = jaxmem.transform(loss, conv_recompute=rec)
        res[rec] = residual_bytes(lambda x, g=g: g(ps, x), x).activation_bytes
        got = jax.jit(jax.grad(g, argnums=1))(ps, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                   rtol=1e-5, atol=1e-6 * float(np.max(np.abs(np.asarray(want)))))
    assert 4 * 4 * C * PIX - 4 * 4 * C <= res[False] - res[True] <= 4 * 4 * C * PIX, res
    with pytest.raises(TypeError, match="conv_recompute"):
        jaxmem.transform(loss, conv_recompute=1)


def test_linen_and_nnx_convert_pass_conv_recompute_on():
    """``jaxmem.linen.convert`` / ``jaxmem.nnx.convert(..., conv_recompute=False)`` keep
    ``c3`` again (``4C`` f32 channels per pixel and unit more residual bytes), with the same
    gradients either way; a non-bool is a ``TypeError``."""
    import flax.linen as nn
    from flax import nnx

    x = _x()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            ps = self.param("ps", lambda k: _params(2))
            return _loss(_plain_unit)(ps, x)

    net = Net()
    v = net.init(jax.random.key(0), x)
    want = jax.jit(jax.grad(lambda x: net.apply(v, x)))(x)

    def kept(**options):
        m = jaxmem.linen.convert(net, **options)
        got = jax.jit(jax.grad(lambda x: m.apply(v, x)))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-6 * float(np.max(np.abs(np.asarray(want)))))
        return residual_bytes(lambda x: m.apply(v, x), x).activation_bytes

    assert kept(conv_recompute=False) - kept() >= 2 * (4 * 4 * C * PIX - 4 * 4 * C)

    class NnxNet(nnx.Module):
        def __init__(self):
            self.ps = nnx.Param(_params(2))

        def __call__(self, x):
            return _loss(_plain_unit)(self.ps.value, x)

    def nnx_kept(**options):
        graphdef, state = nnx.split(jaxmem.nnx.convert(NnxNet(), **options))
        return residual_bytes(lambda s: nnx.merge(graphdef, s)(x), state).activation_bytes

    assert nnx_kept(conv_recompute=False) - nnx_kept() >= 2 * (4 * 4 * C * PIX - 4 * 4 * C)
    for convert, model in ((jaxmem.linen.convert, net), (jaxmem.nnx.convert, NnxNet())):
        with pytest.raises(TypeError, match="conv_recompute"):
            convert(model, conv_recompute=1)


@functools.cache
def _float32_grads():
    """The untouched one-unit stack's float32 gradients (kernels, norms, input)."""
    return jax.jit(jax.grad(_loss(_plain_unit), argnums=(0, 1)))(_params(1), _x())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_as_close_to_float32_as_jax(dtype):
    """A bf16 / f16 unit: the recomputed convolution may round differently from the stored
    one (XLA folds the half-precision conversions differently in the two programs), so the
    gradients are compared with the float32 gradient: the recomputation adds no error to the
    selective ops' own (``conv_recompute`` off, within a tenth), which is JAX's own (the
    untouched unit in that dtype) within a half (bf16: 0.37 vs 0.33 here)."""
    want = _float32_grads()

    def err(g):
        # NumPy: JAX op by op would compile each operation once per leaf shape
        return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b)))
                         / np.max(np.abs(np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)))

    ps, x = _params(1, dtype), _x(dtype)
    got = {rec: jax.jit(jax.grad(_loss(lambda x, p, rec=rec: _unit(x, p, rec)),
                                 argnums=(0, 1)))(ps, x) for rec in (True, False)}
    assert all(a.dtype == dtype for a in jax.tree.leaves(got[True]))
    jax_err = err(jax.jit(jax.grad(_loss(_plain_unit), argnums=(0, 1)))(ps, x))
    assert err(got[True]) <= 1.1 * err(got[False]) + 1e-3, (err(got[True]), err(got[False]))
    assert err(got[True]) <= 1.5 * jax_err + 1e-2, (err(got[True]), jax_err)


def test_name_tags_between_layers_keep_the_recipes():
    """``checkpoint_name`` tags on every layer output (what ``jaxmem.planner`` puts at Linen
    boundaries, or a user's remat names) are identities: under ``jaxmem.transform`` the recipes
    hold through them, so the tagged unit keeps what the untagged one keeps."""
    from jax.ad_checkpoint import checkpoint_name

    def tagged_unit(x, p):
        def bn(v, s, b):
            mu = jnp.mean(v, (0, 1, 2), keepdims=True)
            var = jnp.maximum(jnp.mean(v * v, (0, 1, 2), keepdims=True) - mu * mu, 0)
            return checkpoint_name((v - mu) * (jax.lax.rsqrt(var + 1e-5) * s) + b, "bn")

        def conv(v, w):
            pad = "SAME" if w.shape[0] > 1 else "VALID"
            return checkpoint_name(
                jax.lax.conv_general_dilated(v, w, (1, 1), pad, dimension_numbers=DN), "conv")

        (w1, s1, b1), (w2, s2, b2), (w3, s3, b3) = p
        h = checkpoint_name(jax.nn.relu(bn(conv(x, w1), s1, b1)), "act")
        h = checkpoint_name(jax.nn.relu(bn(conv(h, w2), s2, b2)), "act")
        return jax.nn.relu(bn(conv(h, w3), s3, b3) + x)

    ps, x = _params(2), _x()
    kept = {}
    for name, unit in (("plain", _plain_unit), ("tagged", tagged_unit)):
        g = jaxmem.transform(_loss(unit))
        kept[name] = residual_bytes(lambda ps, g=g: g(ps, x), ps).activation_bytes
    assert kept["tagged"] == kept["plain"], kept
