"""PyTorch reference of jaxmem.fewbit (same tables, same packing, same gradients)."""
from .convert import FewBitActivation, convert
from .ops import (
    FewBitFunction,
    MaskFunction,
    activation,
    celu,
    elu,
    fewbit,
    gelu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    softplus,
    softsign,
    tanh,
)
from .pack import codes, pack, unpack

__all__ = [
    "FewBitActivation", "FewBitFunction", "MaskFunction", "activation", "celu", "codes",
    "convert", "elu", "fewbit", "gelu", "hard_swish", "hard_tanh", "leaky_relu", "log_sigmoid",
    "mish", "pack", "relu", "relu6", "selu", "sigmoid", "silu", "softplus", "softsign", "tanh",
    "unpack",
]
