"""Swap ``torch.nn`` activation modules for few-bit ones, in place.

``convert(model, bits=3)`` replaces every supported activation module (nn.GELU, nn.SiLU,
nn.Sigmoid, nn.Tanh, nn.SELU, nn.Softplus, nn.ELU, nn.CELU, nn.Mish, nn.Softsign,
nn.LogSigmoid, nn.Hardswish; exact 1-bit: nn.ReLU, nn.ReLU6, nn.Hardtanh(-1, 1),
nn.LeakyReLU) by :class:`FewBitActivation` and returns the model and the list of replaced
module paths.  Modules with parameters the shipped tables were not fitted for (e.g.
``nn.ELU(alpha=2)``, ``nn.Softplus(beta=2)``) are left unchanged and reported in ``skipped``.
Functional calls inside ``forward`` (``F.gelu(x)``) are not modules and are not converted.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ops

__all__ = ["FewBitActivation", "convert", "module_to_name"]


class FewBitActivation(nn.Module):
    """A few-bit activation module (``name`` from ``torch_ref.fewbit.ops``)."""

    def __init__(self, name: str, bits: int = 3, negative_slope: float | None = None):
        super().__init__()
        if name not in ops.FORWARD and name not in ops.MASKS and name != "leaky_relu":
            raise ValueError(f"unknown activation {name!r}")
        self.name, self.bits, self.negative_slope = name, bits, negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "leaky_relu":
            return ops.leaky_relu(x, self.negative_slope)
        return ops.activation(self.name, x, self.bits)

    def extra_repr(self) -> str:
        return f"{self.name}, bits={self.bits if self.name in ops.FORWARD else 1}"


def module_to_name(m: nn.Module) -> tuple[str | None, dict]:
    """(activation name, extra kwargs) for a supported module, or (None, reason)."""
    if isinstance(m, nn.GELU):
        return ("gelu_tanh" if m.approximate == "tanh" else "gelu"), {}
    simple = {nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SELU: "selu",
              nn.Mish: "mish", nn.Softsign: "softsign", nn.LogSigmoid: "log_sigmoid",
              nn.Hardswish: "hard_swish", nn.ReLU: "relu", nn.ReLU6: "relu6"}
    for cls, name in simple.items():
        if type(m) is cls:
            return name, {}
    if type(m) is nn.Softplus:
        return ("softplus", {}) if m.beta == 1 else (None, {"reason": f"beta={m.beta}"})
    if type(m) is nn.ELU:
        return ("elu", {}) if m.alpha == 1 else (None, {"reason": f"alpha={m.alpha}"})
    if type(m) is nn.CELU:
        return ("celu", {}) if m.alpha == 1 else (None, {"reason": f"alpha={m.alpha}"})
    if type(m) is nn.Hardtanh:
        ok = m.min_val == -1 and m.max_val == 1
        return ("hard_tanh", {}) if ok else (None, {"reason": "min/max != -1/1"})
    if type(m) is nn.LeakyReLU:
        return "leaky_relu", {"negative_slope": m.negative_slope}
    return None, {}


def convert(model: nn.Module, bits: int = 3):
    """Replace supported activation modules of ``model`` in place.

    Returns:
      ``(model, replaced, skipped)``: lists of dotted module paths.
    """
    ops._check_bits(bits)
    replaced, skipped = [], []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            path = f"{parent_name}.{child_name}" if parent_name else child_name
            name, extra = module_to_name(child)
            if name is None:
                if "reason" in extra:
                    skipped.append(f"{path} ({extra['reason']})")
                continue
            setattr(parent, child_name, FewBitActivation(name, bits, **extra))
            replaced.append(path)
    return model, replaced, skipped
