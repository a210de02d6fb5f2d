"""Shared test set-up: CPU always, GPU when one is present (skipped cleanly otherwise).

On a machine with a GPU, JAX's default device is the GPU, so the whole suite runs there.
Two settings make that a test of the same math:

* float32 matmuls/convs at full precision on both sides: ``jax_default_matmul_precision``
  ``"highest"`` and torch's TF32 switched off (the GPUs' default TF32 rounds inputs to 10
  mantissa bits; a train-mode BatchNorm net turns that into errors of order 1e-1);
* tests marked ``xla_cpu`` assert *XLA:CPU's* memory plan (compiled-bytes slopes that
  depend on CPU fusion decisions): they run on the CPU device wherever they are run.
  What XLA:GPU plans is measured by the benchmarks (``benchmarks/gpu``), not asserted.
"""
from __future__ import annotations

import contextlib

import jax
import pytest
from hypothesis import HealthCheck, settings

# Property-based suites: deterministic in CI, and no health-check failure just because a
# shared 2-core machine generates examples slowly (the tests assert behaviour, not speed).
settings.register_profile("jaxmem", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile("jaxmem")


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

if JAX_GPU:
    jax.config.update("jax_default_matmul_precision", "highest")
if TORCH_CUDA:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _xla_cpu_plan(request):
    """Tests marked ``xla_cpu`` compile for the CPU device even where a GPU is present."""
    if request.node.get_closest_marker("xla_cpu") is None:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


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


@pytest.fixture
def x64():
    """``ctx(dtype)``: a context enabling x64 for float64; the global flag is restored."""
    before = bool(jax.config.jax_enable_x64)

    def ctx(dtype):
        return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()

    yield ctx
    jax.config.update("jax_enable_x64", before)
    assert bool(jax.config.jax_enable_x64) == before
