"""Twin models agree between JAX and torch: outputs, every parameter gradient, the input
gradient and (BatchNorm) the updated running statistics, in train and eval mode.

Weights are random (the torch twin's own initialisation, transferred with ``torch_to_jax``),
inputs and the output cotangent are fresh random draws. Two precisions:

* float64 (both frameworks): agreement to 1e-9 relative. Rounding is ~1e-16 here, so this is
  a tight check of the *math* (layouts, paddings, BatchNorm statistics, masks, tied weights).
* float32: rtol 1e-4 / atol 1e-5 elementwise, as the project asks, with the atol scaled by
  the array's largest magnitude (``atol * max(1, max|ref|)``): gradients of sums over many
  outputs reach magnitudes of 10-100 where an absolute 1e-5 is below float32 resolution.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from torch_ref.convert import torch_to_jax
from twin_parity_utils import TWINS, compare, draw_input, run_jax, run_torch

CASES = [(name, train) for name, t in TWINS.items() for train in ((True, False) if t.has_bn else (None,))]
IDS = [f"{n}-{'train' if t else 'eval'}" if t is not None else n for n, t in CASES]


def _randomise_bn_stats(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-trivial running statistics (fresh ones are 0/1, which would hide a mix-up)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)


def _run(name, train, dtype_t, seed):
    twin = TWINS[name]
    torch.manual_seed(seed)
    model = twin.make_torch().to(dtype_t)
    _randomise_bn_stats(model, torch.Generator().manual_seed(seed + 1))
    variables = torch_to_jax(model)            # before torch's forward updates the stats
    x = draw_input(twin, seed + 2)
    if twin.kind != "tokens":
        x = x.astype(np.float64 if dtype_t == torch.float64 else np.float32)
    th = run_torch(twin, model, x, None, bool(train), dtype_t) if False else None
    # output shape is needed for the cotangent: one forward in eval-free no-grad mode
    with torch.no_grad():
        model.train(bool(train))
        probe = run_jax(twin, variables, x, 1.0, bool(train), None)["y"]
    cot = np.random.default_rng(seed + 3).standard_normal(probe.shape).astype(probe.dtype)
    th = run_torch(twin, model, x, cot, bool(train), dtype_t)
    jx = run_jax(twin, variables, x, cot, bool(train), None)
    return jx, th


@pytest.mark.parametrize("name,train", CASES, ids=IDS)
def test_twin_parity_float64(name, train):
    with jax.enable_x64(True):
        jx, th = _run(name, train, torch.float64, seed=10)
        assert jx["y"].dtype == np.float64
    problems = compare(jx, th, rtol=1e-9, atol=1e-12)
    assert not problems, f"{name} (float64) differs:\n" + "\n".join(problems[:10])


def _scaled_compare(jx, th, rtol, atol):
    """compare() with the atol of each array scaled by max(1, max|ref|)."""
    from twin_parity_utils import flat

    problems = []
    for key in ("y", "xgrad"):
        if key in th:
            s = max(1.0, float(np.max(np.abs(th[key]))))
            problems += compare({key: jx[key]}, {key: th[key]}, rtol, atol * s)
    for coll in ("grads", "batch_stats"):
        if coll in th:
            fj, ft = flat(jx[coll]), flat(th[coll])
            assert set(fj) == set(ft), f"{coll} names differ: {sorted(set(fj) ^ set(ft))[:5]}"
            for k in ft:
                s = max(1.0, float(np.max(np.abs(ft[k]))))
                problems += [f"{coll}{k}: {p}" for p in
                             compare({"y": fj[k]}, {"y": ft[k]}, rtol, atol * s)]
    return problems


@pytest.mark.parametrize("name,train", CASES, ids=IDS)
def test_twin_parity_float32(name, train):
    jx, th = _run(name, train, torch.float32, seed=20)
    assert jx["y"].dtype == np.float32
    problems = _scaled_compare(jx, th, rtol=1e-4, atol=1e-5)
    assert not problems, f"{name} (float32) differs:\n" + "\n".join(problems[:10])
