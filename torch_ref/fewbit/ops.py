"""Few-bit activations for PyTorch (``torch.autograd.Function``), same tables as jaxmem.

Forward: the exact ``torch.nn.functional`` activation.  Saved for backward: only the packed
``bits``-bit codes (``ceil(n * bits / 8)`` bytes).  Backward:
``dx = (float32(dy) * float32(levels)[code(x)]).to(dy.dtype)`` — bit-identical to
``jaxmem.fewbit`` for the same ``x`` and ``dy``.  Tables are read from jaxmem's package data
(``jaxmem.fewbit.tables``, which imports neither jax nor torch).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from jaxmem.fewbit.tables import load_table

from .pack import _check_bits, codes, pack, unpack

__all__ = [
    "FORWARD",
    "MASKS",
    "FewBitFunction",
    "MaskFunction",
    "activation",
    "celu",
    "elu",
    "fewbit",
    "gelu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "log_sigmoid",
    "mish",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "softplus",
    "softsign",
    "tanh",
]

#: table name -> exact torch forward
FORWARD: dict[str, Callable] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "selu": F.selu,
    "softplus": F.softplus,
    "elu": F.elu,
    "celu": F.celu,
    "mish": F.mish,
    "softsign": F.softsign,
    "log_sigmoid": F.logsigmoid,
    "hard_swish": F.hardswish,
}

#: exact 1-bit activations: name -> (forward, predicate, level outside, level inside);
#: predicates follow jaxmem (JAX's derivative at the kinks).
MASKS: dict[str, tuple] = {
    "relu": (F.relu, lambda x: x > 0, 0.0, 1.0),
    "relu6": (F.relu6, lambda x: (x > 0) & (x < 6), 0.0, 1.0),
    "hard_tanh": (F.hardtanh, lambda x: (x >= -1) & (x <= 1), 0.0, 1.0),
}


def _check_x(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"few-bit {name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"few-bit {name}: x must be float32, bfloat16 or float16, got {x.dtype}")


def _grad(dy: torch.Tensor, c: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    q = levels.to(device=dy.device, dtype=torch.float32)[c.long()]
    return (dy.to(torch.float32) * q).to(dy.dtype)


class FewBitFunction(torch.autograd.Function):
    """``y = fn(x)``; saves ``pack(code(x), bits)``; ``dx = dy * levels[code]``."""

    @staticmethod
    def forward(ctx, x, fn, borders, levels, bits, symmetric):
        packed = pack(codes(x, borders, symmetric), bits)
        ctx.save_for_backward(packed)
        ctx.meta = (tuple(x.shape), levels, bits)
        return fn(x)

    @staticmethod
    def backward(ctx, dy):
        (packed,) = ctx.saved_tensors
        shape, levels, bits = ctx.meta
        c = unpack(packed, bits, shape)
        return _grad(dy, c, levels), None, None, None, None, None


class MaskFunction(torch.autograd.Function):
    """Exact 1-bit op: ``dx = dy * (high if predicate(x) else low)``."""

    @staticmethod
    def forward(ctx, x, fn, predicate, low, high):
        packed = pack(predicate(x.detach()).to(torch.uint8), 1)
        ctx.save_for_backward(packed)
        ctx.meta = (tuple(x.shape), torch.tensor([low, high], dtype=torch.float32))
        return fn(x)

    @staticmethod
    def backward(ctx, dy):
        (packed,) = ctx.saved_tensors
        shape, levels = ctx.meta
        return _grad(dy, unpack(packed, 1, shape), levels), None, None, None, None


@functools.cache
def _table(name: str, bits: int):
    t = load_table(name, bits)
    return (torch.tensor(t.borders_f32), torch.tensor(t.levels_f32), t.symmetric)


def fewbit(x: torch.Tensor, fn: Callable, borders, levels, bits: int, symmetric: bool = False):
    """Few-bit ``fn`` with an explicit table (float32 borders/levels)."""
    bits = _check_bits(bits)
    _check_x(x, getattr(fn, "__name__", "fn"))
    b = torch.as_tensor(borders, dtype=torch.float32).reshape(-1)
    lv = torch.as_tensor(levels, dtype=torch.float32).reshape(-1)
    if b.numel() != 2**bits - 1 or lv.numel() != 2**bits:
        raise ValueError(f"a {bits}-bit table needs {2**bits - 1} borders and {2**bits} levels")
    return FewBitFunction.apply(x, fn, b, lv, bits, bool(symmetric))


def activation(name: str, x: torch.Tensor, bits: int = 3) -> torch.Tensor:
    """Apply the registered few-bit activation ``name``."""
    bits = _check_bits(bits)
    if name in MASKS:
        _check_x(x, name)
        fn, pred, lo, hi = MASKS[name]
        return MaskFunction.apply(x, fn, pred, lo, hi)
    if name not in FORWARD:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(FORWARD) + sorted(MASKS)}")
    _check_x(x, name)
    b, lv, sym = _table(name, bits)
    return FewBitFunction.apply(x, FORWARD[name], b, lv, bits, sym)


def gelu(x, bits=3, approximate="none"):
    """GELU (``approximate='none'`` or ``'tanh'``, like ``F.gelu``) with few-bit backward."""
    if approximate not in ("none", "tanh", True, False):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    tanh_form = approximate in ("tanh", True)
    return activation("gelu_tanh" if tanh_form else "gelu", x, bits)


def silu(x, bits=3):
    return activation("silu", x, bits)


def sigmoid(x, bits=3):
    return activation("sigmoid", x, bits)


def tanh(x, bits=3):
    return activation("tanh", x, bits)


def selu(x, bits=3):
    return activation("selu", x, bits)


def softplus(x, bits=3):
    return activation("softplus", x, bits)


def elu(x, bits=3):
    return activation("elu", x, bits)


def celu(x, bits=3):
    return activation("celu", x, bits)


def mish(x, bits=3):
    return activation("mish", x, bits)


def softsign(x, bits=3):
    return activation("softsign", x, bits)


def log_sigmoid(x, bits=3):
    return activation("log_sigmoid", x, bits)


def hard_swish(x, bits=3):
    return activation("hard_swish", x, bits)


def relu(x):
    return activation("relu", x)


def relu6(x):
    return activation("relu6", x)


def hard_tanh(x):
    return activation("hard_tanh", x)


def leaky_relu(x, negative_slope: float = 0.01):
    _check_x(x, "leaky_relu")
    s = float(negative_slope)
    return MaskFunction.apply(x, lambda t: F.leaky_relu(t, s), lambda t: t >= 0, s, 1.0)
