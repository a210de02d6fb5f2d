"""compiled_memory / compiled_hlo / buffer_assignment for GPU targets compiled without a GPU
(jaxmem.measure.target): every target, sharded devices, GEMM backends, argument errors, the
missing plugin, and that the user's JAX set-up is left as it was."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.measure import (
    GPU_TARGETS,
    TARGETS,
    CompiledMemory,
    buffer_assignment,
    compiled_hlo,
    compiled_memory,
    gpu_plan_available,
    target_mesh,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_plan = pytest.mark.skipif(
    not gpu_plan_available(),
    reason="the CUDA PJRT plugin for GPU plans is not installed (docs/measuring.md, "
           "'XLA:GPU's plan without a GPU')")

B, D, H = 128, 64, 32


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


GRAD = jax.grad(_loss)


def _args(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(D, H)) / np.sqrt(D), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
    return w, x


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = ROOT + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=240)


# ------------------------------------------------------------------- targets and devices
@needs_plan
@pytest.mark.parametrize("target", TARGETS)
def test_every_target_compiles_a_grad_step(target):
    w, x = _args(1)
    m = compiled_memory(GRAD, w, x, target=target)
    assert isinstance(m, CompiledMemory)
    assert m.target == target and m.devices == 1
    assert m.argument_bytes == w.nbytes + x.nbytes
    assert m.output_bytes == w.nbytes  # the gradient of w
    assert m.temp_bytes > 0
    assert m.total_bytes == m.temp_bytes + m.output_bytes + m.argument_bytes - m.alias_bytes
    if target == "cpu":
        assert (m.plan, m.gemm_backend, m.backend) == ("cpu", "", jax.default_backend())
    else:
        assert m.plan == f"{target} plan" and m.backend == "cuda"
        assert m.gemm_backend in ("triton", "cublas")
        assert f"on {target} plan" in str(m)
        d = m.to_dict()
        assert (d["target"], d["devices"], d["total_bytes"]) == (target, 1, m.total_bytes)


@needs_plan
def test_gpu_targets_are_their_gpus():
    """Each target's compile-only devices describe the GPU its name says."""
    kinds = {t: target_mesh(t, (1,), ("x",)).devices.flat[0].device_kind for t in GPU_TARGETS}
    assert "H100" in kinds["h100"] and "H100" in kinds["h100_pcie"]
    assert "PCIe" in kinds["h100_pcie"] and "PCIe" not in kinds["h100"]
    assert "H200" in kinds["h200"] and "A100" in kinds["a100"] and "B200" in kinds["b200"]


@needs_plan
def test_eight_devices_sharded_batch_all_reduce_and_per_device_bytes():
    w, x = _args(2)
    mesh = target_mesh("h100", (8,), ("data",))
    assert mesh.size == 8 and mesh.axis_names == ("data",)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data")))
    m8 = compiled_memory(GRAD, w, xs, target="h100", devices=8)
    assert m8.plan == "h100 plan x8" and m8.devices == 8
    # per device: one eighth of the batch, the whole (replicated) weight and its gradient
    assert m8.argument_bytes == x.nbytes // 8 + w.nbytes
    assert m8.output_bytes == w.nbytes
    # the data-parallel gradient is summed over the 8 devices
    hlo = compiled_hlo(GRAD, w, xs, target="h100", devices=8)
    assert re.search(r"all-reduce(-start)?\(", hlo), hlo[:2000]
    # the same step on one device keeps the whole batch and needs no collective
    m1 = compiled_memory(GRAD, w, x, target="h100")
    assert m1.argument_bytes == x.nbytes + w.nbytes
    assert "all-reduce" not in compiled_hlo(GRAD, w, x, target="h100")
    assert m8.temp_bytes < m1.temp_bytes


@needs_plan
def test_two_axis_target_mesh():
    w, x = _args(3)
    mesh = target_mesh("h100", (2, 4), ("data", "model"))
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data", None)))
    ws = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, "model")))
    m = compiled_memory(GRAD, ws, xs, target="h100", devices=8)
    assert m.argument_bytes == x.nbytes // 2 + w.nbytes // 4
    assert m.output_bytes == w.nbytes // 4


@needs_plan
def test_sharded_argument_on_another_mesh_is_refused():
    """An argument sharded on compile-only devices that are not the target's would be placed
    replicated (wrong per-device figures): refused, naming `devices`."""
    w, x = _args(4)
    mesh = target_mesh("h100", (8,), ("x",))
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match="`devices`=4"):
        compiled_memory(GRAD, w, xs, target="h100", devices=4)
    with pytest.raises(ValueError, match="`target`='a100'"):
        compiled_memory(GRAD, w, xs, target="a100", devices=8)


@needs_plan
def test_gemm_backend_recorded():
    w, x = _args(5)
    tri = compiled_memory(GRAD, w, x, target="h100", gemm="triton")
    cub = compiled_memory(GRAD, w, x, target="h100", gemm="cublas")
    auto = compiled_memory(GRAD, w, x, target="h100", gemm="auto")
    assert (tri.gemm_backend, cub.gemm_backend) == ("triton", "cublas")
    assert auto.gemm_backend in ("triton", "cublas")
    h_tri = compiled_hlo(GRAD, w, x, target="h100", gemm="triton")
    h_cub = compiled_hlo(GRAD, w, x, target="h100", gemm="cublas")
    assert "triton" in h_tri and "cublas" not in h_tri
    assert "cublas" in h_cub and "triton_gemm" not in h_cub
    # the arguments and outputs do not depend on how the dots are computed
    assert (tri.argument_bytes, tri.output_bytes) == (cub.argument_bytes, cub.output_bytes)


@needs_plan
def test_buffer_assignment_lists_allocations():
    w, x = _args(6)
    # the test run's persistent compilation cache (conftest) holds the program once
    # compiled_memory has compiled it: buffer_assignment still compiles it and lists it
    compiled_memory(GRAD, w, x)
    cpu = buffer_assignment(GRAD, w, x)
    assert re.search(r"^allocation \d+: size", cpu, flags=re.MULTILINE)
    text = buffer_assignment(GRAD, w, x, target="h100")
    allocs = re.findall(r"^allocation \d+: size (\d+)", text, flags=re.MULTILINE)
    assert allocs, text[:1000]
    sizes = [int(s) for s in allocs]
    assert x.nbytes in sizes and w.nbytes in sizes  # the two parameters
    assert re.search(r"parameter 0", text) and re.search(r"parameter 1", text)


def _gpu_plan_only_program(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 3)


@needs_plan
@pytest.mark.skipif(not jax.config.jax_compilation_cache_dir,
                    reason="needs the test run's persistent compilation cache")
def test_gpu_plan_compiles_skip_the_persistent_cache():
    """A compile-only GPU executable cannot be loaded back: it is not written to the cache
    (a CPU compile of the same program is)."""
    w, x = _args(8)
    d = jax.config.jax_compilation_cache_dir

    def entries():
        return [f for f in os.listdir(d) if "gpu_plan_only_program" in f]

    before = entries()
    compiled_memory(_gpu_plan_only_program, w, x, target="h100")
    assert entries() == before
    compiled_memory(_gpu_plan_only_program, w, x)
    assert len(entries()) == len(before) + 1


def _memo_program(w, x):
    return jnp.sum(jnp.sin(x @ w) ** 2)


@needs_plan
def test_gpu_compile_of_the_same_program_is_reused(monkeypatch):
    """A program compiled for a GPU target again (same text, target and GEMM choice) is not
    compiled again; another shape, target or GEMM choice is, and a dump is always made."""
    from jaxmem.measure import target as tgt

    calls = []
    real = tgt._compile_for_gpu
    monkeypatch.setattr(tgt, "_compile_for_gpu",
                        lambda lowered, gemm, options: calls.append(gemm) or
                        real(lowered, gemm, options))
    w, x = _args(9)
    first = compiled_memory(_memo_program, w, x, target="h100")
    again = compiled_memory(_memo_program, w, x, target="h100")
    assert len(calls) == 1 and again.total_bytes == first.total_bytes
    assert compiled_hlo(_memo_program, w, x, target="h100") \
        and len(calls) == 1                                    # same program: reused
    compiled_memory(_memo_program, w, x, target="h100", gemm="cublas")
    compiled_memory(_memo_program, w, x, target="a100")
    compiled_memory(_memo_program, w[:, :5], x, target="h100")
    assert len(calls) == 4
    assert buffer_assignment(_memo_program, w, x, target="h100") and len(calls) == 5


@needs_plan
def test_default_backend_and_devices_unchanged_after_gpu_compile():
    before = (jax.default_backend(), list(jax.devices()))
    w, x = _args(7)
    compiled_memory(GRAD, w, x, target="h100")
    target_mesh("h200", (2,), ("x",))
    assert (jax.default_backend(), list(jax.devices())) == before
    assert all(d.platform == before[0] for d in jax.devices())
    # and ordinary jit still runs on the default device with the right value
    out = jax.jit(GRAD)(w, x)
    assert out.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(np.asarray(out), np.asarray(GRAD(w, x)), rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [compiled_memory, compiled_hlo, buffer_assignment])
@pytest.mark.parametrize("kwargs,name", [
    ({"target": "h300"}, "`target`"),
    ({"target": 100}, "`target`"),
    ({"target": "h100", "devices": 0}, "`devices`"),
    ({"target": "h100", "devices": 9}, "`devices`"),
    ({"target": "h100", "devices": 2.0}, "`devices`"),
    ({"target": "h100", "devices": True}, "`devices`"),
    ({"target": "h100", "gemm": "cudnn"}, "`gemm`"),
    ({"target": "cpu", "devices": 2}, "`devices`"),
])
def test_bad_arguments_raise_value_error_naming_them(fn, kwargs, name):
    w, x = _args(8)
    with pytest.raises(ValueError, match=re.escape(name)) as info:
        fn(GRAD, w, x, **kwargs)
    assert fn.__name__ in str(info.value)


def test_bad_target_message_lists_allowed_values():
    w, x = _args(9)
    with pytest.raises(ValueError) as info:
        compiled_memory(GRAD, w, x, target="H1OO")
    for t in TARGETS:
        assert repr(t) in str(info.value)


@pytest.mark.parametrize("kwargs,name", [
    ({"target": "cpu"}, "`target`"),
    ({"target": "tpu"}, "`target`"),
    ({"target": "h100", "mesh_shape": (3, 3)}, "`mesh_shape`"),
    ({"target": "h100", "mesh_shape": (2, 0)}, "`mesh_shape`"),
    ({"target": "h100", "mesh_shape": (2, 2), "axis_names": ("x",)}, "`mesh_shape`"),
])
def test_target_mesh_errors(kwargs, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        target_mesh(**kwargs)


def test_missing_plugin_names_how_to_install(tmp_path):
    """No plugin anywhere (a loaded plugin cannot be unloaded: a fresh process)."""
    if jax.default_backend() == "gpu":
        pytest.skip("JAX's own CUDA backend is loaded here: GPU targets compile with its plugin")
    empty = tmp_path / "empty"
    empty.mkdir()
    wrong = tmp_path / "wrong"
    lib = wrong / "jax_plugins" / "xla_cuda12"
    lib.mkdir(parents=True)
    (lib / "xla_cuda_plugin.so").write_bytes(b"")
    (wrong / "jax_cuda12_pjrt-0.0.1.dist-info").mkdir()
    r = _run("""
        import os
        import jax, jax.numpy as jnp
        import jaxmem.measure.target as T
        from jaxmem.measure import GpuPlanUnavailable, compiled_memory, gpu_plan_available

        only = os.environ["JAXMEM_GPU_PLAN_DIR"]
        real = T._candidate_dirs
        assert next(real()) == only  # the environment variable is looked at first
        T._candidate_dirs = lambda: (d for d in real() if d == only)

        def attempt(where):
            os.environ["JAXMEM_GPU_PLAN_DIR"] = where
            T._cuda_c_api.cache_clear()
            assert not gpu_plan_available()
            x = jnp.asarray([1.0, 2.0, 3.0])
            try:
                compiled_memory(lambda x: jnp.sum(x * x), x, target="h100")
            except GpuPlanUnavailable as e:
                print("MESSAGE", " ".join(str(e).split()))
            else:
                print("NO ERROR")
            # the CPU target does not need the plugin
            print("CPU", compiled_memory(lambda x: jnp.sum(x * x), x).argument_bytes)

        attempt(only)
        only = os.environ["WRONG_DIR"]
        attempt(only)
        print("BACKEND", jax.default_backend())
    """, env={"JAXMEM_GPU_PLAN_DIR": str(empty), "WRONG_DIR": str(wrong)})
    assert r.returncode == 0, r.stderr[-3000:]
    msgs = re.findall(r"^MESSAGE (.*)$", r.stdout, flags=re.MULTILINE)
    assert len(msgs) == 2 and "NO ERROR" not in r.stdout, r.stdout
    for m in msgs:
        assert m.startswith("compiled_memory: "), m
        assert "pip install" in m and "jax-cuda12-plugin" in m and "jax-cuda12-pjrt" in m, m
        assert "gpu-plan" in m and "JAXMEM_GPU_PLAN_DIR" in m, m
    assert "not installed" in msgs[0]
    assert "version 0.0.1" in msgs[1] and "found only" in msgs[1]
    assert r.stdout.count("CPU 12") == 2 and f"BACKEND {jax.default_backend()}" in r.stdout


def test_import_is_silent_and_does_not_load_the_plugin():
    r = _run("""
        import jaxmem
        import jaxmem.measure
        from jaxmem.measure import compiled_memory, target_mesh  # noqa: F401
        from jaxmem._compat import xla_client
        import jax
        print("LOADED", xla_client.pjrt_plugin_loaded("cuda"))
        print("BACKEND", jax.default_backend())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "", r.stderr
    assert f"BACKEND {jax.default_backend()}" in r.stdout, r.stdout
    if jax.default_backend() == "cpu":  # (with a CUDA backend JAX loads the plugin itself)
        assert "LOADED False" in r.stdout, r.stdout


@needs_plan
def test_custom_partitioning_op_compiles_sharded_on_a_gpu_target():
    """A ``custom_partitioning`` op (jaxmem's tie) in a step sharded over 8 compile-only GPUs:
    the plugin loaded by jaxmem gets JAX's partitioning callbacks, so it compiles."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxmem._prims.ties import tie
    from jaxmem.measure import compiled_memory, target_mesh

    mesh = target_mesh("h100", (8,), ("x",))
    spec = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x")))

    def loss(x):
        return jnp.sum(tie(jnp.sin(x), x) ** 2)

    cm = compiled_memory(jax.grad(loss), spec, target="h100", devices=8)
    assert cm.argument_bytes == 64 * 32 * 4 // 8
