"""Recipes: values that a backward rule may recompute instead of storing.

``remember(y, fn, args, kept_if)`` records ``y == fn(*args)`` bit for bit, where the producer
of ``y`` keeps ``args`` for its own backward whenever one of ``args[i]``, ``i in kept_if``, is
differentiated. A normalisation registers its output with the tensors its backward keeps
(``x``, statistics, parameters), an exact smooth activation its output with its input, and a
1-bit mask activation (:mod:`jaxmem._prims.mask`) applied to a recorded value registers its
own output as ``f(fn(*args))`` with the same ``args``. A bilinear layer fed such a value
(``jaxmem.selective.linear``) then keeps those same tensors (one residual shared by both
rules) instead of a second input-sized array, and recomputes its input elementwise in the
backward pass. XLA would not do this by itself: it keeps what the rules store.
"""
from __future__ import annotations

import functools
import weakref

__all__ = ["recipe", "remember", "then"]

# ``id(y) -> (ref, fn, args, kept_if)``; an entry goes when ``y`` is garbage.
_recipes: dict = {}


def remember(y, fn, args, kept_if=(0, 3)) -> None:
    """Record that ``y`` equals ``fn(*args)`` bit for bit (until ``y`` is garbage), and that
    the producer of ``y`` keeps ``args`` for its backward when any ``args[i]``,
    ``i in kept_if``, is differentiated (the default: a normalisation's ``x`` and ``scale``)."""
    key = id(y)

    def _drop(_, key=key):
        _recipes.pop(key, None)

    try:
        ref = weakref.ref(y, _drop)
    except TypeError:  # not weak-referenceable (plain numbers): nothing to record
        return
    _recipes[key] = (ref, fn, args, tuple(kept_if))


def recipe(x):
    """``(fn, args, kept_if)`` recorded by :func:`remember` for this very object ``x``, else
    ``None``."""
    entry = _recipes.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3]


def _composed(outer, inner, *args):
    return outer(inner(*args))


def then(y, outer, x) -> None:
    """Record ``y == outer(x)`` as ``outer(fn(*args))`` when ``x`` has a recipe
    ``(fn, args, kept_if)`` (same ``args`` and ``kept_if``); nothing otherwise. ``outer`` must
    be elementwise and deterministic, so the recomputation is ``y`` bit for bit."""
    r = recipe(x)
    if r is not None:
        fn, args, kept_if = r
        remember(y, functools.partial(_composed, outer, fn), args, kept_if)
