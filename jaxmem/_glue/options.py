"""The active conversion options of the current context (a ``contextvars.ContextVar``).

``using(options)`` pushes ``options`` for the duration of a ``with`` block; ``current()``
returns the innermost pushed options (``None`` outside every scope). Because the stack lives
in a ``ContextVar``, another thread tracing at the same time sees its own (usually empty)
stack and gets plain JAX/Flax.

A layer or function named ``name`` is decided by the innermost options that *cover* it
(:func:`lookup`): options built by :func:`jaxmem.scope` cover everything (inner overrides
outer); the narrow compatibility switches (``fewbit.patch_activations(activations=...)``,
``fewbit.patch_softmax``, ...) cover only their own names, so they compose with the scopes
around them.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

__all__ = ["Options", "current", "lookup", "stack", "using"]


@dataclasses.dataclass(frozen=True)
class Options:
    """What a scope converts.

    selective: exact selective-differentiation layers and 1-bit ReLU-family masks.
    fewbit: ``None`` (exact techniques only) or 1..4 bits per element for the stored codes of
      smooth activations (approximate gradients, opt-in).
    attention: exact memory-efficient attention / softmax for Flax's attention.
    only: ``None`` (covers everything) or the names / parts (``'selective'``, ``'fewbit'``,
      ``'attention'``) these options decide; others are decided by enclosing options.
    """

    selective: bool = True
    fewbit: int | None = None
    attention: bool = True
    only: frozenset | None = None

    def __post_init__(self):
        if not isinstance(self.selective, bool):
            raise TypeError(f"selective must be True or False, got {self.selective!r}")
        if not isinstance(self.attention, bool):
            raise TypeError(f"attention must be True or False, got {self.attention!r}")
        fb = self.fewbit
        if fb is not None and (isinstance(fb, bool) or not isinstance(fb, int)
                               or not 1 <= fb <= 4):
            raise ValueError(f"fewbit must be None (exact only) or an int in 1..4 (bits per "
                             f"element), got {fb!r}")
        if self.only is not None and not isinstance(self.only, frozenset):
            object.__setattr__(self, "only", frozenset(self.only))

    def covers(self, name: str, parts=()) -> bool:
        """Whether these options decide ``name`` (belonging to ``parts``)."""
        if self.only is None:
            return True
        return name in self.only or any(p in self.only for p in parts)

    def public(self) -> dict:
        return {"selective": self.selective, "fewbit": self.fewbit,
                "attention": self.attention}


_STACK: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxmem_options", default=())


def stack() -> tuple:
    """All active options, outermost first."""
    return _STACK.get()


def current() -> Options | None:
    """The innermost active options, ``None`` outside every scope."""
    s = _STACK.get()
    return s[-1] if s else None


def lookup(name: str, parts=()) -> Options | None:
    """The innermost active options that cover ``name`` (see :class:`Options`)."""
    for o in reversed(_STACK.get()):
        if o.covers(name, parts):
            return o
    return None


@contextlib.contextmanager
def using(options: Options) -> Iterator[Options]:
    """Push ``options`` for the duration of the block (this context / thread only)."""
    if not isinstance(options, Options):
        raise TypeError(f"using: expected jaxmem._glue.options.Options, got {options!r}")
    token = _STACK.set(_STACK.get() + (options,))
    try:
        yield options
    finally:
        _STACK.reset(token)
