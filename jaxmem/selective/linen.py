"""Deprecated selective-only spellings for Flax Linen (until jaxmem 0.3.0).

``convert``, ``scope`` and ``wrap`` here were the selective-only forms of the Linen
conversion. They are thin layers over :func:`jaxmem.linen.convert` (the lifted
:func:`jaxmem.transform`) with ``fewbit=None, attention=False``; each warns
:class:`jaxmem.JaxmemDeprecationWarning` naming its replacement.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn

from jaxmem import _deprecation
from jaxmem._glue import options as _options

__all__ = ["SelectiveFallbackWarning"]


class SelectiveFallbackWarning(UserWarning):
    """A layer ran its own (Flax) code because jaxmem cannot reproduce its configuration:
    gradients are exact, but nothing is saved for it."""


_SELECTIVE = _options.Options(selective=True, fewbit=None, attention=False)


def _scope():
    """Deprecated: use ``jaxmem.linen.convert(model, fewbit=None, attention=False)``.

    Linen module calls traced inside run as that conversion (see
    ``jaxmem.linen.scope_options``)."""
    from jaxmem.linen import scope_options

    return scope_options(_SELECTIVE, label="jaxmem.selective.linen.scope")


def _wrap(fn: Callable) -> Callable:
    """Deprecated: ``fn`` (e.g. a loss that calls ``model.apply``) with its Linen calls
    converted as ``jaxmem.linen.convert(model, fewbit=None, attention=False)`` converts
    them; ``jaxmem.transform(fn, attention=False)`` converts all of ``fn``."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _scope():
            return fn(*args, **kwargs)

    return wrapped


def _convert(model: nn.Module) -> nn.Module:
    """Deprecated: ``jaxmem.linen.convert(model, fewbit=None, attention=False)``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            "jaxmem.selective.linen.convert: model must be a flax.linen.Module, got "
            f"{type(model).__module__}.{type(model).__name__}; for flax.nnx modules use "
            "jaxmem.nnx.convert")
    from jaxmem import linen as _jl
    return _jl._convert_with(model, _SELECTIVE)


__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.linen", {
    "convert": ("jaxmem.selective.linen:_convert",
                "jaxmem.linen.convert(model, fewbit=None, attention=False)"),
    "scope": ("jaxmem.selective.linen:_scope",
              "jaxmem.linen.convert(model, fewbit=None, attention=False)"),
    "wrap": ("jaxmem.selective.linen:_wrap", "jaxmem.transform(fn, attention=False)"),
})
