"""Scoped patching of inline activation / pooling functions (Flax glue, not the core).

Models call activations inline (``nn.relu(x)``, ``jax.nn.relu(x)``, ``nnx.relu(x)``) and
pooling as a function (``nn.max_pool``). :func:`patch_functions` rebinds those module
attributes to the selective versions for the duration of a ``with`` block and restores the
originals on exit (re-entrant, lock-protected). Only attribute look-ups made while tracing
inside the block are affected; a name imported into another module's namespace before
(``from jax.nn import relu``) is not.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem.selective import activation as _act
from jaxmem.selective import pool as _pool

__all__ = ["patch_functions", "patched_names"]

_lock = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []
_orig_leaky = jax.nn.leaky_relu


def _leaky_adapter(x, negative_slope=1e-2):
    if not isinstance(negative_slope, (int, float)):
        return _orig_leaky(x, negative_slope)
    return _act.leaky_relu(x, negative_slope)


def _max_pool_adapter(orig):
    def max_pool(inputs, window_shape, strides=None, padding="VALID"):
        if jnp.ndim(inputs) != len(window_shape) + 2 or not jnp.issubdtype(
                jnp.result_type(inputs), jnp.floating):
            return orig(inputs, window_shape, strides=strides, padding=padding)
        return _pool.max_pool(inputs, window_shape, strides, padding)
    return max_pool


def _table():
    import flax.linen as nn
    import flax.linen.activation as fla
    import flax.linen.pooling as flp
    import jax.nn as jnn

    mods = [nn, fla, jnn]
    try:
        from flax import nnx
        mods.append(nnx)
    except ImportError:  # pragma: no cover
        pass
    table = []
    for mod in mods:
        for name, fn in (("relu", _act.relu), ("relu6", _act.relu6),
                         ("hard_tanh", _act.hard_tanh), ("leaky_relu", _leaky_adapter)):
            if hasattr(mod, name):
                table.append((mod, name, fn))
    orig_pool = flp.max_pool
    for mod in (nn, flp):
        table.append((mod, "max_pool", _max_pool_adapter(orig_pool)))
    return table


def patched_names() -> list[str]:
    """``'module.name'`` of every attribute :func:`patch_functions` rebinds."""
    return [f"{m.__name__}.{n}" for m, n, _ in _table()]


@contextlib.contextmanager
def patch_functions():
    """Rebind inline ``relu``/``relu6``/``hard_tanh``/``leaky_relu`` (flax.linen, jax.nn,
    flax.nnx) and ``max_pool`` (flax.linen) to the selective versions inside the block."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved.clear()
            for mod, name, fn in _table():
                _saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fn)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for mod, name, old in reversed(_saved):
                    setattr(mod, name, old)
                _saved.clear()
