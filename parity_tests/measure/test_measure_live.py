"""live_peak: the bytes live together at the peak of XLA's temp allocation (address union of
the values live at one instruction), on a crafted dump, on XLA:CPU and on the H100 plan."""
from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest

from jaxmem.measure import (
    LivePeak,
    TraceError,
    compiled_memory,
    gpu_plan_available,
    live_peak,
    live_peak_of_lowered,
    read_live_peak,
)
from jaxmem.measure.live import parse_live_peak

needs_plan = pytest.mark.skipif(not gpu_plan_available(),
                                reason="the CUDA PJRT plugin for GPU plans is not installed")

# allocation 0: a parameter (never counted); allocation 1: the temp heap.
# a [0, 100) live 0-5; d shares a's bytes (an in-place update) live 4-5; b [100, 150) live 3-8;
# c reuses a's bytes after a ends, live 6-9; e [150, 160) live 9-9.
# live(t): t=0..2: 100, t=3..5: 150 (a, d count once), t=6..8: 150, t=9: 110.
_BA = textwrap.dedent("""\
    BufferAssignment:
    allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
     value: <0 p0 @0> (size=64,offset=0): f32[16]{0}
    allocation 1: size 200, preallocated-temp:
     value: <1 a @0> (size=100,offset=0): f32[25]{0}
     value: <2 b @0> (size=50,offset=100): f32[5,2]{1,0}
     value: <3 c.1 @0> (size=100,offset=0): f32[25]{0}
     value: <4 d{0} @0> (size=100,offset=0): f32[25]{0}
     value: <5 e @0> (size=10,offset=150): s8[10]{0}
    """)
_LR = textwrap.dedent("""\
    HloLiveRange (max 9):
      InstructionSequence:
        0:p0
        3:b
        6:c.1
      BufferLiveRange:
        p0{}:0-9
        a{}:0-5
        b{}:3-8
        c.1{}:6-9
        d{0}:4-5
        e{}:9-9
      Live ranges at 0 (peak):
        a{}: 100 bytes (cumulative: 100 bytes)
        p0{}: 64 bytes (cumulative: 164 bytes)
    """)


def test_parse_counts_shared_bytes_once_and_skips_arguments():
    p = parse_live_peak(_BA, _LR)
    assert isinstance(p, LivePeak)
    assert p.temp_bytes == 200
    assert p.live_bytes == 150            # a + b, not a + b + d (d shares a's bytes)
    assert (p.instruction, p.instruction_name) == (3, "b")   # the first point reaching it
    assert [b.name for b in p.buffers] == ["a", "b"]
    assert p.packing_bytes == 50
    assert p.xla_listed_bytes == 100       # the dump's own list: temp values only
    assert "0.000 MiB" in p.top(1) and "a" in p.top(1)


def test_parse_mismatched_files_is_an_error():
    other = _LR.replace("a{}:0-5", "x{}:0-5").replace("b{}:3-8", "y{}:3-8") \
        .replace("c.1{}:6-9", "z{}:6-9").replace("d{0}:4-5", "w{0}:4-5") \
        .replace("e{}:9-9", "v{}:9-9")
    with pytest.raises(ValueError, match="same compile"):
        parse_live_peak(_BA, other)


def _mlp_grad(w1, w2, x):
    return jax.grad(lambda w1, w2, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2),
                    argnums=(0, 1))(w1, w2, x)


def _args(batch, key=0):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    return (jax.random.normal(k1, (128, 256)), jax.random.normal(k2, (256, 128)),
            jax.random.normal(k3, (batch, 128)))


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=needs_plan)])
def test_live_peak_within_the_temp_allocation_and_grows_with_the_batch(target):
    small = live_peak(_mlp_grad, *_args(512), target=target)
    big = live_peak(_mlp_grad, *_args(2048), target=target)
    for p in (small, big):
        assert 0 < p.live_bytes <= p.temp_bytes
        assert p.temp_bytes == compiled_memory(_mlp_grad, *_args(p is big and 2048 or 512),
                                               target=target).temp_bytes
        assert sum(b.bytes for b in p.buffers) >= p.live_bytes >= p.buffers[0].bytes
        assert p.instruction_name
    # the residuals (batch x 256 floats and their cotangents) scale with the batch; the
    # weight-shaped values do not
    assert 1.8 <= big.live_bytes / small.live_bytes <= 4.0
    # the largest live value is an activation-sized array: batch x 256 f32
    assert big.buffers[0].bytes >= 2048 * 128 * 4


def test_live_peak_names_the_jax_ops():
    p = live_peak(_mlp_grad, *_args(1024))
    assert any("dot_general" in b.op_name or "tanh" in b.op_name for b in p.buffers)


def test_live_peak_of_lowered_matches_live_peak():
    args = _args(512, key=1)
    a = live_peak(_mlp_grad, *args)
    b = live_peak_of_lowered(jax.jit(_mlp_grad).lower(*args))
    assert (a.live_bytes, a.temp_bytes) == (b.live_bytes, b.temp_bytes)


def test_live_peak_rejects_bad_input():
    with pytest.raises(TypeError):
        live_peak(3, jnp.ones(2))
    with pytest.raises(TraceError):
        live_peak(lambda x: x @ x, jnp.ones((2, 3)))


def test_read_live_peak_of_a_dump_folder(tmp_path):
    args = _args(256, key=2)
    jax.jit(_mlp_grad).lower(*args).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    p = read_live_peak(str(tmp_path), "jit__mlp_grad")
    assert (p.live_bytes, p.temp_bytes) == (live_peak(_mlp_grad, *args).live_bytes,
                                            compiled_memory(_mlp_grad, *args).temp_bytes)
    with pytest.raises(FileNotFoundError, match="no_such_module"):
        read_live_peak(str(tmp_path), "no_such_module")
