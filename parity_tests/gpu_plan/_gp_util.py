"""Shared helpers of ``parity_tests/gpu_plan``: every figure is XLA:GPU's plan for an H100."""
from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.measure import compiled_memory, slope

TARGET = "h100"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_RESULTS = os.path.join(ROOT, "benchmarks", "results", "gpu")


@contextlib.contextmanager
def ties_patched(**attrs):
    """``jaxmem._prims.ties`` with ``attrs`` set (e.g. ``_arith=ties._arith_cpu``) for the
    block. The tie ops are traced once per operand types and replayed, so JAX's caches are
    cleared on entry and exit: no trace from before the patch is replayed inside it, and none
    from inside it after."""
    import pytest

    from jaxmem._prims import ties
    with pytest.MonkeyPatch.context() as mp:
        for name, value in attrs.items():
            mp.setattr(ties, name, value)
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()


def plan(fn, *args, **kw):
    """``compiled_memory`` on the H100 plan."""
    return compiled_memory(fn, *args, target=TARGET, **kw)


def rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def mlp_per_elem(act, b=128, h=512, depth=2):
    """Total compiled bytes per hidden element per added layer of a frozen-weight MLP
    ``x -> act(x @ w)`` (gradient w.r.t. the input; weights closed over), slope between
    ``depth`` and ``2 * depth`` layers: the protocol of ``benchmarks/gpu/fewbit_packing.py``
    that produced the real-H100 rows of ``benchmarks/results/gpu``."""
    ws = [rand(i, (h, h), 1 / np.sqrt(h)) for i in range(2 * depth)]
    x = rand(99, (b, h))

    def measure(d):
        def loss(x):
            for w in ws[:d]:
                x = act(x @ w)
            return jnp.sum(x)
        return plan(jax.grad(loss), x).total_bytes

    return slope(measure, depth) / (b * h)
