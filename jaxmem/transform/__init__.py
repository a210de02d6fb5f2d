"""jaxmem.transform -- one jaxpr-level transformation for any JAX code.

:func:`transform` traces a function to a jaxpr and re-emits it with jaxmem's memory-lean
``custom_vjp`` ops wherever the *computation* matches, however it was spelled:

* ``dot_general`` / ``conv_general_dilated`` -> :mod:`jaxmem.selective` (a frozen weight
  keeps no input) -- :mod:`~jaxmem.transform.match_dot`;
* elementwise activation subgraphs -> exact 1-bit masks (piecewise linear) or few-bit
  codes with a table fitted for that function (``fewbit=b``) --
  :mod:`~jaxmem.transform.match_elementwise`;
* attention subgraphs -> the exact memory-lean attention --
  :mod:`~jaxmem.transform.match_attention`;
* normalisations (layer / RMS / batch / group norm, any spelling, checked to compute one)
  -> :func:`jaxmem.selective.normalize` (statistics pooled over named axes too, with the
  same ``axis_name``) -- :mod:`~jaxmem.transform.match_norm`;
* dropout (``where(bernoulli(key, keep), x / keep, 0)``) -> :func:`jaxmem.selective.dropout`
  (the mask regenerated from the key) -- :mod:`~jaxmem.transform.match_dropout`;
* max pools (``reduce_window`` max) -> :func:`jaxmem.selective.max_pool` (argmax codes kept
  instead of the input; exact, ties included) -- :mod:`~jaxmem.transform.match_pool`;
* language-model heads (a product ``h W`` wider than ``h`` and a softmax-like loss per row:
  optax's cross-entropies, ``log_softmax`` + ``take_along_axis``, one-hot sums) -> the same
  equations computed ``logits_chunk`` rows at a time under ``jax.checkpoint`` (no
  ``tokens x vocab`` array kept) -- :mod:`~jaxmem.transform.match_logits`;

through ``scan``, ``cond``, ``while``, ``remat`` and ``jit`` bodies
(:mod:`~jaxmem.transform.interpret`).  :func:`report` lists every decision with the user's
source location (:mod:`~jaxmem.transform.report`).  Nothing is patched process-wide.

``jaxmem.transform`` is both this module and the function: ``jaxmem.transform(f)`` and
``jaxmem.transform.report(f, *args)`` both work.
"""
from __future__ import annotations

import sys
import types

from jaxmem.transform.api import report, transform
from jaxmem.transform.options import Options
from jaxmem.transform.report import Report, Row

__all__ = ["Options", "Report", "Row", "report", "transform"]

# ``jaxmem.transform`` resolves to the function when reached as an attribute of ``jaxmem``
# and to this (callable) module once imported: both carry the same names.
transform.transform = transform
transform.report = report
transform.Report = Report
transform.Row = Row
transform.Options = Options


class _CallableModule(types.ModuleType):
    """The module is callable: ``jaxmem.transform(f, ...)`` is :func:`transform`."""

    def __call__(self, f, **options):
        return transform(f, **options)


sys.modules[__name__].__class__ = _CallableModule
