"""Deprecated (until jaxmem 0.3.0): ``patch_functions()`` converted inline activations and
pools while code traced inside it, by patching module attributes. Nothing is patched any
more: ``patch_functions()`` is the deprecated Linen scope (Linen calls only);
``jaxmem.transform(f)`` converts any function by what it computes."""
from __future__ import annotations

from jaxmem import _deprecation

__all__: list[str] = []

__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.patch", {
    "patch_functions": ("jaxmem.selective.linen:_scope",
                        "jaxmem.transform(f, attention=False)")})
