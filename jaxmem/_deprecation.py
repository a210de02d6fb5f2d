"""Deprecated spellings: one warning class, one warning function, one ``__getattr__`` factory.

Every deprecated name keeps working until :data:`REMOVAL` and warns (once per call site)
with :class:`JaxmemDeprecationWarning`, naming the spelling to use instead.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["REMOVAL", "JaxmemDeprecationWarning", "deprecated_attributes", "warn"]

#: the version in which the deprecated spellings go away
REMOVAL = "0.3.0"

_IMPORT_FRAMES = ("<frozen importlib", __file__)
_seen: set = set()


class JaxmemDeprecationWarning(DeprecationWarning):
    """A deprecated jaxmem spelling was used; the message names the one to use instead."""


def warn(old: str, new: str, removal: str = REMOVAL, *, stacklevel: int = 2) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (once per call site).

    ``stacklevel`` counts as for :func:`warnings.warn` (2: the caller of the function that
    calls ``warn``); frames of the import machinery are skipped, so ``from m import old``
    points at the import line.
    """
    frame = sys._getframe(stacklevel)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_IMPORT_FRAMES):
        frame = frame.f_back
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    if (old, filename, lineno) in _seen:
        return
    _seen.add((old, filename, lineno))
    warnings.warn_explicit(
        f"{old} is deprecated and will be removed in jaxmem {removal}; use {new}",
        JaxmemDeprecationWarning, filename, lineno, module=frame.f_globals.get("__name__"))


def _resolve(target: str) -> Any:
    modname, _, attr = target.partition(":")
    return getattr(importlib.import_module(modname), attr)


def deprecated_attributes(module: str, aliases: dict[str, tuple[str, str]],
                          fallback: Callable[[str], Any] | None = None) -> Callable:
    """A module-level ``__getattr__`` for ``module``'s deprecated names.

    ``aliases`` maps each old name to ``(target, new)``: ``target`` is ``"pkg.mod:attr"``
    (resolved at first use, so aliases cost no import), ``new`` the spelling the warning
    names. Other names go to ``fallback`` (else ``AttributeError``).
    """
    def __getattr__(name: str) -> Any:
        if name in aliases:
            target, new = aliases[name]
            warn(f"{module}.{name}", new)
            return _resolve(target)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
