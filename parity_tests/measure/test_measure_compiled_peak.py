"""Level 2 (compiled bytes), slope, and level 3 (measured peak in a fresh subprocess)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.measure import TraceError, compiled_memory, peak_memory, slope
from jaxmem.measure.peak import PeakMemory

TARGETS = os.path.join(os.path.dirname(__file__), "peak_targets.py")
MiB = 2**20


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def test_compiled_memory_fields_consistent():
    x = rand(0, (128, 64))
    y = rand(1, (64, 32))
    m = compiled_memory(lambda x, y: jnp.tanh(x @ y), x, y)
    assert m.argument_bytes == x.nbytes + y.nbytes
    assert m.output_bytes == 128 * 32 * 4
    assert m.alias_bytes == 0
    assert m.temp_bytes >= 0 and m.generated_code_bytes >= 0
    assert m.total_bytes == m.temp_bytes + m.output_bytes + m.argument_bytes - m.alias_bytes
    d = m.to_dict()
    assert d["total_bytes"] == m.total_bytes and d["backend"] == jax.default_backend()


def test_compiled_memory_tuple_output_and_static():
    x = rand(0, (32, 32))
    m = compiled_memory(lambda x, n: (x * n, jnp.sum(x)), x, 3, static_argnums=1)
    assert m.argument_bytes == x.nbytes  # the static int is not an argument buffer
    # both outputs, plus XLA's tuple index table (one pointer per element; 16 B on CPU)
    assert x.nbytes + 4 <= m.output_bytes <= x.nbytes + 4 + 2 * 8


def test_compiled_memory_donation_shows_as_alias():
    x = rand(0, (256, 256))
    m = compiled_memory(lambda x: x * 2.0 + 1.0, x, donate_argnums=0)
    assert m.alias_bytes == x.nbytes
    assert m.total_bytes == m.temp_bytes + m.output_bytes


def test_compiled_memory_accepts_shape_dtype_struct():
    s = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    m = compiled_memory(lambda x: jnp.sin(x) @ x, s)
    assert m.argument_bytes == 64 * 64 * 4


def test_compiled_temp_slope_of_a_grad_step():
    """A linear chain's jitted gradient keeps one (N, D) activation per layer: the
    compiled-bytes slope is positive and grows linearly with the width (deterministic)."""
    def measure(depth, n=256, d=64):
        ws = [rand(i, (d, d)) * 0.1 for i in range(depth)]
        x = rand(100, (n, d))

        def loss(ws, x):
            for w in ws:
                x = jnp.sin(x @ w)
            return jnp.sum(x)

        return compiled_memory(jax.grad(loss), ws, x).temp_bytes

    s = slope(measure, 4)
    assert s >= 256 * 64 * 4  # at least one stored activation per layer
    assert slope(lambda d: measure(d, n=512), 4) >= 2 * 256 * 64 * 4


def test_slope_exact_and_errors():
    assert slope(lambda d: 7 + 100 * d, 3) == 100.0
    calls = []
    slope(lambda d: calls.append(d) or 0, 5)
    assert calls == [5, 10]
    with pytest.raises(ValueError, match="depth"):
        slope(lambda d: d, 0)
    with pytest.raises(TypeError, match="depth"):
        slope(lambda d: d, 2.0)
    with pytest.raises(TypeError, match="callable"):
        slope(3, 2)
    with pytest.raises(TypeError, match="number of bytes"):
        slope(lambda d: "many", 2)


def test_compiled_memory_errors():
    def exploding_step(x):
        return x @ jnp.ones((5, 5))

    with pytest.raises(TraceError, match="exploding_step"):
        compiled_memory(exploding_step, rand(0, (3, 4)))
    with pytest.raises(TypeError, match=r"args\[1\] is a str"):
        compiled_memory(lambda x, s: x, rand(0, (3,)), "a")
    with pytest.raises(TypeError, match="callable"):
        compiled_memory("f", rand(0, (3,)))


# ---------------------------------------------------------------- measured peak

def test_peak_memory_cpu_numpy_allocation():
    r = peak_memory(f"{TARGETS}:numpy_alloc", 64)
    assert isinstance(r, PeakMemory) and r.method == "cpu-vmhwm"
    assert 60 * MiB <= r.peak_bytes <= 70 * MiB
    assert r.high_water_bytes - r.baseline_bytes == r.peak_bytes


def test_peak_memory_cpu_jax_scales_with_size():
    a = peak_memory(f"{TARGETS}:jax_output", 32, backend="jax")
    b = peak_memory(f"{TARGETS}:jax_output", 96, backend="jax", repeats=2)
    assert 28 * MiB <= a.peak_bytes <= 40 * MiB
    assert 90 * MiB <= b.peak_bytes <= 104 * MiB


def test_peak_memory_cpu_torch():
    from torch_ref.measure import peak_memory as torch_peak

    r = torch_peak(f"{TARGETS}:torch_alloc", 48)
    assert r.backend == "torch" and 44 * MiB <= r.peak_bytes <= 54 * MiB


def test_peak_memory_errors():
    with pytest.raises(ValueError, match="target"):
        peak_memory("no_colon_here")
    with pytest.raises(ValueError, match="backend"):
        peak_memory(f"{TARGETS}:numpy_alloc", 1, backend="tf")
    with pytest.raises(ValueError, match="device"):
        peak_memory(f"{TARGETS}:numpy_alloc", 1, device="tpu")
    with pytest.raises(ValueError, match="repeats"):
        peak_memory(f"{TARGETS}:numpy_alloc", 1, repeats=0)
    with pytest.raises(TypeError, match="JSON"):
        peak_memory(f"{TARGETS}:numpy_alloc", np.ones(3))
    with pytest.raises(ValueError, match="module level"):
        peak_memory(lambda: (lambda: None))
    with pytest.raises(RuntimeError, match="boom in target"):
        peak_memory(f"{TARGETS}:raises")
    with pytest.raises(RuntimeError, match="zero-argument callable"):
        peak_memory(f"{TARGETS}:not_a_factory")


@pytest.mark.gpu
def test_peak_memory_gpu_jax():
    r = peak_memory(f"{TARGETS}:jax_output", 64, backend="jax", device="gpu")
    assert r.method == "jax-device-peak_bytes_in_use"
    assert 60 * MiB <= r.peak_bytes <= 80 * MiB


@pytest.mark.gpu
def test_peak_memory_gpu_torch():
    r = peak_memory(f"{TARGETS}:torch_alloc", 64, backend="torch", device="gpu",
                    kwargs={"device": "cuda"})
    assert r.method == "torch-cuda-max_memory_allocated"
    assert r.peak_bytes == 64 * MiB
