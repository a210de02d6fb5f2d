"""Few-bit activations: exact forward, defined backward dy * level[bin(x)], transformations,
dtypes, non-finite inputs, residual and compiled bytes, errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import fewbit, selective
from jaxmem.fewbit.activations import TABLE_ACTIVATIONS

NAMES = sorted(TABLE_ACTIVATIONS)
EXACT = {  # the plain JAX functions, spelled independently of the registry
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "selu": jax.nn.selu,
    "softplus": jax.nn.softplus, "elu": jax.nn.elu, "celu": jax.nn.celu, "mish": jax.nn.mish,
    "softsign": jax.nn.soft_sign, "log_sigmoid": jax.nn.log_sigmoid,
    "hard_swish": jax.nn.hard_swish,
}


def _data(shape, seed=0, scale=3.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * scale).astype(dtype), rng.normal(size=shape).astype(dtype)


def _reference_grad(name, bits, x, dy):
    """dy * levels[bin(x)] from the shipped JSON, in numpy (the definition)."""
    t = fewbit.load_table(name, bits)
    xf = np.asarray(x, np.float32)
    if t.symmetric:
        xf = np.abs(xf)
    code = (xf[..., None] >= t.borders_f32).sum(-1)
    return np.asarray(dy, np.float32) * t.levels_f32[code]


def _vjp(op, x, dy):
    y, f = jax.vjp(op, x)
    return y, f(dy)[0]


@pytest.mark.parametrize("name", NAMES)
def test_forward_exact_and_gradient_is_defined_table(name):
    x, dy = _data((4, 33), seed=len(name))
    for bits in (1, 2, 3, 4) if name in ("gelu", "sigmoid") else (3,):
        y, g = jax.jit(lambda x, dy: _vjp(fewbit.activation(name, bits), x, dy))(x, dy)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(EXACT[name])(x)))
        np.testing.assert_array_equal(np.asarray(g), _reference_grad(name, bits, x, dy))


def test_gradient_close_to_true_derivative_at_4_bits():
    x, dy = _data((2000,), seed=3, scale=2.0)
    _, g = jax.jit(lambda x: _vjp(lambda x: fewbit.gelu(x, bits=4), x, jnp.ones_like(x)))(x)
    true = jax.jit(jax.vmap(jax.grad(EXACT["gelu"])))(x)
    assert float(jnp.sqrt(jnp.mean((g - true) ** 2))) < 0.03  # ~ sqrt(0.0031 / 20) * 1.5


@pytest.mark.parametrize("name", ["relu", "relu6", "hard_tanh"])
def test_relu_family_exact(name):
    x, dy = _data((5, 16), seed=1, scale=4.0)
    x[0, :6] = [0.0, 6.0, -1.0, 1.0, -0.0, 3.0]  # the kinks
    exact = {"relu": jax.nn.relu, "relu6": jax.nn.relu6, "hard_tanh": jax.nn.hard_tanh}[name]
    y, g = _vjp(getattr(selective, name), jnp.asarray(x), jnp.asarray(dy))
    y0, g0 = _vjp(exact, jnp.asarray(x), jnp.asarray(dy))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))
    _, g = _vjp(lambda x: fewbit.leaky_relu(x, 0.2), jnp.asarray(x), jnp.asarray(dy))
    _, g0 = _vjp(lambda x: jax.nn.leaky_relu(x, 0.2), jnp.asarray(x), jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(dtype):
    x, dy = _data((3, 40), seed=2)
    x, dy = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
    for name in ("gelu", "tanh"):
        y, g = jax.jit(lambda x, dy: _vjp(fewbit.activation(name, 3), x, dy))(x, dy)
        assert y.dtype == dtype and g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(EXACT[name])(x)))
        ref = _reference_grad(name, 3, x.astype(jnp.float32), dy.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jnp.asarray(ref).astype(dtype)))


def test_non_finite_inputs():
    x = jnp.asarray([np.nan, np.inf, -np.inf, 0.0, 1.0], jnp.float32)
    dy = jnp.ones_like(x)
    for name, bits in [("gelu", 3), ("sigmoid", 2), ("selu", 1)]:
        t = fewbit.load_table(name, bits)
        y, g = _vjp(fewbit.activation(name, bits), x, dy)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(EXACT[name](x)))
        g = np.asarray(g)
        assert np.all(np.isfinite(g))
        top = np.float32(t.levels[-1])
        assert g[0] == np.float32(t.levels[0])  # NaN -> bin 0
        assert g[1] == top  # +inf -> top bin
        assert g[2] == (top if t.symmetric else np.float32(t.levels[0]))  # -inf
    # NaN in dy propagates
    _, g = _vjp(fewbit.gelu, jnp.ones(3), jnp.asarray([np.nan, 1.0, 1.0]))
    assert np.isnan(np.asarray(g)[0])


def test_transformations_jit_vmap_scan_checkpoint_grad():
    x, dy = _data((6, 24), seed=4)
    x, dy = jnp.asarray(x), jnp.asarray(dy)
    ref = _reference_grad("silu", 2, x, dy)

    def loss(x):
        return jnp.sum(fewbit.silu(x, bits=2) * dy)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), ref)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x)), ref)
    np.testing.assert_array_equal(np.asarray(jax.grad(jax.checkpoint(loss))(x)), ref)
    gv = jax.vmap(jax.grad(lambda r, d: jnp.sum(fewbit.silu(r, bits=2) * d)))(x, dy)
    np.testing.assert_array_equal(np.asarray(gv), ref)

    def scanned(x):
        def body(c, xd):
            xi, di = xd
            return c + jnp.sum(fewbit.silu(xi, bits=2) * di), None
        return jax.lax.scan(body, 0.0, (x, dy))[0]

    np.testing.assert_array_equal(np.asarray(jax.grad(scanned)(x)), ref)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(scanned))(x)), ref)

    # scan carrying the activation through layers (residuals stacked by scan) == unrolled
    w = jnp.asarray(np.random.default_rng(5).normal(size=(4, 24, 24)) / 5, jnp.float32)

    def act(h):
        return fewbit.gelu(h, bits=4)

    def deep_scan(x):
        return jnp.sum(jax.lax.scan(lambda h, wi: (act(h @ wi), None), x, w)[0])

    def deep_loop(x):
        for i in range(4):
            x = act(x @ w[i])
        return jnp.sum(x)

    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(deep_scan))(x)),
                               np.asarray(jax.jit(jax.grad(deep_loop))(x)), rtol=1e-6, atol=1e-7)


def test_residual_bytes_are_packed_codes():
    from jaxmem.measure import residual_bytes
    x = jnp.asarray(_data((64, 80))[0])
    for bits in (1, 2, 3, 4):
        r = residual_bytes(lambda x: jnp.sum(fewbit.gelu(x, bits=bits)), x)
        assert r.activation_bytes == 64 * 80 * bits // 8, (bits, str(r))
    r0 = residual_bytes(lambda x: jnp.sum(jax.nn.gelu(x, approximate=False)), x)
    assert r0.activation_bytes >= 64 * 80 * 4


def _mlp_loss(act, depth, h):
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h), jnp.float32)
          for i in range(depth)]

    def loss(x):  # frozen weights: gradient w.r.t. the input only
        for w in ws:
            x = act(x @ w)
        return jnp.sum(x)

    return loss


def test_compiled_bytes_slope_gelu_3bit():
    """Per added layer XLA keeps 3/8 B per hidden element (default GELU: >= 8 B)."""
    from jaxmem.measure import compiled_memory, slope
    b, h = 128, 512
    x = jnp.ones((b, h), jnp.float32)

    def per_elem(act):
        return slope(lambda L: compiled_memory(jax.grad(_mlp_loss(act, L, h)), x).total_bytes,
                     2) / (b * h)

    few = per_elem(lambda x: fewbit.gelu(x, bits=3))
    assert few <= 3 / 8 * 1.05, few
    default = per_elem(EXACT["gelu"])
    assert default >= 8.0, default


def test_sharded_inputs():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxmem import fewbit, selective
        mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
        x = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32) * 3
        xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        g = jax.jit(jax.grad(lambda x: jnp.sum(fewbit.gelu(x, bits=3) ** 2)))(xs)
        g0 = jax.grad(lambda x: jnp.sum(fewbit.gelu(x, bits=3) ** 2))(jnp.asarray(x))
        assert len(g.sharding.device_set) == 2, g.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))
        print("OK")
    """)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_factory_from_any_elementwise_function():
    def f(x):
        return x * jnp.tanh(jax.nn.softplus(x))  # mish, spelled by the user

    op = fewbit.make_activation(f, bits=3, grid=512)
    assert fewbit.make_activation(f, bits=3, grid=512).fit is op.fit  # fitted once, cached
    x, dy = _data((3, 17), seed=6)
    y, g = _vjp(op, jnp.asarray(x), jnp.asarray(dy))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(f(jnp.asarray(x))))
    fit = op.fit
    code = (x.astype(np.float32)[..., None] >= fit.borders.astype(np.float32)).sum(-1)
    np.testing.assert_array_equal(np.asarray(g), dy * fit.levels.astype(np.float32)[code])
    # same optimum as the shipped mish table (grid 512 vs 4096, both refined)
    assert abs(fit.error - fewbit.load_table("mish", 3).error) < 2e-4
    # an even derivative is detected and fitted on |x|
    odd = fewbit.make_activation(lambda x: jnp.log(jnp.cosh(x)), bits=2, grid=128)
    assert odd.fit.symmetric is False  # f' = tanh is odd
    even = fewbit.make_activation(lambda x: x * x * x / 3 - jnp.tanh(x), bits=1, grid=128)
    assert even.fit.symmetric  # f' = x^2 - 1 + tanh^2 is even


@pytest.mark.parametrize("fn,msg", [
    (lambda x: x * jnp.sum(x), "not elementwise"),
    (jnp.cumsum, "not elementwise"),
    (lambda x: x[:3], "not elementwise"),
    (lambda x: jnp.flip(x) * 2.0, "not elementwise"),
    (3.0, "callable"),
])
def test_factory_rejects_non_elementwise(fn, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        fewbit.make_activation(fn, bits=2)


def test_bad_inputs():
    x = jnp.ones((4,), jnp.float32)
    for bad in (0, 5, 2.5, True):
        with pytest.raises(ValueError, match="bits"):
            fewbit.gelu(x, bits=bad)
    with pytest.raises(ValueError, match="unknown activation"):
        fewbit.activation("swishy", 3)
    with pytest.raises(TypeError, match="int32"):
        fewbit.gelu(jnp.ones((4,), jnp.int32))
    with pytest.raises(TypeError, match="float"):
        jax.jit(fewbit.silu)(jnp.ones((4,), jnp.uint8))
    with pytest.raises(ValueError, match="borders"):
        fewbit.fewbit_op(jnp.tanh, [0.0, 1.0], [0.0, 1.0], 1)
