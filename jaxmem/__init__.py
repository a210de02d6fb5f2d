"""jaxmem: train JAX/Flax models in less memory without changing what they learn.

Submodules (imported lazily, so ``import jaxmem`` stays cheap and never imports torch):

- :mod:`jaxmem.measure`   — residual bytes, compiled bytes, measured peak, slope.
- :mod:`jaxmem.selective` — differentiability-aware layers, 1-bit ReLU masks.
- :mod:`jaxmem.fewbit`    — few-bit activation residuals (DP-optimal step derivatives).
- :mod:`jaxmem.rowconv`   — row-centric (row-tiled) convolution training, exact gradients.
- :mod:`jaxmem.schedule`  — ILP operator ordering and tensor placement over jaxprs.
- :mod:`jaxmem.models`    — reference Flax models (twins of ``torch_ref.models``).
- :mod:`jaxmem.distributed` — DP/FSDP/TP train steps on a ``Mesh``, collectives accounting.
- :mod:`jaxmem.planner`   — :func:`jaxmem.plan`: fit a training step into a memory budget.
- :mod:`jaxmem.losses`    — the LM head's cross-entropy a chunk of tokens at a time (no
  ``tokens x vocab`` array kept).

Any JAX function: :func:`jaxmem.transform` (a function transformation that converts what
the program computes; nothing is patched). Flax models: :func:`jaxmem.linen.convert`,
:func:`jaxmem.nnx.convert` (the same transformation, lifted over the module's variables).
:func:`jaxmem.report`: what was converted and why. Older spellings warn
:class:`JaxmemDeprecationWarning` and name their replacement (``docs/api.md``).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("measure", "selective", "fewbit", "rowconv", "schedule", "models", "bench",
               "linen", "nnx", "distributed", "planner", "losses")
_ATTRS = {"scope": ("jaxmem.linen", "deprecated_scope"),
          "plan": ("jaxmem.planner", "plan"),
          "transform": ("jaxmem.transform", "transform"),
          "report": ("jaxmem._glue.report", "report"),
          "Report": ("jaxmem._glue.report", "Report"),
          "NothingConvertedWarning": ("jaxmem._glue.report", "NothingConvertedWarning"),
          "GradientInsideWarning": ("jaxmem.transform.report", "GradientInsideWarning"),
          "JaxmemDeprecationWarning": ("jaxmem._deprecation", "JaxmemDeprecationWarning")}
__all__ = list(_SUBMODULES) + list(_ATTRS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    if name in _ATTRS:
        modname, attr = _ATTRS[name]
        value = getattr(importlib.import_module(modname), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
