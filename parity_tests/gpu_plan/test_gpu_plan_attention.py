"""Exact attention on the H100 plan: per added layer, what ``jaxmem.selective.attention`` keeps
grows linearly in the sequence length T (q, k, v and row statistics, no T x S array).

What it relies on: ``jaxmem._prims.ties.tie``, the dependency of the backward's recomputation
on the cotangent. The arithmetic form of the tie (``x - isnan(d[0]) * 0``, what XLA:CPU keeps)
is folded away by XLA:GPU, which then reuses the forward's softmax instead of recomputing it:
one float32 (B, H, T, S) array per layer. The tie is therefore an ``optimization_barrier`` on
GPU; the tests below assert the dependency survives in XLA:GPU's program and show that the
arithmetic form does not."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from _gp_util import TARGET, plan, rand

from jaxmem import selective
from jaxmem._prims.ties import tie
from jaxmem.measure import compiled_hlo, slope

B, H, D = 1, 2, 16
TS = (64, 128)


def _plain(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.float32(D))
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _per_layer(attn, t):
    """Bytes per added self-attention layer ``x + attn(x, 0.5 x, x)`` at length ``t``."""
    x = rand(t, (B, t, H, D))

    def measure(depth):
        def loss(x):
            for _ in range(depth):
                x = x + attn(x, 0.5 * x, x)
            return jnp.sum(x * x)
        return plan(jax.grad(loss), x).total_bytes

    return slope(measure, 1)


@pytest.fixture(scope="module")
def per_layer():
    return {(name, t): _per_layer(fn, t) for name, fn in
            (("jaxmem", selective.attention), ("plain", _plain)) for t in TS}


def _tts(t):
    return B * H * t * t * 4  # one float32 (B, H, T, S) array


def test_selective_attention_keeps_a_score_array_fewer_than_plain(per_layer):
    for t in TS:
        assert per_layer[("plain", t)] - per_layer[("jaxmem", t)] >= 0.95 * _tts(t), per_layer


def test_plain_attention_keeps_t_by_s_per_layer(per_layer):
    """Control: plain attention's per-layer bytes grow faster than linearly in T."""
    ratio = per_layer[("plain", TS[1])] / per_layer[("plain", TS[0])]
    assert ratio >= 2.5, per_layer
    assert per_layer[("plain", TS[1])] >= _tts(TS[1]), per_layer


def test_selective_attention_per_layer_bytes_linear_in_t(per_layer):
    t0, t1 = TS
    assert per_layer[("jaxmem", t1)] <= 2.2 * per_layer[("jaxmem", t0)], per_layer
    assert per_layer[("jaxmem", t1)] < _tts(t1), per_layer


def _reads_both(tie_fn):
    """Whether XLA:GPU's program of ``tie_fn(x, sin(d))`` has an instruction that reads both
    ``x`` and the dependency (the tie survived optimisation)."""
    x, d = rand(0, (64,)), rand(1, (8,))

    def f(x, d):
        e = jnp.sin(d)
        return tie_fn(x, e) * 3.0, e

    hlo = compiled_hlo(f, x, d, target=TARGET)
    entry = hlo[hlo.index("ENTRY"):]
    xname = re.search(r"%(\S+) = f32\[64\]\{0\} parameter\(0\)", entry).group(1)
    dep = re.search(r"%(\S+) = f32\[8\]\{0\} fusion\(", entry).group(1)
    return any(f"%{xname}" in ln and f"%{dep}" in ln and " parameter(" not in ln
               for ln in entry.splitlines())


def test_tie_dependency_survives_in_the_compiled_program():
    """``tie(x, d)`` leaves an instruction that reads both ``x`` and ``d`` in XLA:GPU's program."""
    assert _reads_both(tie)


def test_arithmetic_tie_is_folded_by_xla_gpu():
    """Control: the CPU form of the tie loses its dependency on XLA:GPU (why the GPU form is a
    barrier)."""
    from jaxmem._prims.ties import _arith_cpu
    assert not _reads_both(_arith_cpu)
