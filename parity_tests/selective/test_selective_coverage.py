"""Coverage of jaxmem.selective beyond the core layers: late weight copies (compiled-bytes
slope), sharded inputs, Linen ConvTranspose, visible norm fallbacks, NNX GroupNorm, jvp /
second order."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assert import assert_tree_close, scaled_atol
from _data import normal_host
from _lazy import Lazy
from flax import nnx
from jax import lax

import jaxmem
import jaxmem.selective as S
from jaxmem.measure import compiled_memory, residual_bytes, slope
from jaxmem.selective import linen as SL

#: the selective part alone (no attention; few-bit is off by default)
_convert = functools.partial(jaxmem.linen.convert, attention=False)
_nnx_convert = functools.partial(jaxmem.nnx.convert, attention=False, copy=False)

K = Lazy(lambda: jax.random.split(jax.random.key(3), 8))


def _normal(seed, shape, scale=1.0, inf_at=None):
    """Normal float32 test data drawn with NumPy (``jax.random`` op by op compiles a program
    per shape); ``inf_at``: one entry set to +inf."""
    x = normal_host(seed, shape, scale)
    if inf_at is not None:
        x[inf_at] = np.inf
    return jnp.asarray(x)


def _close(a, b, rtol=2e-5, atol=2e-5):
    assert_tree_close(a, b, rtol=rtol, atol=atol)


# ------------------------------------------------------------- weight copies (compiled)
def _lax_conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _weight_slope(conv):
    """Compiled bytes per added frozen 3x3x64x64 conv layer (147 KiB kernel) at a tiny
    activation (1x4x4x64 = 4 KiB), input differentiated: the cost of weight copies."""
    def measure(d):
        x = _normal(0, (1, 4, 4, 64))
        ws = [_normal((1, i), (3, 3, 64, 64), 0.05)
              for i in range(d)]

        def loss(x, ws):
            for w in ws:
                x = jnp.tanh(conv(x, w))
            return jnp.sum(x)
        c = compiled_memory(jax.grad(loss), x, ws)
        return c.temp_bytes + c.output_bytes
    return slope(measure, 3)


@pytest.mark.xla_cpu  # XLA:GPU plans differently: benchmarks/gpu, README
def test_conv_weight_copies_are_not_kept_through_the_step():
    """XLA (CPU) makes a flipped/re-laid-out copy of each kernel for the input-gradient conv
    and, left alone, builds all of them at the start of the step. The selective conv ties
    each copy to its layer's activation / cotangent, so per added layer far less than one
    kernel is planned."""
    kernel = 3 * 3 * 64 * 64 * 4
    ours = _weight_slope(S.conv)
    assert ours < 0.25 * kernel, (ours, kernel)
    # the same layers through plain lax keep one kernel copy per layer (what we remove)
    assert _weight_slope(_lax_conv) >= 0.9 * kernel


def test_late_weight_gradients_exact_and_nonfinite_local():
    """The ``+0`` tie is exact, and an inf in the cotangent does not turn the whole input
    gradient into NaN (the tie is built from a bool, not from ``0 * g``)."""
    x = _normal(2, (2, 6, 6, 3))
    w = _normal(3, (3, 3, 3, 5))
    ct = _normal(4, (2, 6, 6, 5), inf_at=(0, 0, 0, 0))
    _, vjp_s = jax.vjp(lambda x: S.conv(x, w), x)
    _, vjp_j = jax.vjp(lambda x: _lax_conv(x, w), x)
    (ds,), (dj,) = vjp_s(ct), vjp_j(ct)
    np.testing.assert_array_equal(np.isnan(ds), np.isnan(dj))
    fin = np.isfinite(dj)
    assert fin.mean() > 0.9
    np.testing.assert_allclose(np.asarray(ds)[fin], np.asarray(dj)[fin], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ sharded inputs
_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxmem
    import jaxmem.selective as S
    assert len(jax.devices()) == 2, jax.devices()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = nn.LayerNorm()(x)
            x = x.reshape(x.shape[0], -1)
            return nn.Dense(5)(x)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = Net()
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    v = jax.jit(lambda k, x: model.init(k, x, train=False))(jax.random.key(1), x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    vs = jax.device_put(v, NamedSharding(mesh, P()))

    def make(m):
        def loss(p, x):
            y, _ = m.apply({**v, "params": p}, x, mutable=["batch_stats"])
            return jnp.mean(y ** 2)
        return jax.jit(jax.grad(loss, (0, 1)))

    g_ref = make(model)(vs["params"], xs)
    g_sel = make(jaxmem.linen.convert(model, attention=False))(vs["params"], xs)
    assert g_sel[1].sharding.is_equivalent_to(xs.sharding, 4), g_sel[1].sharding
    for a, b in zip(jax.tree.leaves(g_sel), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    # the functional primitives directly, batch-sharded, under jit
    w = jax.random.normal(jax.random.key(2), (3, 3, 3, 4))
    f = lambda x, w: jnp.sum(S.relu(S.conv(x, w)) ** 2)
    r = lambda x, w: jnp.sum(jax.nn.relu(jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))) ** 2)
    for a, b in zip(jax.jit(jax.grad(f, (0, 1)))(xs, w), jax.jit(jax.grad(r, (0, 1)))(x, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    print("SHARDED_OK")
""")


def test_sharded_inputs_match_plain_jax():
    """Two CPU devices (a fresh process), batch-sharded input, replicated parameters: the
    converted model's gradients equal plain JAX's and keep the input's sharding."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                       check=False, timeout=300, env=env, cwd=root)
    assert r.returncode == 0 and "SHARDED_OK" in r.stdout, r.stderr[-3000:]


# -------------------------------------------------------------------- Linen ConvTranspose
class _Up(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.ConvTranspose(6, (3, 3), strides=(2, 2), padding="SAME")(x)
        x = nn.ConvTranspose(4, (4, 4), strides=(2, 2), padding="CIRCULAR",
                             transpose_kernel=True)(jnp.tanh(x))
        return nn.ConvTranspose(3, (2, 2), padding="VALID",
                                mask=jnp.tril(jnp.ones((2, 2, 4, 3))))(x)


def test_linen_conv_transpose_converted_and_exact():
    model = _Up()
    x = _normal(5, (2, 5, 5, 3))
    p = jax.jit(model.init)(K[6], x)["params"]
    conv_model = _convert(model)
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply({"params": p}, x)))
    np.testing.assert_allclose(conv_model.apply({"params": p}, x), model.apply({"params": p}, x),
                               rtol=1e-5, atol=1e-5)
    _close(jax.jit(jax.grad(loss(conv_model), (0, 1)))(p, x),
           jax.jit(jax.grad(loss(model), (0, 1)))(p, x))
    # the selective primitive is in the trace: kernels differentiated -> inputs tagged
    rep = residual_bytes(loss(conv_model), p, x, argnums=0)
    assert "jaxmem.selective.conv.input" in str(rep), str(rep)
    # frozen kernels, input differentiated: no layer input kept at all
    rep = residual_bytes(loss(conv_model), p, x, argnums=1)
    assert "conv.input" not in str(rep), str(rep)
    # the rebinding of flax.linen.linear.lax is undone
    import flax.linen.linear as fl
    assert fl.lax is jax.lax


class _NNXUp(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.ConvTranspose(3, 6, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
        self.b = nnx.ConvTranspose(6, 4, (4, 4), strides=(2, 2), padding="CIRCULAR",
                                   transpose_kernel=True, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_nnx_conv_transpose_converted_and_exact():
    import flax.nnx.nn.linear as fnl

    import jaxmem
    model = _NNXUp(nnx.Rngs(3))
    conv_model = jaxmem.nnx.convert(model)
    assert type(conv_model.a) is nnx.ConvTranspose  # layers are not changed
    x = _normal(5, (2, 5, 5, 3))

    def loss(m):
        graphdef, params = nnx.split(m, nnx.Param)
        return graphdef, params, (lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x))))

    _, p, f_ref = loss(model)
    _, p_sel, f_sel = loss(conv_model)
    np.testing.assert_allclose(conv_model(x), model(x), rtol=1e-5, atol=1e-5)
    _close(jax.jit(jax.grad(f_sel, (0, 1)))(p_sel, x), jax.jit(jax.grad(f_ref, (0, 1)))(p, x))
    assert "jaxmem.selective.conv.input" in str(residual_bytes(f_sel, p_sel, x, argnums=0))
    assert "jaxmem.selective.conv.input" not in str(residual_bytes(f_sel, p_sel, x, argnums=1))
    assert fnl.lax is jax.lax  # the module's lax is restored after each call
    rep = jaxmem.report(jax.grad(f_sel), p_sel, x)
    assert [e.status for e in rep.by_kind("conv")] == ["converted"] * 2, rep


# ------------------------------------------------------------------- visible fallbacks
class _MaskedLN(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        return nn.LayerNorm()(x, mask=mask)


def test_norm_with_mask_falls_back_visibly_and_exactly():
    x = _normal(7, (3, 10))
    mask = jnp.arange(10)[None, :] < jnp.array([[4], [7], [10]])
    model = _MaskedLN()
    p = jax.jit(model.init)(K[0], x, mask)["params"]
    loss = lambda m: lambda p, x: jnp.sum(jnp.where(mask, m.apply({"params": p}, x, mask), 0)
                                          ** 3)
    g_sel = jax.jit(jax.grad(loss(_convert(model)), (0, 1)))(p, x)
    rep = jaxmem.report(loss(_convert(model)), p, x)
    assert not [e for e in rep.by_kind("norm") if e.status == "converted"], str(rep)
    _close(g_sel, jax.jit(jax.grad(loss(model), (0, 1)))(p, x))


def test_batch_norm_axis_name_is_converted_and_exact():
    model = nn.BatchNorm(use_running_average=False, axis_name="b")
    x = _normal(1, (2, 6, 5))
    v = jax.jit(jax.vmap(lambda x: model.init(K[2], x), axis_name="b"))(x)
    v = jax.tree.map(lambda a: a[0], v)

    def loss(m):
        def f(p, x):
            y = jax.vmap(lambda x: m.apply({**v, "params": p}, x, mutable=["batch_stats"])[0],
                         axis_name="b")(x)
            return jnp.sum(jnp.sin(y))
        return f
    with warnings.catch_warnings():
        warnings.simplefilter("error", SL.SelectiveFallbackWarning)
        g_sel = jax.jit(jax.grad(loss(_convert(model)), (0, 1)))(v["params"], x)
    _close(g_sel, jax.jit(jax.grad(loss(model), (0, 1)))(v["params"], x))


def test_supported_norms_do_not_warn():
    model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.GroupNorm(num_groups=2)])
    x = _normal(3, (4, 5))
    p = jax.jit(model.init)(K[4], x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SL.SelectiveFallbackWarning)
        jax.jit(jax.grad(lambda x: jnp.sum(_convert(model).apply(p, x) ** 2)))(x)


# ------------------------------------------------------------------------ NNX GroupNorm
class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.gn = nnx.GroupNorm(8, num_groups=4, rngs=rngs)
        self.lin = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.lin(jnp.mean(nnx.relu(self.gn(self.conv(x))), axis=(1, 2)))


def test_nnx_group_norm_converted_exact_and_smaller():
    ref = _NNXNet(nnx.Rngs(0))
    sel = _nnx_convert(nnx.clone(ref))
    assert type(sel.gn) is nnx.GroupNorm  # layers are not changed
    x = _normal(5, (2, 6, 6, 3))
    fwd = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(fwd(sel, x), fwd(ref, x), rtol=1e-5, atol=1e-5)

    def grads(m):
        gdef, state = nnx.split(m)
        f = lambda s, x: jnp.sum(nnx.merge(gdef, s)(x) ** 2)
        return jax.jit(jax.grad(f, (0, 1)))(state, x), residual_bytes(f, state, x, argnums=1)
    (g_s, r_s), (g_r, r_r) = grads(sel), grads(ref)
    _close(g_s, g_r, rtol=5e-5, atol=5e-5)
    n = x.shape[0] * 6 * 6 * 8 * 4  # one f32 tensor of the norm's input
    # plain: >= 2 input-sized tensors for the norm; selective: one (+ the relu bits)
    assert r_r.activation_bytes >= 2 * n
    assert r_s.activation_bytes <= n + n // 8 + 4096, str(r_s)


def test_nnx_group_norm_mask_falls_back_visibly():
    gn = _nnx_convert(nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0)))
    x = _normal(6, (2, 3, 4))
    mask = jnp.ones((2, 3, 4), bool).at[:, 0].set(False)
    ref = nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x, mask: m(x, mask=mask))
    y = fwd(gn, x, mask)  # the masked norm is kept as written (exact)
    np.testing.assert_allclose(y, fwd(ref, x, mask), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- jvp / second order
def test_jvp_through_converted_model_raises_clear_error_second_order_works():
    model = nn.Sequential([nn.Conv(4, (3, 3)), nn.LayerNorm(), jnp.tanh, nn.Conv(2, (1, 1))])
    x = _normal(7, (2, 5, 5, 3))
    p = jax.jit(model.init)(K[0], x)
    f = lambda m: lambda x: jnp.sum(jnp.sin(m.apply(p, x)))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(f(_convert(model)), (x,), (x,))
    jax.jit(lambda x: jax.jvp(f(model), (x,), (x,)))(x)  # the unconverted model supports it
    # reverse-over-reverse (Hessian-vector product as grad of grad) is supported
    hvp = lambda m: jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(f(m))(x), x)))(x)
    np.testing.assert_allclose(hvp(_convert(model)), hvp(model), rtol=1e-4, atol=1e-4)


# ------------------------------------------------- strided conv: input gradient by phases
@pytest.mark.parametrize("shape,kernel,strides,padding", [
    ((2, 16, 16, 3), (7, 7), (2, 2), ((3, 3), (3, 3))),   # ResNet stem
    ((2, 8, 8, 3), (1, 1), (2, 2), "VALID"),              # 1x1 downsample
    ((2, 7, 6, 3), (2, 5), (3, 2), ((0, 2), (1, -1))),     # asymmetric / negative pads
    ((2, 11, 3), (4,), (3,), "SAME_LOWER"),
    ((2, 5, 3), (2,), (4,), "VALID"),                     # a phase with no kernel taps
])
def test_strided_conv_input_grad_by_phases_matches_lax(shape, kernel, strides, padding):
    nsp = len(kernel)
    x = _normal(0, shape)
    w = _normal(1, (*kernel, shape[-1], 4))
    sp = "DHW"[-nsp:]
    dn = ("N" + sp + "C", sp + "IO", "N" + sp + "C")
    from jaxmem.selective import linear as L
    pads = L._check_padding(padding, nsp)
    assert L._phase_dx_fn(x.shape, w.shape, strides, pads, None, None,
                          lax.conv_dimension_numbers(x.shape, w.shape, dn), 1, 1, None)
    ref = lambda x, w: lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=dn)
    ours = lambda x, w: S.conv(x, w, strides=strides, padding=padding)
    ct = _normal(2, jax.eval_shape(ref, x, w).shape)
    vjp = lambda f: jax.jit(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))(x, w, ct)
    assert_tree_close(vjp(ours), vjp(ref), rtol=1e-5, atol=scaled_atol(1e-5, plus=1.0))
    if shape != (2, 16, 16, 3):
        return
    # bf16 and vmap go through the same path (checked on the stem configuration)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    gb = jax.jit(jax.grad(lambda x: jnp.sum(ours(x, wb).astype(jnp.float32) ** 2)))(xb)
    gr = jax.jit(jax.grad(lambda x: jnp.sum(ref(x, wb).astype(jnp.float32) ** 2)))(xb)
    assert gb.dtype == jnp.bfloat16
    gr32 = np.asarray(gr, np.float32)
    np.testing.assert_allclose(np.asarray(gb, np.float32), gr32,
                               rtol=0.05, atol=0.05 * float(np.abs(gr32).max()))
    gv = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(ours(x[None], w) ** 2))))(x)
    np.testing.assert_allclose(gv, jax.jit(jax.grad(lambda x: jnp.sum(ref(x, w) ** 2)))(x),
                               rtol=1e-5, atol=1e-4)


def test_phase_path_not_used_where_it_does_not_apply():
    from jaxmem.selective import linear as L
    dn = lax.conv_dimension_numbers((2, 8, 8, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"))
    args = ((2, 8, 8, 3), (3, 3, 3, 4), (2, 2), "SAME")
    assert L._phase_dx_fn(*args, None, (2, 2), dn, 1, 1, None) is None      # dilation
    assert L._phase_dx_fn(*args, None, None, dn, 3, 1, None) is None        # groups
    assert L._phase_dx_fn((2, 8, 8, 3), (3, 3, 3, 4), (1, 1), "SAME", None, None, dn, 1, 1,
                          None) is None                                      # stride 1
    nchw = lax.conv_dimension_numbers((2, 3, 8, 8), (4, 3, 3, 3), ("NCHW", "OIHW", "NCHW"))
    assert L._phase_dx_fn((2, 3, 8, 8), (4, 3, 3, 3), (2, 2), "SAME", None, None, nchw, 1, 1,
                          None) is None                                      # other layout
