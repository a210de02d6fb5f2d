"""Shared test set-up: CPU always, GPU when one is present (skipped cleanly otherwise).

On a machine with a GPU, JAX's default device is the GPU, so the whole suite runs there.
Two settings make that a test of the same math:

* float32 matmuls/convs at full precision on both sides: ``jax_default_matmul_precision``
  ``"highest"`` and torch's TF32 switched off (the GPUs' default TF32 rounds inputs to 10
  mantissa bits; a train-mode BatchNorm net turns that into errors of order 1e-1);
* tests marked ``xla_cpu`` assert what *XLA:CPU* compiles (compiled-bytes slopes that
  depend on CPU fusion decisions; where a NaN cotangent reaches): they run on the CPU device
  wherever they are run.
  What XLA:GPU plans is measured by the benchmarks (``benchmarks/gpu``), not asserted.

Collection stays cheap: torch is imported here only on a machine with a GPU device node
(where its CUDA support is asked for), JAX's backends are started only there too, and
hypothesis is imported only before collecting a test module that names it (its profile is
registered then, before the module's decorators read it). Tree comparisons live in
``_assert.py``.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import sys

#: Cheaper LLVM code generation for the suite's many small compiles (CPU and the GPU plan),
#: set before JAX starts a backend and inherited by the subprocesses tests start; on the GPU
#: plan also ``ptxas -O0`` (PTX to machine code, after buffer assignment: about 1/8 of an H100
#: plan's compile). HLO passes and buffer assignment (every byte figure the tests assert) are
#: unchanged; the machine code is less optimised (the suite's runs are tiny) and may round
#: differently in the last bits (e.g. no fused multiply-adds), within the suite's tolerances.
FAST_CODEGEN = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_gpu_disable_gpuasm_optimizations=true")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CODEGEN}".strip()

#: One persistent XLA compilation cache for the whole run, shared by every process of it (the
#: xdist workers, the subprocesses tests start: the docs examples, the multi-device suite):
#: a program compiled a second time -- the same HLO, options and devices, e.g. a jitted
#: reference that a test also measures with ``compiled_memory``, the same eager op in two
#: processes -- is loaded instead of compiled. A loaded executable is the compiled one (its
#: memory analysis and HLO text included). GPU-plan compiles and ``buffer_assignment`` bypass
#: the cache (``jaxmem.measure``: a compile-only GPU executable cannot be loaded back, and a
#: loaded executable dumps nothing).
#: The compile options are unchanged: JAX's extra XLA caches that come with a persistent
#: cache (GPU autotuning results) stay off. The folder is made by the first process that
#: imports this file (the one xdist starts workers from) and removed when it exits;
#: ``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as it is, and
#: ``JAXMEM_TEST_COMPILATION_CACHE=0`` turns the cache off.
if (os.environ.get("JAXMEM_TEST_COMPILATION_CACHE", "1") != "0"
        and not os.environ.get("JAX_COMPILATION_CACHE_DIR")):
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="jaxmem-tests-xla-cache-")
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": _cache_dir,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                       "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"})
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

import jax
import pytest


# ------------------------------------------------------------------ hypothesis profile
@functools.cache
def _load_hypothesis_profile() -> None:
    from hypothesis import HealthCheck, settings

    # Property-based suites: deterministic in CI, and no health-check failure just because a
    # shared 2-core machine generates examples slowly (the tests assert behaviour, not speed).
    settings.register_profile("jaxmem", deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.function_scoped_fixture])
    settings.load_profile("jaxmem")


def pytest_pycollect_makemodule(module_path, parent):
    # before a module that uses hypothesis is imported (its ``@settings`` / ``@given``
    # decorators read the profile at import), and only then
    if "hypothesis" in sys.modules or "hypothesis" in module_path.read_text(errors="ignore"):
        _load_hypothesis_profile()


# ------------------------------------------------------------------ devices
def _gpu_device_node() -> bool:
    """A GPU driver's device node exists (NVIDIA, ROCm, WSL): without one neither JAX nor
    torch can see a GPU, so neither needs to be asked (torch's import alone is seconds)."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
                or os.path.exists("/dev/dxg"))


@functools.cache
def jax_has_gpu() -> bool:
    if not _gpu_device_node():
        return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.cache
def torch_has_cuda() -> bool:
    if not _gpu_device_node() or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_configure(config):
    if jax_has_gpu():
        jax.config.update("jax_default_matmul_precision", "highest")
    if torch_has_cuda():
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
        if "gpu" in item.keywords and not (jax_has_gpu() or torch_has_cuda()):
            item.add_marker(skip_gpu)


def pytest_generate_tests(metafunc):
    # device parameters are decided here, so a module without such tests asks nothing
    if "jax_device" in metafunc.fixturenames:
        metafunc.parametrize("jax_device", ["cpu"] + (["gpu"] if jax_has_gpu() else []),
                             indirect=True)
    if "torch_device" in metafunc.fixturenames:
        metafunc.parametrize("torch_device",
                             ["cpu"] + (["cuda"] if torch_has_cuda() else []),
                             indirect=True)


@pytest.fixture
def jax_device(request):
    """Run a test on the CPU and, where one exists, on the GPU."""
    return jax.devices(request.param)[0]


@pytest.fixture
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
