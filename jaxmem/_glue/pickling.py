"""Pickling instances of the classes jaxmem makes at run time.

``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` give a module an instance of a subclass
made by a cached factory (``factory(base, options)``); that class shares the user's
``__qualname__`` (Flax's auto-names use the class name), so ``pickle`` cannot find it by name.
:func:`reduce` is the ``__reduce_ex__`` of those classes: it pickles the instance's state as
Python would, and the class as "call ``factory(*key)``", which gives the same class object
again in the loading process (the factory is cached), so the loaded module is an instance of
the very same converted class and computes the same. The base class must be importable, as
for pickling the unconverted module.
"""
from __future__ import annotations

import copyreg
import importlib

__all__ = ["reduce"]


def _class(factory: str, key: tuple) -> type:
    modname, name = factory.rsplit(".", 1)
    return getattr(importlib.import_module(modname), name)(*key)


def _new(factory: str, key: tuple, args: tuple):
    cls = _class(factory, key)
    return cls.__new__(cls, *args)


def _new_ex(factory: str, key: tuple, args: tuple, kwargs: dict):
    cls = _class(factory, key)
    return cls.__new__(cls, *args, **kwargs)


def reduce(obj, protocol: int, factory: str, key: tuple):
    """``obj.__reduce_ex__(protocol)`` for an instance of ``factory(*key)`` (``factory``: the
    dotted name of a module-level, cached class factory)."""
    out = object.__reduce_ex__(obj, max(2, protocol))
    fn, args, *rest = out
    if fn is copyreg.__newobj__:
        return (_new, (factory, key, tuple(args[1:])), *rest)
    if fn is copyreg.__newobj_ex__:
        _, a, kw = args
        return (_new_ex, (factory, key, tuple(a), dict(kw)), *rest)
    raise TypeError(f"cannot pickle {type(obj).__name__}: unexpected reduction {fn!r}")
