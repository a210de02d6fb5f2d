"""Targets for peak_memory tests (loaded by file path in a fresh subprocess; not collected)."""
from __future__ import annotations


def numpy_alloc(n_mib: int):
    import numpy as np

    n = n_mib * 2**20 // 8

    def step():
        a = np.ones(n)  # exactly n_mib MiB, touched
        return float(a[-1])

    return step


def jax_output(n_mib: int):
    import jax
    import jax.numpy as jnp

    n = n_mib * 2**20 // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    x.block_until_ready()
    f = jax.jit(lambda x: jnp.exp(x))  # one fresh f32 output buffer of n_mib MiB

    def step():
        return f(x)

    return step


def torch_alloc(n_mib: int, device: str = "cpu"):
    import torch

    n = n_mib * 2**20 // 4

    def step():
        return torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)

    return step


def not_a_factory():
    return 3


def raises():
    raise RuntimeError("boom in target")
