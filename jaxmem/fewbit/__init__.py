"""Few-bit backward for elementwise activations (Novikov et al., "Few-Bit Backward").

Forward is the exact activation; autodiff keeps only a ``bits``-bit code of the input
(1-4 bits per element, densely packed) and the backward multiplies ``dy`` by the level of the
optimal piecewise-constant approximation of ``f'`` on the code's bin.

Functional core:  :func:`fit` (DP + refinement), :func:`pack` / :func:`unpack`,
named ops (:func:`gelu`, :func:`silu`, ...), :func:`make_activation` (any elementwise fn).
Exact companions for transformer blocks (:mod:`jaxmem.fewbit.attention`): :func:`attention`
(flash-style backward, no ``T x T`` residual) and :func:`softmax` (stores its output once).
Flax glue: :mod:`jaxmem.fewbit.linen` (:func:`patch_activations`, :func:`activation_fn`),
:func:`patch_softmax`, :func:`patch_attention`.
"""
from .activations import ACTIVATIONS, MASK_ACTIVATIONS
from .attention import attention, patch_attention, patch_softmax, softmax
from .factory import check_elementwise, make_activation
from .fit import Fit, approximation_error, fit, gaussian_weight, uniform_weight
from .linen import activation_fn, patch_activations
from .ops import (
    activation,
    celu,
    elu,
    fewbit_op,
    gelu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    mask_op,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softplus,
    softsign,
    swish,
    tanh,
)
from .pack import codes, pack, packed_shape, unpack
from .tables import Table, load_table, table_names

__all__ = [
    "ACTIVATIONS",
    "MASK_ACTIVATIONS",
    "Fit",
    "Table",
    "activation",
    "activation_fn",
    "approximation_error",
    "attention",
    "celu",
    "check_elementwise",
    "codes",
    "elu",
    "fewbit_op",
    "fit",
    "gaussian_weight",
    "gelu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "load_table",
    "log_sigmoid",
    "make_activation",
    "mask_op",
    "mish",
    "pack",
    "packed_shape",
    "patch_activations",
    "patch_attention",
    "patch_softmax",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "softsign",
    "swish",
    "table_names",
    "tanh",
    "uniform_weight",
    "unpack",
]
