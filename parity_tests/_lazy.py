"""Module-level test data built on first use rather than at import.

Collecting the suite imports every test module; arrays built at import would start JAX's
backends and run its kernels for modules whose tests never run. ``once(make)`` returns a
function that calls ``make()`` the first time (at JAX's default 32-bit setting, as an import
would, and never as a tracer) and returns that same value afterwards; ``Lazy(make)`` is the same for values that
are only indexed (``K = Lazy(lambda: jax.random.split(key, 8))``, then ``K[3]``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def once(make: Callable[[], Any]) -> Callable[[], Any]:
    @functools.cache
    def get():
        # as at import: 32-bit defaults, and concrete values even when first asked for
        # while a function is being traced
        with jax.enable_x64(False), jax.ensure_compile_time_eval():
            return make()

    return get


class Lazy:
    def __init__(self, make: Callable[[], Any]):
        self._get = once(make)

    def __getitem__(self, index):
        return self._get()[index]

    def __len__(self):
        return len(self._get())
