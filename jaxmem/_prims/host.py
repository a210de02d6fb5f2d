"""Probes evaluated at top level: concrete float64 evaluation away from the caller's context.

The transformation reads what a traced region computes by evaluating it on probe points
(an activation's derivative, a normalisation checked in float64) while the user's function
is being traced, possibly under ``jax.set_mesh`` of a mesh whose devices cannot run anything
(compile-only GPUs: ``jaxmem.measure.target_mesh``), where creating an array fails. JAX's
trace and mesh contexts are per thread, so :func:`on_host` runs the probe in a worker thread:
eagerly, in float64, on JAX's default device, as a script's top level would.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = ["on_host"]

T = TypeVar("T")


def on_host(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` under ``enable_x64`` and ``ensure_compile_time_eval`` in a fresh thread
    (exceptions propagate unchanged). ``fn`` should return NumPy values."""
    def run():
        with jax.enable_x64(True), jax.ensure_compile_time_eval():
            return fn(*args)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()
