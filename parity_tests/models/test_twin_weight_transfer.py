"""Weight transfer ``torch_ref.convert``: exact round trips both ways and clear errors."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn
from twin_parity_utils import FULL_DEPTH, TWINS, flat

import jaxmem.models as jm
import torch_ref.models as tm
from torch_ref.convert import check_compatible, grads_to_jax, init_twins, jax_to_torch, torch_to_jax

ALL = {**TWINS, **FULL_DEPTH}


@functools.cache
def _abstract_init_named(name):
    return _abstract_init_uncached(ALL[name])


def _abstract_init(twin):
    return _abstract_init_named(twin.name)


def _abstract_init_uncached(twin):
    x = jnp.zeros(twin.input_shape, jnp.int32 if twin.kind == "tokens" else jnp.float32)
    return jax.eval_shape(twin.jax_model.init, jax.random.PRNGKey(0), x)


def _random_like(abstract, seed):
    """Random values (not what any initialiser would give) in the layout of ``abstract``."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype)), abstract)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32 if a.dtype.itemsize == 4
                  else np.uint64)


@pytest.mark.parametrize("name", sorted(ALL))
def test_layout_of_torch_twin_equals_jax_init(name):
    """torch_to_jax(torch twin) has exactly the names, shapes and dtypes of the JAX init."""
    twin = ALL[name]
    want = {k: (v.shape, v.dtype) for k, v in flat_abstract(_abstract_init(twin)).items()}
    got = {k: (v.shape, v.dtype) for k, v in flat(torch_to_jax(twin.make_torch())).items()}
    assert got == want


def flat_abstract(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", sorted(ALL))
def test_roundtrip_jax_torch_jax_is_bitwise(name):
    twin = ALL[name]
    variables = _random_like(_abstract_init(twin), seed=1)
    model = jax_to_torch(variables, twin.make_torch())
    back = torch_to_jax(model)
    fa, fb = flat(variables), flat(back)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype
        np.testing.assert_array_equal(_bits(fa[k]), _bits(fb[k]), err_msg=k)


@pytest.mark.parametrize("name", ["resnet_bottleneck_cifar", "gpt", "vit", "vgg_bn"])
def test_roundtrip_torch_jax_torch_is_bitwise(name):
    twin = TWINS[name]
    torch.manual_seed(3)
    src = twin.make_torch()
    with torch.no_grad():  # running stats too, not just the 0/1 defaults
        for b in src.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape) + 0.1)
    torch.manual_seed(4)
    dst = jax_to_torch(torch_to_jax(src), twin.make_torch())
    sd_src, sd_dst = src.state_dict(), dst.state_dict()
    for k, v in sd_src.items():
        if k.endswith("num_batches_tracked"):
            continue
        assert torch.equal(v.view(torch.int32), sd_dst[k].view(torch.int32)), k


def test_kernel_layouts():
    """Conv OIHW -> HWIO and Linear (out, in) -> (in, out) are the documented transposes."""
    conv = tm.ConvChain(depth=1, channels=3)
    v = torch_to_jax(conv)
    w = conv.conv_0.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(v["params"]["conv_0"]["kernel"]),
                                  w.transpose(2, 3, 1, 0))
    mlp = tm.MLP(5, (7,))
    v = torch_to_jax(mlp)
    np.testing.assert_array_equal(np.asarray(v["params"]["dense_0"]["kernel"]),
                                  mlp.dense_0.weight.detach().numpy().T)


def test_bfloat16_roundtrip_is_bitwise():
    jmodel = jm.MLP((6, 3))
    v = jmodel.init(jax.random.PRNGKey(0), jnp.ones((1, 4)))
    v = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), v)
    t = jax_to_torch(v, tm.MLP(4, (6, 3)).to(torch.bfloat16))
    assert t.dense_0.weight.dtype == torch.bfloat16
    back = torch_to_jax(t)
    for k, a in flat(v).items():
        b = flat(back)[k]
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=k)


def test_grads_to_jax_layout_and_missing_grad():
    model = tm.MLP(4, (5, 2))
    with pytest.raises(ValueError, match="dense_0.weight"):
        grads_to_jax(model)
    zeros = grads_to_jax(model, missing="zeros")
    assert float(jnp.abs(zeros["dense_0"]["kernel"]).sum()) == 0.0
    model(torch.randn(3, 4)).sum().backward()
    g = grads_to_jax(model)
    np.testing.assert_array_equal(np.asarray(g["dense_1"]["kernel"]),
                                  model.dense_1.weight.grad.numpy().T)
    with pytest.raises(ValueError, match="missing"):
        grads_to_jax(model, missing="ignore")


# ----------------------------------------------------------------------------- errors


def _mlp_vars():
    return torch_to_jax(tm.MLP(4, (5, 2)))


def test_error_shape_mismatch_names_parameter():
    v = torch_to_jax(tm.resnet18(width=0.125, num_classes=5))
    with pytest.raises(ValueError, match=r"shape mismatch for 'params/conv1/kernel'"):
        jax_to_torch(v, tm.resnet18(width=0.25, num_classes=5))
    with pytest.raises(ValueError, match=r"params/fc/kernel"):
        jax_to_torch(v, tm.resnet18(width=0.125, num_classes=7))


def test_error_missing_and_unexpected_names():
    v = _mlp_vars()
    del v["params"]["dense_1"]
    with pytest.raises(ValueError, match=r"lack 'params/dense_1/kernel'.*dense_1.weight"):
        jax_to_torch(v, tm.MLP(4, (5, 2)))
    v = _mlp_vars()
    v["params"]["dense_9"] = {"kernel": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"'params/dense_9/kernel' has no counterpart"):
        jax_to_torch(v, tm.MLP(4, (5, 2)))
    v = torch_to_jax(tm.vgg11(width=0.125, batch_norm=True))
    with pytest.raises(ValueError, match="batch_stats/features/bn_0/mean"):
        jax_to_torch(v, tm.vgg11(width=0.125, batch_norm=False))


def test_error_does_not_write_partially():
    model = tm.MLP(4, (5, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    v = torch_to_jax(tm.MLP(4, (5, 2)))
    v["params"]["dense_1"]["kernel"] = jnp.ones((5, 3))
    with pytest.raises(ValueError, match="dense_1"):
        jax_to_torch(v, model)
    for k, t in model.state_dict().items():
        assert torch.equal(t, before[k]), k


def test_error_bad_variables_and_dtypes():
    with pytest.raises(TypeError, match="'params'"):
        jax_to_torch([1, 2], tm.MLP(4, (2,)))
    with pytest.raises(TypeError, match="'params'"):
        jax_to_torch({"weights": {}}, tm.MLP(4, (2,)))
    v = _mlp_vars()
    v["params"]["dense_0"]["bias"] = jnp.arange(5)
    with pytest.raises(TypeError, match="dense_0/bias"):
        jax_to_torch(v, tm.MLP(4, (5, 2)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        torch_to_jax({"w": 1})
    check_compatible(_mlp_vars(), tm.MLP(4, (5, 2)))
    with pytest.raises(ValueError, match="dense_0"):
        check_compatible(_mlp_vars(), tm.MLP(3, (5, 2)))


class _WithConv1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.proj = nn.Conv1d(2, 2, 3)


class _WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(3))


def test_error_unsupported_modules_are_named():
    with pytest.raises(TypeError, match=r"'proj'.*Conv1d"):
        torch_to_jax(_WithConv1d())
    with pytest.raises(TypeError, match=r"'attn'.*MultiheadAttention"):
        torch_to_jax(_WithMHA())
    with pytest.raises(TypeError, match=r"buffers \['table'\]"):
        torch_to_jax(_WithBuffer())
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match=r"'0'.*groups"):
        torch_to_jax(grouped)
    with pytest.raises(TypeError, match=r"'proj'"):
        jax_to_torch({"params": {}}, _WithConv1d())


def test_init_twins_gives_identical_models():
    jmodel, tmodel = jm.MLP((7, 3)), tm.MLP(5, (7, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
    v = init_twins(jmodel, tmodel, jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(np.asarray(v["params"]["dense_0"]["kernel"]),
                                  tmodel.dense_0.weight.detach().numpy().T)
    y_t = tmodel(torch.as_tensor(np.array(x))).detach().numpy()
    np.testing.assert_allclose(jmodel.apply(v, x), y_t, rtol=1e-5, atol=1e-6)
