"""``jaxmem.nnx.convert``: the one way in for Flax NNX modules.

``convert(module)`` converts the module's layers with the selective part
(:mod:`jaxmem.selective.nnx`) and the attention part
(``jaxmem.fewbit.flax_attention.nnx_convert_attention``, when available), and makes calls of
the root run inside :func:`jaxmem.scope` (inline functions such as ``nnx.relu``,
``nnx.gelu``, ``nnx.max_pool``, and activations held as attributes, are converted while
tracing). ``copy=True`` (default) converts a clone and leaves ``module`` untouched;
``copy=False`` converts in place (same Variables) and returns it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

from flax import nnx as _nnx

from jaxmem._glue import options as _options
from jaxmem._glue import patch as _gpatch
from jaxmem._glue import pickling as _pickling

__all__ = ["convert", "is_converted"]


def _field_swaps(root):
    swaps = []
    for _, m in _nnx.iter_graph(root):
        if not isinstance(m, _nnx.Module):
            continue
        for name, v in list(vars(m).items()):
            if name.startswith("_") or isinstance(v, (_nnx.Module, _nnx.Variable, type)):
                continue
            if not callable(v):
                continue
            rep = _gpatch.replacement_for(v)
            if rep is not None:
                swaps.append((m, name, v, rep))
    return swaps


@contextlib.contextmanager
def _swapped(swaps):
    for m, name, _, rep in swaps:
        object.__setattr__(m, name, rep)
    try:
        yield
    finally:
        for m, name, old, _ in reversed(swaps):
            object.__setattr__(m, name, old)


def _reduce_ex(self, protocol):
    """Pickle as the base class's state plus ``_converted_class(base, options)``."""
    sub = type(self)
    return _pickling.reduce(self, protocol, "jaxmem.nnx._converted_class",
                            (sub._jaxmem_base, sub._jaxmem_options))


@functools.cache
def _converted_class(cls, opts):
    """The converted subclass of the NNX class ``cls`` under ``opts`` (one per pair)."""
    label = f"jaxmem.nnx.convert({cls.__name__})"
    holder = []

    def __call__(self, *args, **kwargs):
        with _gpatch.scope_options(opts, label=label, linen=True), \
                _swapped(_field_swaps(self)):
            return super(holder[0], self).__call__(*args, **kwargs)

    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "__call__": __call__, "_jaxmem_options": opts,
          "_jaxmem_base": cls, "__reduce_ex__": _reduce_ex}
    sub = type(cls)(cls.__name__, (cls,), ns)
    holder.append(sub)
    return sub


def is_converted(module) -> bool:
    return getattr(type(module), "_jaxmem_options", None) is not None


def convert(module, *, selective: bool = True, fewbit: int | None = None,
            attention: bool = True, copy: bool = True):
    """Convert an ``nnx.Module`` (see the module docstring); returns the converted module.

    selective / fewbit / attention: as :func:`jaxmem.scope`. ``copy=True``: a converted
    clone (``module`` untouched); ``copy=False``: in place, same Variables.

    Args:
      module: the ``flax.nnx.Module`` to convert.
      selective: use the exact selective-differentiation layers and 1-bit masks.
      fewbit: ``None`` for exact techniques only, or 1..4 bits per smooth activation.
      attention: compute attention with jaxmem's exact memory-efficient attention.
      copy: ``True`` converts a clone; ``False`` converts ``module`` in place.

    Returns:
      The converted module (a clone, or ``module`` itself with ``copy=False``); its calls
      give the same outputs as ``module``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxmem
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.lin = nnx.Linear(5, 3, rngs=rngs)
      ...     def __call__(self, x):
      ...         return nnx.relu(self.lin(x))
      >>> net = Net(nnx.Rngs(0))
      >>> fast = jaxmem.nnx.convert(net)
      >>> jaxmem.nnx.is_converted(fast), jaxmem.nnx.is_converted(net)
      (True, False)
      >>> x = jnp.ones((2, 5))
      >>> fast(x).shape, bool(jnp.allclose(fast(x), net(x)))
      ((2, 3), True)
    """
    if not isinstance(module, _nnx.Module):
        raise TypeError(
            "jaxmem.nnx.convert: module must be a flax.nnx.Module, got "
            f"{type(module).__module__}.{type(module).__name__}; for flax.linen modules use "
            "jaxmem.linen.convert")
    if not isinstance(copy, bool):
        raise TypeError(f"jaxmem.nnx.convert: copy must be True or False, got {copy!r}")
    opts = _options.Options(selective=selective, fewbit=fewbit, attention=attention)
    m = _nnx.clone(module) if copy else module
    if selective:
        from jaxmem.selective import nnx as _sel_nnx
        _sel_nnx._convert(m)
    if attention:
        try:
            fa = importlib.import_module("jaxmem.fewbit.flax_attention")
        except ImportError:
            fa = None
        hook = getattr(fa, "nnx_convert_attention", None)
        if hook is not None:
            hook(m)
    if not any("__call__" in vars(k) for k in type(m).__mro__):  # nothing to call
        return m
    base = getattr(type(m), "_jaxmem_base", type(m))
    m.__class__ = _converted_class(base, opts)
    return m
