"""torch_ref.memsave -- PyTorch reference of selective differentiation (Bhatia & Dangel):
layers that store for backward only what ``ctx.needs_input_grad`` says is needed, and
``convert(model)`` that swaps them into an existing model."""
from torch_ref.memsave import functional
from torch_ref.memsave.layers import (
    SUPPORTED, MemSaveBatchNorm1d, MemSaveBatchNorm2d, MemSaveBatchNorm3d, MemSaveConv1d,
    MemSaveConv2d, MemSaveConv3d, MemSaveConvTranspose1d, MemSaveConvTranspose2d,
    MemSaveConvTranspose3d, MemSaveDropout, MemSaveGroupNorm, MemSaveLayerNorm, MemSaveLinear,
    MemSaveMaxPool1d, MemSaveMaxPool2d, MemSaveMaxPool3d, MemSaveReLU, convert,
)

__all__ = [
    "SUPPORTED", "MemSaveBatchNorm1d", "MemSaveBatchNorm2d", "MemSaveBatchNorm3d",
    "MemSaveConv1d", "MemSaveConv2d", "MemSaveConv3d", "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d", "MemSaveConvTranspose3d", "MemSaveDropout", "MemSaveGroupNorm",
    "MemSaveLayerNorm", "MemSaveLinear", "MemSaveMaxPool1d", "MemSaveMaxPool2d",
    "MemSaveMaxPool3d", "MemSaveReLU", "convert", "functional",
]
