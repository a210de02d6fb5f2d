"""Every use of JAX's private modules (``jax._src``) in one place.

jaxmem needs a few things JAX does not export: the jaxpr core types and the residual
analysis behind ``jax.ad_checkpoint.print_saved_residuals`` (measuring, scheduling, planning),
the user-frame lookup of ``source_info_util`` (reports), the config machinery that lets an
option take part in ``jit``'s cache key, the compilation cache, and the PJRT plugin loader
(compiling for a GPU target without a GPU). Importing them here, and only here, means a JAX
upgrade that moves one of them breaks one file with one clear error.
"""
from __future__ import annotations

import contextlib

from jax._src import compilation_cache, core, source_info_util, xla_bridge
from jax._src import config as jax_config
from jax._src import custom_partitioning as custom_partitioning_internal
from jax._src.ad_checkpoint import name_p, saved_residuals
from jax._src.lax import lax as lax_internal
from jax._src.lib import xla_client
from jax._src.random import prng

__all__ = [
    "compilation_cache",
    "core",
    "custom_partitioning_internal",
    "jax_config",
    "lax_internal",
    "name_p",
    "persistent_cache_off",
    "prng",
    "saved_residuals",
    "scan_counts",
    "source_info_util",
    "xla_bridge",
    "xla_client",
]


@contextlib.contextmanager
def persistent_cache_off():
    """Compilations inside neither read nor write JAX's persistent compilation cache (a
    loaded executable writes none of XLA's dump files, and the cache key ignores the dump
    options). JAX decides once per process whether the cache is used; that decision is
    overridden for the duration and restored after."""
    lock = getattr(compilation_cache, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(compilation_cache, "_cache_used"):
        yield
        return
    with lock:
        saved = compilation_cache._cache_checked, compilation_cache._cache_used
        compilation_cache._cache_checked, compilation_cache._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            compilation_cache._cache_checked, compilation_cache._cache_used = saved


def scan_counts(params) -> tuple[int, int]:
    """``(consts, carries)`` among a ``scan`` equation's operands: ``num_consts`` /
    ``num_carry`` before jax 0.11, the groups of its ``ft_in`` tree from jax 0.11 on (the
    equation's outputs are its carries, then its stacked outputs, in both)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)

