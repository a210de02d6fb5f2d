"""Behaviour of the JAX twin models beyond parity: the properties they are built to have,
JAX transformations and dtypes, bad input, the NNX versions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _assert import assert_tree_close
from _lazy import once
from flax import nnx
from twin_parity_utils import fjit

import jaxmem.models as jm
import torch_ref.models as tm
from jaxmem.models.nnx import MLPNNX, ConvChainNNX, load_params, params_of
from torch_ref.convert import jax_to_torch, torch_to_jax

KEY = once(lambda: jax.random.PRNGKey(0))


def _normal(shape, seed=0, dtype=jnp.float32):
    """Drawn with NumPy: no compiled program per shape."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


# ----------------------------------------------------------------- ConvChain (paper Fig. 1)

def test_convchain_layout_matches_paper_figure1():
    model = jm.ConvChain(depth=5, channels=8)
    x = _normal((2, 12, 12, 8))
    params = jax.eval_shape(model.init, KEY(), x)["params"]
    assert sorted(params) == [f"conv_{i}" for i in range(5)]
    for p in params.values():
        assert set(p) == {"kernel"}                      # bias-free
        assert p["kernel"].shape == (3, 3, 8, 8)         # 3x3, channels -> channels
    assert jax.eval_shape(model.apply, {"params": params}, x).shape == x.shape  # size-preserving


def test_convchain_linear_variant_is_linear_and_relu_variant_is_not():
    x, z = _normal((2, 6, 6, 3), 1), _normal((2, 6, 6, 3), 2)
    lin = jm.ConvChain(depth=4, channels=3, relu=False)
    v = fjit(lin.init)(KEY(), x)
    f = fjit(lambda a: lin.apply(v, a))
    np.testing.assert_allclose(f(2.0 * x - 3.0 * z), 2.0 * f(x) - 3.0 * f(z), rtol=1e-4, atol=1e-5)
    relu = jm.ConvChain(depth=4, channels=3)
    g = fjit(lambda a: relu.apply(v, a))
    assert np.all(np.asarray(g(x)) >= 0)
    assert not np.allclose(g(-x), -g(x), atol=1e-3)


@pytest.mark.parametrize("relu", [True, False])
def test_convchain_init_distribution_is_shared(relu):
    """Both twins draw kernels from N(0, gain / fan_in), gain 2 (ReLU) or 1."""
    c = 32
    std = np.sqrt((2.0 if relu else 1.0) / (9 * c))
    kj = np.asarray(fjit(jm.ConvChain(1, c, relu).init)(KEY(), jnp.ones((1, 3, 3, c)))
                    ["params"]["conv_0"]["kernel"])
    torch.manual_seed(0)
    kt = tm.ConvChain(1, c, relu).conv_0.weight.detach().numpy()
    for k in (kj, kt):
        assert abs(k.std() / std - 1) < 0.05 and abs(k.mean()) < 0.05 * std


# --------------------------------------------------------------------------- GPT, ViT

def test_gpt_is_causal_and_head_is_tied():
    cfg = jm.GPTConfig(vocab=31, ctx=12, d_model=16, n_head=2, n_layer=2)
    model = jm.GPT(cfg)
    tok = np.random.default_rng(0).integers(0, 20, (2, 10))   # tokens 20..30 never appear
    changed = tok.copy()
    changed[:, 6:] = (tok[:, 6:] + 5) % 20

    def run(key, tok, changed):  # one compiled program
        v = model.init(key, tok)
        g = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, tok)))(v["params"])
        return v, model.apply(v, tok), model.apply(v, changed), g

    v, a, b, g = fjit(run)(KEY(), tok, changed)
    assert set(v["params"]) == {"wte", "wpe", "h_0", "h_1", "ln_f"}   # no separate head
    np.testing.assert_array_equal(a[:, :6], b[:, :6])    # the past ignores the future
    assert not np.allclose(a[:, 6:], b[:, 6:])
    # Rows of wte for tokens absent from the input get gradient only through the tied head.
    assert np.all(np.abs(np.asarray(g["wte"]["embedding"])[20:]).sum(axis=1) > 0)


def test_vit_tokens_follow_patch_grid():
    """Without position embeddings attention is a set operation, so swapping two patches
    leaves the cls output unchanged; with them it changes."""
    cfg = jm.ViTConfig(image_size=8, patch_size=4, d_model=16, n_head=2, n_layer=1,
                       num_classes=3)
    model = jm.ViT(cfg)
    x = _normal((1, 8, 8, 3))
    swapped = jnp.concatenate([x[:, :, 4:], x[:, :, :4]], axis=2)  # swap patch columns

    def run(key):  # one compiled program
        v = model.init(key, x)
        v0 = {"params": {**v["params"], "pos_embed": jnp.zeros_like(v["params"]["pos_embed"])}}
        return [model.apply(vv, xx) for vv in (v0, v) for xx in (x, swapped)]

    a0, b0, a, b = fjit(run)(KEY())
    np.testing.assert_allclose(a0, b0, rtol=1e-5, atol=1e-6)
    assert not np.allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------- VGG features trunk

def test_vgg_features_trunk_alone_equals_vgg_trunk():
    x = _normal((2, 32, 32, 3))
    full = jm.vgg16(width=0.0625, batch_norm=True)
    trunk = jm.vgg_features("vgg16", width=0.0625, batch_norm=True)
    vf = jax.eval_shape(full.init, KEY(), x)
    vt = jax.eval_shape(trunk.init, KEY(), x)
    assert jax.tree_util.tree_structure(vt["params"]) == \
        jax.tree_util.tree_structure(vf["params"]["features"])
    torch.manual_seed(0)
    t_full = tm.vgg16(width=0.0625, batch_norm=True).eval()
    v = torch_to_jax(t_full)
    sub = {"params": v["params"]["features"], "batch_stats": v["batch_stats"]["features"]}
    y = fjit(trunk.apply)(sub, x)
    yt = t_full.features(torch.as_tensor(np.asarray(x).transpose(0, 3, 1, 2).copy()))
    np.testing.assert_allclose(y, yt.detach().numpy().transpose(0, 2, 3, 1), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------- transformations and dtypes

def test_vmap_jit_checkpoint_and_scan():
    model = jm.ConvChain(depth=3, channels=4)
    xs = _normal((3, 2, 6, 6, 4))
    v = fjit(model.init)(KEY(), xs[0])
    apply = fjit(model.apply)  # one compiled program for the three examples
    direct = jnp.stack([apply(v, x) for x in xs])
    np.testing.assert_allclose(fjit(jax.vmap(lambda x: model.apply(v, x)))(xs), direct,
                               rtol=1e-5, atol=1e-6)
    loss = lambda p, x: jnp.sum(model.apply({"params": p}, x) ** 2)
    g, g_ck = fjit(lambda p, x: (jax.grad(loss)(p, x), jax.grad(jax.checkpoint(loss))(p, x)))(
        v["params"], xs[0])
    assert jax.tree.structure(g) == jax.tree.structure(g_ck)
    assert_tree_close(g, g_ck, rtol=1e-5, atol=1e-6)

    def body(carry, x):
        return carry + loss(v["params"], x), None
    scanned, summed = fjit(lambda a: (jax.lax.scan(body, 0.0, a)[0],
                                      sum(loss(v["params"], x) for x in a)))(xs)
    np.testing.assert_allclose(scanned, summed, rtol=1e-5)


@pytest.mark.parametrize("which,dtype", [(w, jnp.bfloat16) for w in
                                          ("convchain", "mlp", "resnet", "gpt", "vit")]
                         + [("convchain", jnp.float16), ("mlp", jnp.float16)])
def test_half_precision_forward(which, dtype):
    """``dtype=`` computes in half precision; results stay close to float32."""
    if which == "convchain":
        mk, x = (lambda d: jm.ConvChain(3, 4, dtype=d)), _normal((2, 8, 8, 4))
    elif which == "mlp":
        mk, x = (lambda d: jm.MLP((16, 4), activation="gelu", dtype=d)), _normal((3, 5))
    elif which == "resnet":
        mk = lambda d: jm.ResNet("bottleneck", (1,), width=0.125, num_classes=4,
                                 stem="cifar", dtype=d)
        x = _normal((4, 8, 8, 3))
    elif which == "gpt":
        cfg = jm.GPTConfig(vocab=17, ctx=8, d_model=16, n_head=2, n_layer=1)
        mk, x = (lambda d: jm.GPT(cfg, dtype=d)), jnp.asarray(np.random.default_rng(0).integers(0, 17, (2, 8)))
    else:
        cfg = jm.ViTConfig(image_size=8, patch_size=4, d_model=16, n_head=2, n_layer=1)
        mk, x = (lambda d: jm.ViT(cfg, dtype=d)), _normal((2, 8, 8, 3))

    def both(key, x):  # parameters, float32 and half-precision outputs: one program
        v = mk(None).init(key, x)
        return mk(None).apply(v, x), mk(dtype).apply(v, x if which == "gpt" else x.astype(dtype))

    y32, y16 = fjit(both)(KEY(), x)
    assert y16.dtype == dtype
    err = np.linalg.norm(np.asarray(y16, np.float32) - y32) / np.linalg.norm(y32)
    assert err < 3e-2


# -------------------------------------------------------------------------- bad input

def test_bad_input_errors_name_the_argument():
    x = jnp.ones((1, 8, 8, 3))
    with pytest.raises(ValueError, match="channels"):
        jm.ConvChain(2, 4).init(KEY(), x)
    with pytest.raises(ValueError, match="depth"):
        jm.ConvChain(0, 3).init(KEY(), x)
    with pytest.raises(ValueError, match="block must be one of"):
        jm.ResNet("wide", (1,)).init(KEY(), x)
    with pytest.raises(ValueError, match="stem must be one of"):
        jm.ResNet(stem="tiny").init(KEY(), x)
    with pytest.raises(ValueError, match="width"):
        jm.resnet18(width=0).init(KEY(), x)
    with pytest.raises(ValueError, match="name must be one of"):
        jm.vgg("vgg17")
    with pytest.raises(ValueError, match="cfg entries"):
        jm.VGG((8, "X")).init(KEY(), x)
    with pytest.raises(ValueError, match="activation must be one of"):
        jm.MLP((4,), activation="swish").init(KEY(), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="divisible"):
        jm.GPTConfig(d_model=10, n_head=4)
    cfg = jm.GPTConfig(vocab=11, ctx=4, d_model=8, n_head=2, n_layer=1)
    with pytest.raises(ValueError, match="exceeds config.ctx"):
        jm.GPT(cfg).init(KEY(), jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match="integers"):
        jm.GPT(cfg).init(KEY(), jnp.zeros((1, 4)))
    vcfg = jm.ViTConfig(image_size=8, patch_size=4, d_model=8, n_head=2, n_layer=1)
    with pytest.raises(ValueError, match="8x8"):
        jm.ViT(vcfg).init(KEY(), jnp.ones((1, 12, 12, 3)))
    with pytest.raises(ValueError, match="image_size"):
        jm.ViTConfig(image_size=10, patch_size=4)
    # the torch twins reject the same things
    with pytest.raises(ValueError, match="channels"):
        tm.ConvChain(2, 4)(torch.ones(1, 3, 8, 8))
    with pytest.raises(ValueError, match="block must be one of"):
        tm.ResNet("wide")
    with pytest.raises(ValueError, match="activation must be one of"):
        tm.MLP(3, (4,), activation="swish")


# -------------------------------------------------------------------------------- NNX

def test_nnx_convchain_and_mlp_equal_linen_and_torch():
    x = _normal((2, 7, 7, 4))
    torch.manual_seed(1)
    t_chain = tm.ConvChain(3, 4)
    v = torch_to_jax(t_chain)
    chain = load_params(ConvChainNNX(3, 4, rngs=nnx.Rngs(5)), v["params"])
    lin = jm.ConvChain(3, 4)

    @nnx.jit
    def nnx_value_and_grad(m, a):
        return nnx.value_and_grad(lambda mm: jnp.sum(mm(a) ** 2))(m)

    y_nnx, g_nnx = nnx_value_and_grad(chain, x)
    y_lin, g_lin = jax.jit(jax.value_and_grad(  # same compile options as nnx.jit: bitwise
        lambda p: jnp.sum(lin.apply({"params": p}, x) ** 2)))(v["params"])
    np.testing.assert_array_equal(y_nnx, y_lin)
    jax.tree_util.tree_map(np.testing.assert_array_equal, nnx.to_pure_dict(g_nnx), g_lin)
    # back to torch through the Linen layout
    t2 = jax_to_torch({"params": params_of(chain)}, tm.ConvChain(3, 4))
    assert torch.equal(t2.conv_2.weight, t_chain.conv_2.weight)

    xm = _normal((5, 6))
    mlp = MLPNNX(6, (8, 3), activation="gelu", rngs=nnx.Rngs(0))
    lm = jm.MLP((8, 3), activation="gelu")
    np.testing.assert_array_equal(nnx.jit(lambda m, a: m(a))(mlp, xm),
                                  jax.jit(lm.apply)({"params": params_of(mlp)}, xm))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_params(MLPNNX(5, (8, 3), rngs=nnx.Rngs(0)), params_of(mlp))
    with pytest.raises(ValueError, match="activation"):
        MLPNNX(6, (3,), activation="swish", rngs=nnx.Rngs(0))


# ------------------------------------------------------------ inline activations

@pytest.mark.parametrize("name", ["convchain", "mlp", "vgg_bn", "resnet_basic", "gpt", "vit"])
def test_activations_are_looked_up_inline(name, monkeypatch):
    """Models call ``flax.linen.relu`` / ``flax.linen.gelu`` at call time (not a stored
    reference), so tools that intercept those functions see every activation."""
    import flax.linen as fnn
    from twin_parity_utils import TWINS

    twin = TWINS[name]
    calls = {"relu": 0, "gelu": []}
    real_relu, real_gelu = fnn.relu, fnn.gelu

    def relu(x):
        calls["relu"] += 1
        return real_relu(x)

    def gelu(x, approximate=True):
        calls["gelu"].append(approximate)
        return real_gelu(x, approximate=approximate)

    monkeypatch.setattr(fnn, "relu", relu)
    monkeypatch.setattr(fnn, "gelu", gelu)
    x = jnp.zeros(twin.input_shape, jnp.int32 if twin.kind == "tokens" else jnp.float32)
    v = jax.eval_shape(twin.jax_model.init, KEY(), x)
    calls["relu"], calls["gelu"] = 0, []
    kw = {"train": False} if twin.has_bn else {}
    jax.eval_shape(lambda vv: twin.jax_model.apply(vv, x, **kw), v)
    expected = {"convchain": (6, []), "mlp": (2, []), "vgg_bn": (5, []),
                "resnet_basic": (1 + 2 * 2, []), "gpt": (0, [True]),
                "vit": (0, [False])}[name]
    assert (calls["relu"], calls["gelu"]) == expected
