"""Inline activation / pooling functions of the selective part (Flax glue, not the core).

Models call activations inline (``nn.relu(x)``, ``jax.nn.relu(x)``, ``nnx.relu(x)``) and
pooling as a function (``nn.max_pool``, ``nnx.max_pool``). This module registers, on the one
patch mechanism of :mod:`jaxmem._glue.patch`, what the selective part does with them inside
a scope:

* ``relu``, ``relu6``, ``hard_tanh``, ``leaky_relu`` (``jax.nn``, ``flax.linen``,
  ``flax.nnx``): the 1-bit packed mask versions (exact);
* ``max_pool`` (``flax.linen``, ``flax.nnx``): the packed-argmax version (exact);
* ``avg_pool``: nothing to convert -- its backward is linear and keeps no residual -- so it
  is reported as 'nothing-to-save' and runs Flax's own code.

Only attribute look-ups made while tracing inside a scope are affected; a name imported into
another module's namespace before (``from jax.nn import relu``) is not.
Deprecated: ``patch_functions`` (the selective-only functions scope); use
:func:`jaxmem.scope` (``fewbit=None, attention=False``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxmem import _deprecation
from jaxmem._glue import options as _options
from jaxmem._glue import patch as _gpatch
from jaxmem.selective import activation as _act
from jaxmem.selective import pool as _pool

__all__ = ["ACTIVATION_MODULES", "patched_names"]

#: modules whose activation attributes are dispatched
ACTIVATION_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                      "flax.nnx.nn.activations")
_POOL_MODULES = ("flax.linen", "flax.linen.pooling", "flax.nnx")
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


def _floats_only(fn, orig):
    def f(x, *args, **kwargs):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return orig(x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    return f


_ACTS = {"relu": _act.relu, "relu6": _act.relu6, "hard_tanh": _act.hard_tanh,
         "leaky_relu": _leaky_adapter}


def _register():
    for name, fn in _ACTS.items():
        _gpatch.register(
            name, "selective", [f"{m}.{name}" for m in ACTIVATION_MODULES],
            lambda opts, orig, fn=fn: _floats_only(fn, orig))
    _gpatch.register("max_pool", "selective", [f"{m}.max_pool" for m in _POOL_MODULES],
                     lambda opts, orig: _max_pool_adapter(orig))
    _gpatch.register("avg_pool", "selective", [f"{m}.avg_pool" for m in _POOL_MODULES],
                     lambda opts, orig: (None, "nothing-to-save",
                                         "linear: the backward keeps no residual"))


_register()


def patched_names() -> list[str]:
    """``'module.name'`` of every attribute the selective part dispatches."""
    names = set(_ACTS) | {"max_pool", "avg_pool"}
    return [t for t in _gpatch.dispatcher_targets() if t.rsplit(".", 1)[1] in names]


@contextlib.contextmanager
def _patch_functions() -> Iterator[None]:
    """Deprecated: use ``jaxmem.scope(fewbit=None, attention=False)``.

    Convert inline ``relu``/``relu6``/``hard_tanh``/``leaky_relu`` (flax.linen, jax.nn,
    flax.nnx) and ``max_pool`` to the selective versions inside the block: the functions
    half of ``jaxmem.scope(selective=True, fewbit=None, attention=False)``."""
    opts = _options.Options(selective=True, fewbit=None, attention=False,
                            only=frozenset({"selective:functions", *_ACTS, "max_pool",
                                            "avg_pool"}))
    with _gpatch.scope_options(opts, label="jaxmem.selective.nnx.scope", linen=False):
        yield


__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.patch", {
    "patch_functions": ("jaxmem.selective.patch:_patch_functions",
                        "jaxmem.scope(fewbit=None, attention=False)")})
