"""Twin models agree between JAX and torch: outputs, every parameter gradient, the input
gradient and (BatchNorm) the updated running statistics, in train and eval mode.

Weights are random (the torch twin's own initialisation, BatchNorm affine parameters and
running statistics randomised too, transferred with ``torch_to_jax``); inputs and the output
cotangent are fresh random draws; the loss is ``sum(model(x) * cotangent)``.

* float64 in both frameworks: rounding is ~1e-16, so this is the tight check of the *math*
  (layouts, paddings, BatchNorm statistics and running-variance rule, masks, tied weights).
  Bound: relative error norm ``|a - b| / |b| <= 1e-8`` per array and elementwise
  ``|a - b| <= 1e-6 |b| + 1e-9 max|b|``. Measured errors are 1e-15..1e-10; the upper end is
  train-mode BatchNorm over 3-4 values per channel in the deepest stages, which amplifies
  rounding ~1e5x. A real mismatch (wrong padding, transposed kernel, biased variance) shows
  up at 1e-3..1.
* float32: elementwise ``|a - b| <= 1e-4 |b| + 1e-5 max(1, max|b|)`` (the project's rtol 1e-4 /
  atol 1e-5, the atol scaled by the array's magnitude: gradients of a sum over many outputs
  reach 10-100, where an absolute 1e-5 is below float32 resolution), and the relative error
  norm <= 1e-4. In train mode with BatchNorm the atol is 1e-4 (see the test for why).

Both precisions run every twin, BatchNorm twins in train mode and ``resnet_bottleneck_cifar``
in eval mode too (``train`` switches only TorchBatchNorm, the same module in every model).
The published full-depth constructors run once each: ``resnet50`` in float64 train mode
(everything above), ``resnet18`` and ``vgg16(batch_norm=True)`` forward in float32 train mode;
reduced-depth models of the same classes cover every mode and precision (test-time budget).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from twin_parity_utils import (
    FULL_DEPTH,
    TWINS,
    draw_input,
    fjit,
    flat,
    output_shape,
    run_jax,
    run_torch,
)

from torch_ref.convert import torch_to_jax

# Every model; BatchNorm models in train mode (which exercises the batch statistics, the
# running-statistics update and every parameter) and eval mode of one: ``train`` only switches
# TorchBatchNorm (no dropout in any twin), whose eval path is the same module in every model.
CASES = [(n, tr) for n, t in TWINS.items()
         for tr in ((True, False) if n == "resnet_bottleneck_cifar" else (True,) if t.has_bn
                    else (None,))]
IDS = [f"{n}-{'train' if t else 'eval'}" if t is not None else n for n, t in CASES]


def _randomise_bn(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-trivial BatchNorm parameters and running statistics (fresh ones are 1/0/0/1)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)


def _run(twin, train, dtype_t, seed, torch_device="cpu", jax_device=None):
    torch.manual_seed(seed)
    model = twin.make_torch().to(dtype_t)
    _randomise_bn(model, torch.Generator().manual_seed(seed + 1))
    variables = torch_to_jax(model)            # before torch's forward updates the stats
    x = draw_input(twin, seed + 2)
    if twin.kind != "tokens":
        x = x.astype(np.float64 if dtype_t == torch.float64 else np.float32)
    shape, dtype = output_shape(twin, variables, x, bool(train))
    cot = np.random.default_rng(seed + 3).standard_normal(shape).astype(dtype)
    th = run_torch(twin, model, x, cot, bool(train), dtype_t, torch_device)
    jx = run_jax(twin, variables, x, cot, bool(train), None, jax_device)
    return jx, th


def _arrays(jx, th):
    """(name, jax array, torch array) for the output, input grad, every param grad, stats."""
    out = [(k, jx[k], th[k]) for k in ("y", "xgrad") if k in th]
    for coll in ("grads", "batch_stats"):
        if coll in th:
            fj, ft = flat(jx[coll]), flat(th[coll])
            assert set(fj) == set(ft), f"{coll} names differ: {sorted(set(fj) ^ set(ft))[:5]}"
            assert len(ft) > 0
            out += [(coll + k, fj[k], ft[k]) for k in ft]
    return out


def _problems(jx, th, rtol, atol_scale, norm_tol):
    arrays = [(n, np.asarray(a, np.float64), np.asarray(b, np.float64))
              for n, a, b in _arrays(jx, th)]
    grad_scale = max(float(np.max(np.abs(b))) for n, _, b in arrays if n.startswith("grads"))
    problems = []
    for name, a, b in arrays:
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} vs {b.shape}")
            continue
        if name.startswith("grads") and np.max(np.abs(b)) <= norm_tol * grad_scale:
            # An exactly-zero gradient (e.g. a conv bias followed by train-mode BatchNorm):
            # both sides are rounding noise; require the JAX side to be as small.
            if np.max(np.abs(a)) > norm_tol * grad_scale:
                problems.append(f"{name}: torch gradient ~0, JAX max |g| = {np.max(np.abs(a)):.2e}")
            continue
        scale = max(1.0, float(np.max(np.abs(b)))) if atol_scale[1] else float(np.max(np.abs(b)))
        tol = atol_scale[0] * scale + rtol * np.abs(b)
        bad = np.abs(a - b) > tol
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)
        if bad.any() or rel > norm_tol:
            problems.append(f"{name}: {int(bad.sum())} elements off, rel. error norm {rel:.2e}")
    return problems


def _check64(twin, train):
    with jax.enable_x64(True):
        jx, th = _run(twin, train, torch.float64, seed=10)
        assert jx["y"].dtype == np.float64
    problems = _problems(jx, th, rtol=1e-6, atol_scale=(1e-9, False), norm_tol=1e-8)
    assert not problems, f"{twin.name} (float64) differs:\n" + "\n".join(problems[:10])


@pytest.mark.parametrize("name,train", CASES, ids=IDS)
def test_twin_parity_float64(name, train):
    _check64(TWINS[name], train)


def test_full_depth_resnet50_parity_float64_train():
    _check64(FULL_DEPTH["resnet50"], True)


@pytest.mark.parametrize("name", ["resnet18", "vgg16_bn"])
def test_full_depth_forward_parity_float32_train(name):
    """Output and updated running statistics of the full-depth constructors (train mode)."""
    twin = FULL_DEPTH[name]
    torch.manual_seed(30)
    model = twin.make_torch()
    _randomise_bn(model, torch.Generator().manual_seed(31))
    variables = torch_to_jax(model)
    x = draw_input(twin, 32).astype(np.float32)
    model.train(True)
    with torch.no_grad():
        yt = model(torch.as_tensor(np.transpose(x, (0, 3, 1, 2)).copy())).numpy()
    stats_t = flat(torch_to_jax(model)["batch_stats"])
    y, upd = fjit(lambda v, xx: twin.jax_model.apply(v, xx, train=True,
                                                         mutable=["batch_stats"]))(variables, x)
    np.testing.assert_allclose(np.asarray(y), yt, rtol=1e-4, atol=1e-5 * max(1, np.abs(yt).max()))
    stats_j = flat(upd["batch_stats"])
    assert set(stats_j) == set(stats_t)
    for k in stats_t:
        np.testing.assert_allclose(stats_j[k], stats_t[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("name,train", CASES, ids=IDS)
def test_twin_parity_float32(name, train):
    jx, th = _run(TWINS[name], train, torch.float32, seed=20)
    assert jx["y"].dtype == np.float32
    # Train-mode BatchNorm: its parameter gradients are sums over N*H*W of terms that cancel
    # (the backward subtracts the means of g and g*xhat), so a single small element can carry
    # ~1e-4 of the array's scale in float32 rounding; the float64 test above is the tight one.
    atol = 1e-4 if train else 1e-5
    problems = _problems(jx, th, rtol=1e-4, atol_scale=(atol, True), norm_tol=1e-4)
    assert not problems, f"{name} (float32) differs:\n" + "\n".join(problems[:10])


GPU_CASES = [("convchain", None), ("mlp_gelu", None), ("resnet_bottleneck_cifar", True),
             ("vgg_bn", False), ("gpt", None), ("vit", None)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,train", GPU_CASES, ids=[n for n, _ in GPU_CASES])
def test_twin_parity_float32_gpu(name, train):
    """The float32 check on the GPU (both frameworks), with TF32 off in both: at default
    precision both use TF32 matmuls/convs (10-bit mantissa) and would not meet 1e-4."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU device")
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with jax.default_matmul_precision("highest"):
            jx, th = _run(TWINS[name], train, torch.float32, seed=40, torch_device="cuda",
                          jax_device=dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    atol = 1e-4 if train else 1e-5
    problems = _problems(jx, th, rtol=1e-4, atol_scale=(atol, True), norm_tol=1e-4)
    assert not problems, f"{name} (float32, GPU) differs:\n" + "\n".join(problems[:10])
