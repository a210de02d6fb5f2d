"""Compile for a named GPU target on any machine: XLA:GPU's memory plan without a GPU.

XLA:GPU plans memory differently from XLA:CPU (other fusions, cuDNN convolutions, its own
scheduler), so a saving measured on the CPU says little about what a GPU user gets. The
PJRT CUDA plugin can compile for a GPU described by a ``GpuTargetConfigProto`` on a machine
with no GPU, driver or CUDA libraries: it makes *compile-only* devices, and
``jax.jit(f).trace(*specs).lower().compile()`` on arguments placed on them gives XLA:GPU's
``memory_analysis()`` and optimized HLO. Nothing ever runs on them.

How jaxmem does it, without touching the user's JAX set-up:

* the plugin's shared library is loaded directly (``load_pjrt_plugin_dynamically``); no JAX
  backend is registered, the default backend and ``JAX_PLATFORMS`` stay as they are, and
  nothing happens at ``import jaxmem`` — only when a GPU target is first asked for;
* the library is looked for in ``$JAXMEM_GPU_PLAN_DIR``, then ``<sys.prefix>/gpu-plan`` (where
  the README's set-up puts it, outside JAX's plugin discovery so that JAX never tries to start
  a CUDA backend on a machine without one), then an installed ``jax-cuda12-plugin`` (a GPU
  user's ``jax[cuda12]``, or the ``jaxmem[gpu-plan]`` extra);
* its version must equal jaxlib's (the PJRT C API is not stable across versions).

Limits of the plan (write them beside every figure): no autotuning without a device, so
matmuls get XLA's default Triton tiles and cuBLAS/cuDNN workspaces are not counted (read
``temp_bytes`` as a lower bound); no timing; the plan belongs to this XLA version.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import glob
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any

import jax
import numpy as np

from jaxmem._compat import persistent_cache_off

__all__ = [
    "GPU_TARGETS",
    "TARGETS",
    "GpuPlanUnavailable",
    "check_target",
    "gpu_plan_available",
    "target_mesh",
]

#: GPU target name -> shipped ``GpuTargetConfigProto`` text file (``gpu_targets/``).
GPU_TARGETS: dict[str, str] = {
    "h100": "h100_sxm.txtpb",
    "h100_pcie": "h100_pcie.txtpb",
    "h200": "h200.txtpb",
    "a100": "a100_sxm_80.txtpb",
    "b200": "b200.txtpb",
}
#: Every target name :func:`jaxmem.measure.compiled_memory` accepts.
TARGETS: tuple[str, ...] = ("cpu", *GPU_TARGETS)
MAX_DEVICES = 8
GEMM_BACKENDS = ("auto", "triton", "cublas")

_ENV_DIR = "JAXMEM_GPU_PLAN_DIR"
_LIB = os.path.join("jax_plugins", "xla_cuda12", "xla_cuda_plugin.so")
# XLA:GPU without autotuning sometimes finds no Triton tiling for a dot; cuBLAS always works.
_TRITON_TILING_ERROR = "Couldn't find output tile sizes"


class GpuPlanUnavailable(RuntimeError):
    """A GPU target was asked for but the PJRT CUDA plugin is missing or of the wrong version."""


def check_target(target: Any, devices: Any = 1, who: str = "compiled_memory") -> str:
    """Validate ``target`` / ``devices`` and return the target name in lower case."""
    if not isinstance(target, str) or target.lower() not in TARGETS:
        raise ValueError(f"{who}: `target` must be one of {', '.join(map(repr, TARGETS))}, "
                         f"got {target!r}")
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) \
            or not 1 <= int(devices) <= MAX_DEVICES:
        raise ValueError(f"{who}: `devices` must be an int in 1..{MAX_DEVICES}, got {devices!r}")
    target = target.lower()
    if target == "cpu" and int(devices) != 1:
        raise ValueError(f"{who}: `devices`={devices} needs a GPU target; the 'cpu' target "
                         "compiles for this process's CPU device only")
    return target


def _candidate_dirs() -> Iterator[str]:
    env = os.environ.get(_ENV_DIR)
    if env:
        yield env
    yield os.path.join(sys.prefix, "gpu-plan")
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "jax_plugins", "xla_cuda12")):
            yield entry


def _plugin_version(root: str) -> str | None:
    found = glob.glob(os.path.join(root, "jax_cuda12_pjrt-*.dist-info"))
    if not found:
        return None
    return os.path.basename(found[0])[len("jax_cuda12_pjrt-"):-len(".dist-info")]


def _find_plugin() -> str:
    """Path of the CUDA PJRT plugin library; :class:`GpuPlanUnavailable` when none fits."""
    import jaxlib

    wrong = []
    for root in _candidate_dirs():
        lib = os.path.join(root, _LIB)
        if not os.path.isfile(lib):
            continue
        version = _plugin_version(root)
        if version is not None and version != jaxlib.__version__:
            wrong.append(f"{lib} (version {version})")
            continue
        return lib
    hint = (f"install the plugin of jaxlib's version, outside JAX's plugin discovery:\n"
            f"  pip install --no-deps --target {os.path.join(sys.prefix, 'gpu-plan')} "
            f"jax-cuda12-plugin=={jaxlib.__version__} jax-cuda12-pjrt=={jaxlib.__version__}\n"
            f"(or `pip install 'jaxmem[gpu-plan]'`, or set ${_ENV_DIR} to the folder that "
            f"holds jax_plugins/)")
    if wrong:
        raise GpuPlanUnavailable(f"GPU targets need the CUDA PJRT plugin of jaxlib "
                                 f"{jaxlib.__version__}; found only {', '.join(wrong)}. {hint}")
    raise GpuPlanUnavailable(f"GPU targets need the CUDA PJRT plugin (the 'gpu-plan' extra), "
                             f"which is not installed; {hint}")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence C-level stderr (the plugin logs that no CUDA driver exists: that is expected)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@functools.lru_cache(maxsize=1)
def _cuda_c_api() -> Any:
    from jaxmem._compat import xla_bridge, xla_client

    if xla_client.pjrt_plugin_loaded("cuda"):  # JAX registered the plugin itself
        factory = xla_bridge._backend_factories.get("cuda")
        if factory is not None and factory.c_api is not None:
            return factory.c_api
    lib = _find_plugin()
    with _quiet_stderr():
        c_api = xla_client.load_pjrt_plugin_dynamically("cuda", lib)
    _register_custom_partitioning(c_api)
    return c_api


def _register_custom_partitioning(c_api: Any) -> None:
    """Give the directly loaded plugin JAX's ``custom_partitioning`` callbacks (JAX registers
    them only with plugins it discovers itself): without them a sharded step that holds a
    ``custom_partitioning`` op (jaxmem's ties) fails to compile for a multi-GPU target."""
    from jaxmem._compat import custom_partitioning_internal as cp
    from jaxmem._compat import xla_client

    xla_client.register_custom_call_partitioner(
        name=cp._CUSTOM_PARTITIONING_CALL_NAME,
        prop_user_sharding=cp._custom_partitioning_propagate_user_sharding,
        partition=cp._custom_partitioning_partition,
        infer_sharding_from_operands=cp._custom_partitioning_infer_sharding_from_operands,
        can_side_effecting_have_replicated_sharding=True, c_api=c_api)


def gpu_plan_available() -> bool:
    """Whether GPU targets can be compiled here (the plugin is found and loads)."""
    try:
        _cuda_c_api()
    except (GpuPlanUnavailable, OSError, RuntimeError):
        return False
    return True


def _target_config(target: str) -> str:
    return resources.files("jaxmem.measure").joinpath("gpu_targets", GPU_TARGETS[target]) \
        .read_text()


@functools.cache
def _compile_only_devices(target: str, devices: int) -> tuple[Any, ...]:
    from jaxmem._compat import xla_client

    c_api = _cuda_c_api()
    with _quiet_stderr():
        topo = xla_client.make_c_api_device_topology(
            c_api, f"jaxmem-{target}", target_config=_target_config(target),
            topology=f"1x1x{devices}")
        return tuple(topo._make_compile_only_devices())


def target_mesh(target: str = "h100", mesh_shape: Sequence[int] | None = None,
                axis_names: Sequence[str] = ("x",)) -> jax.sharding.Mesh:
    """A :class:`jax.sharding.Mesh` of compile-only devices of ``target``.

    Place abstract arguments on it (``jax.ShapeDtypeStruct(shape, dtype,
    sharding=NamedSharding(mesh, spec))``) to measure a sharded step per device with
    ``compiled_memory(..., target=target, devices=mesh.size)``.
    """
    shape = tuple(mesh_shape) if mesh_shape is not None else (1,) * len(axis_names)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape) \
            or not 1 <= int(np.prod(shape)) <= MAX_DEVICES:
        raise ValueError(f"target_mesh: `mesh_shape` must be ints >= 1 with a product in "
                         f"1..{MAX_DEVICES} (the target's devices), got {mesh_shape!r}")
    n = int(np.prod(shape))
    target = check_target(target, n, "target_mesh")
    if target == "cpu":
        raise ValueError("target_mesh: `target` must be a GPU target, got 'cpu'")
    if len(shape) != len(tuple(axis_names)):
        raise ValueError(f"target_mesh: `mesh_shape` {shape} and `axis_names` "
                         f"{tuple(axis_names)} differ in length")
    devs = np.array(_compile_only_devices(target, n), dtype=object).reshape(shape)
    return jax.sharding.Mesh(devs, tuple(axis_names))


def _on_mesh(x: Any, mesh: jax.sharding.Mesh) -> Any:
    """An abstract value of ``x`` placed on ``mesh`` (kept if already placed there)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.ShapeDtypeStruct) and isinstance(sharding, jax.sharding.NamedSharding) \
            and set(sharding.mesh.devices.flat) <= set(mesh.devices.flat):
        return x
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if isinstance(x, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, sharding=replicated,
                                    weak_type=True)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated,
                                weak_type=bool(getattr(x, "weak_type", False)))


def check_placement(args: Sequence[Any], static: Sequence[int], target: str, devices: int,
                    who: str) -> None:
    """Refuse an abstract argument sharded over several devices that are not the target's.

    Such an argument would otherwise be placed replicated, so the per-device figures would
    silently describe another layout: a ``ShapeDtypeStruct`` sharded on
    ``target_mesh(other_target, ...)`` or on a mesh whose size is not ``devices``.
    """
    if target == "cpu":
        return
    mesh_devices = set(_compile_only_devices(target, devices))
    for i, a in enumerate(args):
        if i in static:
            continue
        for x in jax.tree_util.tree_leaves(a):
            sharding = getattr(x, "sharding", None)
            if not isinstance(x, jax.ShapeDtypeStruct) \
                    or not isinstance(sharding, jax.sharding.NamedSharding):
                continue
            devs = set(sharding.mesh.devices.flat)
            if len(devs) > 1 and not devs <= mesh_devices:
                kind = next(iter(devs)).device_kind
                raise ValueError(
                    f"{who}: argument {i} is sharded over {len(devs)} devices ({kind}) that "
                    f"are not the {devices} compile-only device(s) of `target`={target!r}, "
                    f"`devices`={devices}; build its mesh with target_mesh({target!r}, ...) "
                    f"and pass devices=mesh.size")


def lower_for_target(fn: Callable[..., Any], args: Sequence[Any], static: Sequence[int],
                     donate: Sequence[int], target: str, devices: int) -> Any:
    """``jax.jit(fn)`` traced and lowered for ``target`` (``"cpu"``: this process's CPU)."""
    jitted = jax.jit(fn, static_argnums=tuple(static), donate_argnums=tuple(donate))
    if target == "cpu":
        return jitted.lower(*args)
    mesh = target_mesh(target, (devices,), ("x",))
    placed = [a if i in static else jax.tree_util.tree_map(lambda x: _on_mesh(x, mesh), a)
              for i, a in enumerate(args)]
    return jitted.trace(*placed).lower()


def compile_lowered(lowered: Any, target: str, gemm: str,
                    options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Compile ``lowered``; returns ``(compiled, gemm_backend)``.

    ``gemm``: ``"triton"`` (XLA:GPU's default), ``"cublas"`` (Triton GEMMs off: dots go to
    cuBLAS), ``"auto"`` (Triton, and cuBLAS where XLA finds no Triton tiling without
    autotuning). On CPU the GEMM backend is ``""``.
    """
    options = dict(options or {})
    if target == "cpu":
        return lowered.compile(compiler_options=options or None), ""
    key = _gpu_compile_key(lowered, target, gemm) if not options else None
    if key is not None and key in _GPU_COMPILED:
        _GPU_COMPILED.move_to_end(key)
        return _GPU_COMPILED[key]
    # a compile-only GPU executable cannot be loaded back from JAX's persistent compilation
    # cache: writing it there (serialising it) and failing to read it back cost seconds
    with persistent_cache_off():
        out = _compile_for_gpu(lowered, gemm, options)
    if key is not None:
        _GPU_COMPILED[key] = out
        while len(_GPU_COMPILED) > _GPU_COMPILED_MAX:
            _GPU_COMPILED.popitem(last=False)
    return out


#: The last compile-only GPU executables, by :func:`_gpu_compile_key`. JAX's persistent
#: cache cannot hold them (above), and the same program is often compiled for a target more
#: than once in a process (a planner's chosen step and its check, one default step measured
#: beside several variants); an XLA:GPU compile takes seconds even for a small step.
_GPU_COMPILED: collections.OrderedDict[tuple, tuple[Any, str]] = collections.OrderedDict()
_GPU_COMPILED_MAX = 32


#: JAX configuration options that reach XLA's compile options (where this JAX has them).
_COMPILE_CONFIG = ("jax_compiler_enable_remat_pass", "jax_exec_time_optimization_effort",
                   "jax_memory_fitting_effort")


def _gpu_compile_key(lowered: Any, target: str, gemm: str) -> tuple:
    """What a compile-only GPU compile depends on besides the process's ``XLA_FLAGS``: the
    target, the GEMM choice, the program as lowered (its text holds the shardings, donation
    and device count) and the JAX options that reach XLA's compile options."""
    text = lowered.as_text()
    # getattr: which of these options exist depends on the JAX version (jax 0.11 has no
    # `jax_exec_time_optimization_effort`); an absent one cannot reach the compile
    options = tuple(getattr(jax.config, name, None) for name in _COMPILE_CONFIG)
    return (target, gemm, hashlib.sha256(text.encode()).hexdigest(), len(text), *options)


def _compile_for_gpu(lowered: Any, gemm: str, options: dict[str, Any]) -> tuple[Any, str]:
    if gemm == "cublas":
        return lowered.compile({**options, "xla_gpu_enable_triton_gemm": False}), "cublas"
    try:
        return lowered.compile(compiler_options=options or None), "triton"
    except Exception as e:
        if gemm == "triton" or _TRITON_TILING_ERROR not in str(e):
            raise
    return lowered.compile({**options, "xla_gpu_enable_triton_gemm": False}), "cublas"


def buffer_assignment_text(lowered: Any, target: str, gemm: str) -> str:
    """XLA's buffer assignment (``--xla_dump_to``) of ``lowered`` compiled for ``target``."""
    # a persistent-cache hit would load an executable and dump nothing
    with tempfile.TemporaryDirectory(prefix="jaxmem-dump-") as d, persistent_cache_off():
        compile_lowered(lowered, target, gemm, {"xla_dump_to": d})
        found = sorted(glob.glob(os.path.join(d, "*buffer-assignment.txt")))
        if not found:
            raise RuntimeError(f"XLA wrote no buffer assignment for target {target!r}")
        with open(found[-1]) as fh:
            return fh.read()
