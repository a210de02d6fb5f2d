"""Seeded test data drawn with NumPy: ``jax.random`` run op by op compiles a program per new
shape, a NumPy draw compiles nothing."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def normal_host(seed, shape, scale=1.0, shift=0.0) -> np.ndarray:
    """``normal * scale + shift`` as a float32 NumPy array (the same values on every run)."""
    x = np.random.default_rng(seed).normal(size=shape) * scale + shift
    return x.astype(np.float32)


def normal(seed, shape, scale=1.0, shift=0.0):
    """:func:`normal_host` as a JAX array."""
    return jnp.asarray(normal_host(seed, shape, scale, shift))
