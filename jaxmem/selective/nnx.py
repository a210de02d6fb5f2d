"""Selective einsum for NNX, and deprecated NNX spellings (until jaxmem 0.3.0).

:func:`einsum` is a drop-in ``einsum_op`` for ``nnx.Einsum``. ``convert`` and ``scope``
here are deprecated thin layers: ``convert(module)`` is
``jaxmem.nnx.convert(module, fewbit=None, attention=False, copy=False)`` (the module's calls
run through :func:`jaxmem.transform`); ``scope()`` is the deprecated Linen scope with the
same options (it converts Linen calls only: use :func:`jaxmem.nnx.convert` for NNX).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxmem import _deprecation
from jaxmem.selective import linear as _lin

__all__ = ["einsum"]


def einsum(subscripts: str, x: ArrayLike, w: ArrayLike, *, precision: Any = None,
           preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """Drop-in for ``jnp.einsum(subscripts, x, w)`` (as ``nnx.Einsum(einsum_op=...)``) that
    stores ``x`` only if ``w`` is differentiated and ``w`` only if ``x`` is (an einsum of two
    operands is linear in each). With ``out_sharding`` it is ``jnp.einsum`` itself."""
    if out_sharding is not None:
        return jnp.einsum(subscripts, x, w, precision=precision,
                          preferred_element_type=preferred_element_type,
                          out_sharding=out_sharding)
    fn = functools.partial(jnp.einsum, subscripts, precision=precision,
                           preferred_element_type=preferred_element_type)
    return _lin.bilinear(fn, x, w, name="einsum")


def _convert(module):
    """Deprecated: ``jaxmem.nnx.convert(module, fewbit=None, attention=False, copy=False)``."""
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise TypeError(
            "jaxmem.selective.nnx.convert: module must be a flax.nnx.Module, got "
            f"{type(module).__module__}.{type(module).__name__}; for flax.linen modules use "
            "jaxmem.linen.convert")
    from jaxmem import nnx as _jnnx
    return _jnnx.convert(module, fewbit=None, attention=False, copy=False)


__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.nnx", {
    "convert": ("jaxmem.selective.nnx:_convert",
                "jaxmem.nnx.convert(module, fewbit=None, attention=False, copy=False)"),
    "scope": ("jaxmem.selective.linen:_scope",
              "jaxmem.nnx.convert(module, fewbit=None, attention=False)"),
})
