"""Helpers of the transform tests: fresh keys and a two-sided closeness check."""
from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np


def key():
    """A fresh PRNG key per call (inputs differ from run to run)."""
    return jax.random.PRNGKey(secrets.randbits(31))


_RNG = np.random.default_rng(secrets.randbits(64))


def normal(shape, dtype=jnp.float32, scale=1.0):
    """Fresh standard-normal values (NumPy: no XLA compile per call)."""
    return jnp.asarray((_RNG.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def close(got, want, rtol=1e-5, atol=1e-5):
    """Leaf-wise ``|got - want| <= atol * max|want| + rtol * |want|``."""
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, f"tree structures differ: {gt} vs {wt}"
    for g, w in zip(gl, wl):
        g = np.asarray(g, np.float64)
        w = np.asarray(w, np.float64)
        assert g.shape == w.shape and g.dtype == w.dtype or g.shape == w.shape
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale)
