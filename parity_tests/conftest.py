"""Shared test set-up: CPU always, GPU when one is present (skipped cleanly otherwise)."""
from __future__ import annotations

import jax
import pytest


def _jax_has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


JAX_GPU = _jax_has_gpu()
TORCH_CUDA = _torch_has_cuda()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords and not (JAX_GPU or TORCH_CUDA):
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu"] + (["gpu"] if JAX_GPU else []))
def jax_device(request):
    """Run a test on the CPU and, where one exists, on the GPU."""
    return jax.devices(request.param)[0]


@pytest.fixture(params=["cpu"] + (["cuda"] if TORCH_CUDA else []))
def torch_device(request):
    return request.param
