"""Level 1 (residual bytes): exact byte counts on constructed cases, JAX and PyTorch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import TraceError, residual_bytes, slope
from jaxmem.models import ConvChain

N, H, W, C, DEPTH = 2, 8, 8, 4, 6


def _torch():
    """(torch, torch_ref.models, torch_ref.measure.saved_bytes), imported by the tests that
    compare with PyTorch only (collecting this module imports no torch)."""
    import torch

    import torch_ref.models as tm
    from torch_ref.measure import saved_bytes
    return torch, tm, saved_bytes

F32 = 4


def layer_bytes(n=N):
    return n * H * W * C * F32


def lax_chain(kernels, x, relu):
    """Independent size-preserving 3x3 bias-free conv chain (NHWC / HWIO)."""
    for k in kernels:
        x = jax.lax.conv_general_dilated(x, k, (1, 1), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if relu:
            x = jax.nn.relu(x)
    return x


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def kernels(depth=DEPTH, seed=0):
    return [rand(seed + i, (3, 3, C, C)) * 0.3 for i in range(depth)]


def only_layer(k_index, relu):
    """Loss as a function of kernel ``k_index`` only (the others and x are arguments)."""
    def loss(k, others, x):
        ks = list(others)
        ks.insert(k_index, k)
        return jnp.sum(lax_chain(ks, x, relu) ** 2)
    return loss


def split(ks, i):
    return ks[i], ks[:i] + ks[i + 1:]


@pytest.mark.parametrize("layer", [3, 0, DEPTH - 1])
def test_linear_chain_single_kernel_stores_exactly_one_layer_input(layer):
    ks = kernels()
    x = rand(99, (N, H, W, C))
    k, others = split(ks, layer)
    rep = residual_bytes(only_layer(layer, relu=False), k, others, x)
    # The kernel gradient of layer L needs only that layer's input (plus later kernels to
    # backprop through, which are arguments). The loss sum(y**2) also keeps y (2*y).
    act = rep.by_kind("activation")
    conv_inputs = [e for e in act if e.primitive == "conv_general_dilated"]
    squares = [e for e in act if e.primitive == "mul"]  # 2*y, from d/dy sum(y**2)
    assert len(squares) == 1 and squares[0].nbytes == layer_bytes()
    if layer == 0:
        # layer 1's input is the argument x itself: kept as an argument, no activation
        assert conv_inputs == []
        assert any(e.argument == "args[2]" for e in rep.by_kind("argument"))
    else:
        (inp,) = conv_inputs  # exactly one layer input
        assert inp.shape == (N, H, W, C) and inp.nbytes == layer_bytes()
    assert rep.activation_bytes == (2 if layer else 1) * layer_bytes()
    # arguments kept alive: kernels after `layer` (to backprop through); x only if layer==0
    later = DEPTH - 1 - layer
    expect_args = later * 3 * 3 * C * C * F32 + (layer_bytes() if layer == 0 else 0)
    assert rep.argument_bytes == expect_args
    assert rep.total_bytes == rep.activation_bytes + rep.argument_bytes + rep.constant_bytes


def test_linear_chain_exact_activation_bytes_sum_loss():
    """With loss = sum(y) nothing else is stored: exactly one layer input (layer 4)."""
    ks = kernels()
    x = rand(1, (N, H, W, C))
    k, others = split(ks, 3)

    def loss(k, others, x):
        ks2 = list(others)
        ks2.insert(3, k)
        return jnp.sum(lax_chain(ks2, x, relu=False))

    rep = residual_bytes(loss, k, others, x)
    assert rep.activation_bytes == layer_bytes()
    (entry,) = rep.by_kind("activation")
    assert entry.shape == (N, H, W, C) and entry.dtype == np.float32
    assert entry.nbytes == layer_bytes()
    # vs. differentiating every kernel: every layer input except x (an argument) is stored
    rep_all = residual_bytes(lambda ks, x: jnp.sum(lax_chain(ks, x, relu=False)), ks, x)
    assert rep_all.activation_bytes == (DEPTH - 1) * layer_bytes()
    assert rep_all.argument_bytes == layer_bytes() + (DEPTH - 1) * 3 * 3 * C * C * F32


def _flax_chain_params(depth, relu, seed=0):
    model = ConvChain(depth=depth, channels=C, relu=relu)
    x = rand(seed + 7, (N, H, W, C))
    return model, jax.jit(model.init)(jax.random.key(seed), x)["params"], x


def test_figure1_chain_jax_one_input_vs_torch_every_input():
    """The issue's acceptance case on the model zoo's Figure-1 chain (relu=False)."""
    torch, tm, saved_bytes = _torch()
    model, params, x = _flax_chain_params(DEPTH, relu=False)
    target = "conv_3"  # layer 4 (1-based)

    def loss(k4, params, x):
        p = dict(params)
        p[target] = {"kernel": k4}
        return jnp.sum(model.apply({"params": p}, x))

    rep = residual_bytes(loss, params[target]["kernel"], params, x)
    act = rep.by_kind("activation")
    assert len(act) == 1 and act[0].nbytes == layer_bytes()
    assert rep.activation_bytes == layer_bytes()

    # PyTorch: only layer 4's weight trainable, but the chain input requires grad.
    tmodel = tm.ConvChain(DEPTH, C, relu=False)
    for i in range(DEPTH):
        getattr(tmodel, f"conv_{i}").weight.requires_grad_(i == 3)
    xt = torch.randn(N, C, H, W, requires_grad=True)
    srep = saved_bytes(lambda m, x: m(x).sum(), tmodel, xt)
    # every conv input is saved: x (an argument) and the DEPTH-1 intermediate outputs
    assert srep.activation_bytes == (DEPTH - 1) * layer_bytes()
    args = {e.source for e in srep.entries if e.kind == "argument"}
    assert "args[1]" in args
    assert srep.activation_bytes > rep.activation_bytes
    # with the input not requiring grad, torch still stores the inputs of layers 4..DEPTH
    xt2 = torch.randn(N, C, H, W)
    srep2 = saved_bytes(lambda m, x: m(x).sum(), tmodel, xt2)
    assert srep2.activation_bytes == (DEPTH - 3) * layer_bytes()


def test_relu_chain_stores_one_conv_input():
    """With ReLU, the one stored conv input is the layer-3 ReLU output (jax.nn.relu is a
    custom_jvp); the ReLUs of layers 4..DEPTH keep a bool mask + an f32 zeros array each."""
    model, params, x = _flax_chain_params(DEPTH, relu=True)

    def loss(k4, params, x):
        p = dict(params)
        p["conv_3"] = {"kernel": k4}
        return jnp.sum(model.apply({"params": p}, x))

    rep = residual_bytes(loss, params["conv_3"]["kernel"], params, x)
    f32_layer = [e for e in rep.by_kind("activation")
                 if e.shape == (N, H, W, C) and e.dtype == np.float32 and e.primitive == "custom_jvp_call"]
    assert len(f32_layer) == 1
    masks = [e for e in rep.by_kind("activation") if e.dtype == np.bool_]
    assert len(masks) == DEPTH - 3  # relus of layers 4..DEPTH (the path back to layer 4)
    assert all(e.nbytes == N * H * W * C for e in masks)
    elems = N * H * W * C
    assert rep.activation_bytes == layer_bytes() + (DEPTH - 3) * (1 + 4) * elems


@pytest.mark.parametrize("relu", [False, True])
def test_residual_bytes_scale_exactly_with_batch(relu):
    torch, tm, saved_bytes = _torch()
    ks = kernels()
    f = lambda ks, x: jnp.sum(lax_chain(ks, x, relu))
    a = residual_bytes(f, ks, rand(3, (N, H, W, C)))
    b = residual_bytes(f, ks, rand(4, (3 * N, H, W, C)))
    assert a.activation_bytes > 0
    assert b.activation_bytes == 3 * a.activation_bytes
    # arguments: kernels are batch independent, x scales
    assert b.argument_bytes - a.argument_bytes == 2 * layer_bytes()
    # torch twin scales too
    tmodel = tm.ConvChain(DEPTH, C, relu=relu)
    sa = saved_bytes(lambda m, x: m(x).sum(), tmodel, torch.randn(N, C, H, W))
    sb = saved_bytes(lambda m, x: m(x).sum(), tmodel, torch.randn(3 * N, C, H, W))
    assert sb.activation_bytes == 3 * sa.activation_bytes > 0


def test_slope_of_residual_bytes_is_one_layer_input_per_layer():
    def measure(depth):
        ks = kernels(depth)
        return residual_bytes(lambda ks, x: jnp.sum(lax_chain(ks, x, False)), ks,
                              rand(5, (N, H, W, C))).activation_bytes

    assert slope(measure, 3) == layer_bytes()


def test_argnums_semantics_and_pytrees():
    x = rand(0, (4, 5))
    params = {"w": rand(1, (5, 3)), "b": rand(2, (3,))}

    def f(params, x):
        return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]))

    r0 = residual_bytes(f, params, x)  # params only: x kept (argument), tanh output kept
    assert {e.argument for e in r0.by_kind("argument")} == {"args[1]"}
    # tanh keeps 2 f32 per element with jax <= 0.10 (DESIGN); jax 0.11 differentiates it
    # through one primitive (1 - y**2) that keeps its output only
    per_elem = 1 if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11) else 2
    assert r0.activation_bytes == per_elem * 4 * 3 * F32
    r1 = residual_bytes(f, params, x, argnums=1)  # x only: w kept, not x
    assert {e.argument for e in r1.by_kind("argument")} == {"args[0]['w']"}
    r01 = residual_bytes(f, params, x, argnums=(0, 1))
    assert {e.argument for e in r01.by_kind("argument")} == {"args[0]['w']", "args[1]"}
    assert r01.argnums == (0, 1)
    assert residual_bytes(f, params, x, argnums=-2).argnums == (0,)


def test_closed_over_constant_and_static_argnums():
    w = rand(0, (6, 6))
    x = rand(1, (2, 6))

    def f(x, mode):
        assert mode == "sin"
        return jnp.sum(jnp.sin(x @ w))

    rep = residual_bytes(f, x, "sin", static_argnums=1)
    assert rep.constant_bytes == 6 * 6 * F32  # w, closed over, kept to backprop to x
    assert rep.activation_bytes == 2 * 6 * F32  # cos(x @ w)


def test_duplicate_residual_counted_once():
    x = rand(0, (16,))
    rep = residual_bytes(lambda x: jnp.sum(x * x * x), x)
    assert all(e.count >= 1 for e in rep.entries)
    args = rep.by_kind("argument")
    assert len(args) == 1 and args[0].nbytes == 16 * F32


@pytest.mark.parametrize("dtype,size", [(jnp.float32, 4), (jnp.bfloat16, 2), (jnp.float16, 2)])
def test_dtypes(dtype, size):
    x = rand(0, (8, 8), dtype)
    rep = residual_bytes(lambda x: jnp.sum(jnp.sin(x)), x)
    (e,) = rep.by_kind("activation")
    assert e.nbytes == 64 * size and e.dtype == np.dtype(dtype)


def _sin3(x):
    for _ in range(3):
        x = jnp.sin(x)
    return jnp.sum(x)


def test_jit_checkpoint_and_scan_inside_fn():
    x = rand(0, (16,))
    plain = residual_bytes(_sin3, x)
    assert plain.activation_bytes == 3 * 16 * F32  # cos of each layer
    assert residual_bytes(jax.jit(_sin3), x).activation_bytes == plain.activation_bytes
    remat = residual_bytes(jax.checkpoint(_sin3), x)  # only the input is kept
    assert remat.activation_bytes == 0 and remat.argument_bytes == 16 * F32
    scanned = residual_bytes(
        lambda x: jnp.sum(jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=4)[0]),
        x)
    assert scanned.activation_bytes == 4 * 16 * F32  # one stacked (4, 16) residual
    rep = residual_bytes(jax.vmap(lambda r: _sin3(r)), rand(1, (5, 16)))
    assert rep.activation_bytes == 5 * 3 * 16 * F32
    assert "test_measure_residuals.py" in rep.entries[0].source


# ---------------------------------------------------------------- errors

def test_error_non_array_argument():
    with pytest.raises(TypeError, match=r"args\[1\]\['a'\] is a str"):
        residual_bytes(lambda x, d: jnp.sum(x), rand(0, (3,)), {"a": "nope"})


def test_error_integer_argnum():
    with pytest.raises(TypeError, match=r"args\[0\] has dtype int32.*not differentiable"):
        residual_bytes(lambda x: jnp.sum(x * 1.0), jnp.arange(3))


def test_error_integer_output():
    with pytest.raises(TypeError, match="not differentiable"):
        residual_bytes(lambda x: jnp.argmax(x), rand(0, (3,)))


def test_error_trace_failure_names_function():
    def my_broken_loss(x):
        return jnp.sum(x @ jnp.ones((7, 2)))

    with pytest.raises(TraceError, match="my_broken_loss") as ei:
        residual_bytes(my_broken_loss, rand(0, (3, 4)))
    assert isinstance(ei.value, ValueError) and ei.value.__cause__ is not None


def test_error_bad_argnums_and_fn():
    x = rand(0, (3,))
    with pytest.raises(ValueError, match="argnums"):
        residual_bytes(lambda x: jnp.sum(x), x, argnums=1)
    with pytest.raises(TypeError, match="argnums"):
        residual_bytes(lambda x: jnp.sum(x), x, argnums="0")
    with pytest.raises(TypeError, match="callable"):
        residual_bytes(3, x)
    with pytest.raises(ValueError, match="both"):
        residual_bytes(lambda x: jnp.sum(x), x, argnums=0, static_argnums=0)


def test_torch_saved_bytes_dedupes_by_storage():
    torch, _, saved_bytes = _torch()
    x = torch.randn(64, requires_grad=True)

    def f(x):
        y = torch.exp(x)          # saves its output y
        return (y * y).sum()      # saves y (twice): same storage

    rep = saved_bytes(f, x)
    act = [e for e in rep.entries if e.kind == "activation"]
    assert len(act) == 1 and act[0].nbytes == 64 * 4 and act[0].count == 3
    with pytest.raises(TypeError, match="callable"):
        saved_bytes(None)
