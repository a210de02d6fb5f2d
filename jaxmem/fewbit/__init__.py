"""Few-bit backward for elementwise activations (Novikov et al., "Few-Bit Backward").

Forward is the exact activation; autodiff keeps only a ``bits``-bit code of the input
(1-4 bits per element, densely packed) and the backward multiplies ``dy`` by the level of the
optimal piecewise-constant approximation of ``f'`` on the code's bin.

Functional core:  :func:`fit` (DP + refinement), :func:`pack` / :func:`unpack`,
named ops (:func:`gelu`, :func:`silu`, ...), :func:`make_activation` (any elementwise fn).
The ReLU family (:func:`relu`, :func:`relu6`, :func:`hard_tanh`, :func:`leaky_relu`) is exact
with a 1-bit mask and is the very same op as ``jaxmem.selective.relu`` & co.
Exact companions for transformer blocks (:mod:`jaxmem.fewbit.attention`): :func:`attention`
(flash-style backward, no ``T x T`` residual) and :func:`softmax` (stores its output once).
Flax glue: :mod:`jaxmem.fewbit.linen` (:func:`patch_activations`, :func:`activation_fn`),
:func:`patch_softmax`, :func:`patch_attention`.

Registries: :data:`TABLE_ACTIVATIONS` (name -> :class:`~jaxmem.fewbit.activations.Activation`,
the activations with shipped tables)
and :data:`MASK_ACTIVATIONS` (the exact 1-bit ones).  Aliases: ``swish`` = ``silu``,
``soft_sign`` = ``softsign``.
"""
from . import ops
from .activations import MASK_ACTIVATIONS, TABLE_ACTIVATIONS
from .attention import attention, patch_attention, patch_softmax, softmax
from .factory import check_elementwise, make_activation
from .fit import Fit, approximation_error, fit, gaussian_weight, uniform_weight
from .linen import activation_fn, patch_activations
from .ops import *  # the named few-bit ops (ops.__all__)
from .pack import codes, pack, packed_shape, unpack
from .tables import Table, load_table, table_names

__all__ = [
    "MASK_ACTIVATIONS",
    "TABLE_ACTIVATIONS",
    "Fit",
    "Table",
    "activation_fn",
    "approximation_error",
    "attention",
    "check_elementwise",
    "codes",
    "fit",
    "gaussian_weight",
    "load_table",
    "make_activation",
    "pack",
    "packed_shape",
    "patch_activations",
    "patch_attention",
    "patch_softmax",
    "softmax",
    "table_names",
    "uniform_weight",
    "unpack",
]
__all__ += ops.__all__
