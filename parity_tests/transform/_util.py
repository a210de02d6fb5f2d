"""Helpers of the transform tests: fresh keys, a small MLP loss, a closeness check."""
from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
from _assert import assert_tree_close, scaled_atol


def key():
    """A fresh PRNG key per call (inputs differ from run to run)."""
    return jax.random.PRNGKey(secrets.randbits(31))


_RNG = np.random.default_rng(secrets.randbits(64))


def normal(shape, dtype=jnp.float32, scale=1.0, rng=None):
    """Fresh standard-normal values (NumPy: no XLA compile per call); ``rng`` (a NumPy
    generator) for the same values on every run."""
    rng = _RNG if rng is None else rng
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def both(use, g, f, *args):
    """``use(g, *args), use(f, *args)`` as one compiled program (value comparisons only:
    compiled bytes are measured per program, where fusion is the one users get)."""
    return jax.jit(lambda *a: (use(g, *a), use(f, *a)))(*args)


def values_and_grads(fns, *args):
    """``[jax.value_and_grad(fn)(*args) for fn in fns]`` as one compiled program."""
    return jax.jit(lambda *a: [jax.value_and_grad(fn)(*a) for fn in fns])(*args)


def close(got, want, rtol=1e-5, atol=1e-5):
    """Same tree structure, and leaf-wise ``|got - want| <= atol * max(1, max|want|) +
    rtol * |want|``."""
    gt, wt = jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want)
    assert gt == wt, f"tree structures differ: {gt} vs {wt}"
    assert_tree_close(got, want, rtol=rtol, atol=scaled_atol(atol, floor=1.0))


def mlp_loss(params, x, *, scale=1.0):
    """A two-layer loss mixing GELU, a ReLU spelled ``maximum`` and SiLU (the programs the
    interpreter tests re-emit)."""
    h = x
    for w, b in params["layers"]:
        h = jax.nn.gelu(h @ w + b)
        h = jnp.maximum(h, 0.0) + 0.1 * jax.nn.silu(h)
    return scale * jnp.mean(jnp.tanh(h) ** 2)


def mlp_params(dtype=jnp.float32):
    """Fresh parameters of :func:`mlp_loss` (8 -> 16 -> 8)."""
    return {"layers": [(normal((8, 16), dtype, 0.4), normal((16,), dtype, 0.1)),
                       (normal((16, 8), dtype, 0.4), normal((8,), dtype, 0.1))]}
