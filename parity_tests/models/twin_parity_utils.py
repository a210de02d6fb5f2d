"""Helpers for the twin-model parity tests: run a loss, its output, all parameter gradients,
the input gradient and the updated BatchNorm statistics in both frameworks."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxmem.models as jm
import torch_ref.models as tm
from torch_ref.convert import grads_to_jax, torch_to_jax


@dataclasses.dataclass
class Twin:
    """A JAX model, a factory for its torch twin, and how to draw an input for it."""

    name: str
    jax_model: Any
    make_torch: Callable[[], torch.nn.Module]
    input_shape: tuple            # JAX layout (NHWC for images)
    kind: str = "image"           # 'image' | 'vector' | 'tokens'
    vocab: int = 0
    has_bn: bool = False


def twins() -> list[Twin]:
    """Reduced-depth twins (compile time): one transformer block each, and a basic-block
    ResNet of two stages (an identity-shortcut block and a downsampling one)."""
    gcfg = jm.GPTConfig(vocab=61, ctx=16, d_model=32, n_head=4, n_layer=1)
    vcfg = jm.ViTConfig(image_size=16, patch_size=4, d_model=32, n_head=2, n_layer=1,
                        num_classes=7)
    return [
        Twin("convchain", jm.ConvChain(depth=6, channels=4),
             lambda: tm.ConvChain(depth=6, channels=4), (2, 10, 10, 4)),
        Twin("convchain_linear", jm.ConvChain(depth=5, channels=3, relu=False),
             lambda: tm.ConvChain(depth=5, channels=3, relu=False), (2, 9, 7, 3)),
        Twin("mlp", jm.MLP((24, 16, 5)), lambda: tm.MLP(11, (24, 16, 5)), (6, 11), "vector"),
        Twin("mlp_gelu", jm.MLP((20, 4), activation="gelu"),
             lambda: tm.MLP(9, (20, 4), activation="gelu"), (5, 9), "vector"),
        Twin("vgg11", jm.vgg11(width=0.125, num_classes=6),
             lambda: tm.vgg11(width=0.125, num_classes=6), (2, 32, 32, 3)),
        Twin("vgg_bn", jm.VGG((8, "M", 12, 12, "M", 16), batch_norm=True, num_classes=6,
                              hidden=(20,)),
             lambda: tm.VGG((8, "M", 12, 12, "M", 16), batch_norm=True, num_classes=6,
                            hidden=(20,)), (3, 16, 16, 3), has_bn=True),
        Twin("resnet_basic", jm.ResNet("basic", (1, 1), width=0.125, num_classes=5),
             lambda: tm.ResNet("basic", (1, 1), width=0.125, num_classes=5),
             (3, 32, 32, 3), has_bn=True),
        Twin("resnet_bottleneck_cifar",
             jm.ResNet("bottleneck", (1, 2, 1), width=0.0625, num_classes=5, stem="cifar"),
             lambda: tm.ResNet("bottleneck", (1, 2, 1), width=0.0625, num_classes=5,
                               stem="cifar"), (4, 12, 12, 3), has_bn=True),
        Twin("gpt", jm.GPT(gcfg), lambda: tm.GPT(gcfg), (2, 13), "tokens", vocab=61),
        Twin("vit", jm.ViT(vcfg), lambda: tm.ViT(vcfg), (2, 16, 16, 3)),
    ]


def full_depth_twins() -> list[Twin]:
    """The published constructors at full depth (reduced width): checked once, in float64."""
    return [
        Twin("vgg16_bn", jm.vgg16(width=0.0625, batch_norm=True, num_classes=6),
             lambda: tm.vgg16(width=0.0625, batch_norm=True, num_classes=6), (3, 32, 32, 3),
             has_bn=True),
        Twin("resnet18", jm.resnet18(width=0.125, num_classes=5),
             lambda: tm.resnet18(width=0.125, num_classes=5), (3, 32, 32, 3), has_bn=True),
        Twin("resnet50", jm.resnet50(width=0.0625, num_classes=5),
             lambda: tm.resnet50(width=0.0625, num_classes=5), (4, 32, 32, 3), has_bn=True),
    ]


TWINS = {t.name: t for t in twins()}
FULL_DEPTH = {t.name: t for t in full_depth_twins()}


def draw_input(twin: Twin, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if twin.kind == "tokens":
        return rng.integers(0, twin.vocab, twin.input_shape)
    return rng.standard_normal(twin.input_shape)


def nhwc_to_nchw(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(a, (0, 3, 1, 2)))


def nchw_to_nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(a, (0, 2, 3, 1)))


def run_torch(twin: Twin, model: torch.nn.Module, x: np.ndarray, cot: np.ndarray, train: bool,
              dtype, device: str = "cpu") -> dict:
    """Loss ``sum(model(x) * cot)``; returns output, param grads (JAX layout), input grad (JAX
    layout) and, with BatchNorm, the running statistics after the call (JAX layout)."""
    model.to(device).train(train)
    if twin.kind == "tokens":
        xt = torch.as_tensor(x, device=device)
    else:
        xt = torch.as_tensor(nhwc_to_nchw(x) if twin.kind == "image" else x, dtype=dtype,
                             device=device)
        xt.requires_grad_(True)
    y = model(xt)
    y_np = y.detach().cpu().numpy()
    y_jl = nchw_to_nhwc(y_np) if (twin.kind == "image" and y.dim() == 4) else y_np
    cot_t = torch.as_tensor(nhwc_to_nchw(cot) if (twin.kind == "image" and y.dim() == 4) else cot,
                            dtype=dtype, device=device)
    (y * cot_t).sum().backward()
    out = {"y": y_jl, "grads": grads_to_jax(model)}
    if twin.kind != "tokens":
        g = xt.grad.cpu().numpy()
        out["xgrad"] = nchw_to_nhwc(g) if twin.kind == "image" else g
    if twin.has_bn:
        out["batch_stats"] = torch_to_jax(model)["batch_stats"]
    return out


# XLA's CPU backend optimisation level 0 roughly halves compile time, which dominates these
# tests; the HLO (the math) is unchanged. JAXMEM_TWIN_EAGER=1 runs op by op instead.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def fjit(f, **kw):
    """``jax.jit`` with the fast-compile option (tests: compile time dominates run time)."""
    return jax.jit(f, compiler_options=_FAST_COMPILE, **kw)


def _maybe_jit(f, device=None):
    if os.environ.get("JAXMEM_TWIN_EAGER") == "1":
        return f
    return fjit(f) if device is None or device.platform == "cpu" else jax.jit(f)


def run_jax(twin: Twin, variables: dict, x: np.ndarray, cot: np.ndarray, train: bool,
            dtype, device=None) -> dict:
    """The same quantities as :func:`run_torch`, from the JAX twin with ``jax.grad``
    (on ``device``, a ``jax.Device``, when given)."""
    if device is not None:
        variables = jax.device_put(variables, device)
        x = jax.device_put(x, device)
        cot = jax.device_put(cot, device)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    kw = {"train": train} if twin.has_bn else {}

    def loss(p, xx):
        y, upd = twin.jax_model.apply({"params": p, **rest}, xx, mutable=["batch_stats"], **kw)
        return jnp.sum(y * cot), (y, upd)

    if twin.kind == "tokens":
        (_, (y, upd)), gp = _maybe_jit(jax.value_and_grad(loss, has_aux=True), device)(
            params, jnp.asarray(x))
        gx = None
    else:
        xx = jnp.asarray(x, dtype=dtype)
        (_, (y, upd)), (gp, gx) = _maybe_jit(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), device)(params, xx)
    out = {"y": np.asarray(y), "grads": gp}
    if gx is not None:
        out["xgrad"] = np.asarray(gx)
    if twin.has_bn:
        out["batch_stats"] = upd["batch_stats"]
    return out


def output_shape(twin: Twin, variables: dict, x: np.ndarray, train: bool):
    """Shape and dtype of the JAX twin's output (abstract evaluation, no compute)."""
    kw = {"train": train} if twin.has_bn else {}
    out = jax.eval_shape(lambda v, xx: twin.jax_model.apply(v, xx, mutable=["batch_stats"], **kw)[0],
                         variables, jnp.asarray(x))
    return out.shape, out.dtype


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def compare(jx: dict, th: dict, rtol: float, atol: float) -> list[str]:
    """Every mismatch (name, max error) beyond ``|a - b| <= atol + rtol |b|``; also fails on a
    differing set of gradient names."""
    problems = []

    def check(name, a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} vs {b.shape}")
            return
        if not np.all(np.abs(a - b) <= atol + rtol * np.abs(b)):
            err = np.max(np.abs(a - b) / (atol + rtol * np.abs(b)))
            problems.append(f"{name}: max |diff|/(atol+rtol|ref|) = {err:.3g}")

    for key in ("y", "xgrad"):
        if key in th:
            check(key, jx[key], th[key])
    for coll in ("grads", "batch_stats"):
        if coll in th:
            fj, ft = flat(jx[coll]), flat(th[coll])
            if set(fj) != set(ft):
                problems.append(f"{coll}: names differ: {sorted(set(fj) ^ set(ft))[:5]}")
                continue
            for k in ft:
                check(f"{coll}{k}", fj[k], ft[k])
    return problems
