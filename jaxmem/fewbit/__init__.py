"""Few-bit backward for elementwise activations (Novikov et al., "Few-Bit Backward").

Forward is the exact activation; autodiff keeps only a ``bits``-bit code of the input
(1-4 bits per element, densely packed) and the backward multiplies ``dy`` by the level of the
optimal piecewise-constant approximation of ``f'`` on the code's bin.

Functional core:  :func:`fit` (DP + refinement), :func:`pack` / :func:`unpack`,
named ops (:func:`gelu`, :func:`silu`, ...), :func:`make_activation` (any elementwise fn).
The exact ReLU family (1-bit mask) is ``jaxmem.selective.relu`` & co. (:func:`leaky_relu`
here also takes an array or traced slope); exact attention is
:mod:`jaxmem.selective.attention`. Models get few-bit activations without edits through
``jaxmem.transform(f, fewbit=bits)`` / ``jaxmem.linen.convert(model, fewbit=bits)`` /
``jaxmem.nnx.convert``.

Registries: :data:`TABLE_ACTIVATIONS` (name -> :class:`~jaxmem.fewbit.activations.Activation`,
the activations with shipped tables)
and :data:`MASK_ACTIVATIONS` (the exact 1-bit ones).  Aliases: ``swish`` = ``silu``,
``soft_sign`` = ``softsign``.
"""
from jaxmem import _deprecation

from . import linen, ops
from .activations import MASK_ACTIVATIONS, TABLE_ACTIVATIONS
from .factory import check_elementwise, make_activation
from .fit import Fit, approximation_error, fit, gaussian_weight, uniform_weight
from .ops import *  # the named few-bit ops (ops.__all__)
from .pack import codes, pack, packed_shape, unpack
from .tables import Table, load_table, table_names

__all__ = [
    "MASK_ACTIVATIONS",
    "TABLE_ACTIVATIONS",
    "Fit",
    "Table",
    "approximation_error",
    "check_elementwise",
    "codes",
    "fit",
    "gaussian_weight",
    "load_table",
    "make_activation",
    "pack",
    "packed_shape",
    "table_names",
    "uniform_weight",
    "unpack",
]
__all__ += ops.__all__

#: deprecated spellings: old name -> ("module:attribute", the spelling to use)
_DEPRECATED = {
    **{n: (f"jaxmem.selective.activation:{n}", f"jaxmem.selective.{n}")
       for n in ("relu", "relu6", "hard_tanh")},
    **{n: (f"jaxmem.selective.attention:{n}", f"jaxmem.selective.{n}")
       for n in ("attention", "softmax", "attention_core")},
    **linen._DEPRECATED,
}
__getattr__ = _deprecation.deprecated_attributes("jaxmem.fewbit", _DEPRECATED)
