"""Memory-saving ``torch.nn`` layers and the one-call converter.

Each ``MemSave*`` class subclasses its ``torch.nn`` counterpart (same constructor, same
parameters/buffers/state_dict) and only replaces ``forward`` with the primitive from
:mod:`torch_ref.memsave.functional`. ``convert(model)`` swaps every supported layer.
"""
from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn

from torch_ref.memsave import functional as MF

__all__ = [
    "SUPPORTED",
    "MemSaveBatchNorm1d",
    "MemSaveBatchNorm2d",
    "MemSaveBatchNorm3d",
    "MemSaveConv1d",
    "MemSaveConv2d",
    "MemSaveConv3d",
    "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d",
    "MemSaveConvTranspose3d",
    "MemSaveDropout",
    "MemSaveGroupNorm",
    "MemSaveLayerNorm",
    "MemSaveLinear",
    "MemSaveMaxPool1d",
    "MemSaveMaxPool2d",
    "MemSaveMaxPool3d",
    "MemSaveReLU",
    "convert",
]


class MemSaveLinear(nn.Linear):
    def forward(self, x):
        return MF.linear(x, self.weight, self.bias)


class _ConvMixin:
    def forward(self, x):
        if self.padding_mode != "zeros":
            # non-zero padding modes pad explicitly first, as torch does
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            pad = 0
        elif isinstance(self.padding, str):
            if self.padding == "valid":
                pad = 0
            else:  # 'same' (stride 1): torch pads asymmetrically when needed
                total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
                if all(t % 2 == 0 for t in total):
                    pad = tuple(t // 2 for t in total)
                else:
                    x = F.pad(x, self._reversed_padding_repeated_twice)
                    pad = 0
        else:
            pad = self.padding
        return MF.conv(x, self.weight, self.bias, self.stride, pad, self.dilation, self.groups)


class MemSaveConv1d(_ConvMixin, nn.Conv1d):
    pass


class MemSaveConv2d(_ConvMixin, nn.Conv2d):
    pass


class MemSaveConv3d(_ConvMixin, nn.Conv3d):
    pass


class _ConvTransposeMixin:
    def forward(self, x, output_size=None):
        if self.padding_mode != "zeros":
            raise ValueError("MemSaveConvTranspose supports only padding_mode='zeros'")
        nsp = x.dim() - 2
        out_pad = self._output_padding(x, output_size, self.stride, self.padding,
                                       self.kernel_size, nsp, self.dilation)
        return MF.conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                       self.groups, transposed=True, output_padding=tuple(out_pad))


class MemSaveConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    pass


class MemSaveConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    pass


class MemSaveConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    pass


class _BatchNormMixin:
    def forward(self, x):
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    momentum = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        rm = self.running_mean if (not self.training or self.track_running_stats) else None
        rv = self.running_var if (not self.training or self.track_running_stats) else None
        return MF.batch_norm(x, rm, rv, self.weight, self.bias, use_batch, momentum, self.eps)


class MemSaveBatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    pass


class MemSaveBatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    pass


class MemSaveBatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    pass


class MemSaveLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return MF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class MemSaveGroupNorm(nn.GroupNorm):
    def forward(self, x):
        return MF.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class MemSaveReLU(nn.ReLU):
    """``nn.ReLU`` storing a mask; ``packed=True`` packs it to 1 bit per element.
    ``inplace=True`` is accepted and computed out of place (same values)."""

    def __init__(self, inplace: bool = False, packed: bool = False):
        super().__init__(inplace)
        self.packed = packed

    def forward(self, x):
        return MF.relu(x, self.packed)


class _MaxPoolMixin:
    def forward(self, x):
        if self.return_indices:
            raise ValueError("MemSaveMaxPool does not support return_indices=True")
        return MF.max_pool(x, self.kernel_size, self.stride, self.padding, self.dilation,
                           self.ceil_mode)


class MemSaveMaxPool1d(_MaxPoolMixin, nn.MaxPool1d):
    pass


class MemSaveMaxPool2d(_MaxPoolMixin, nn.MaxPool2d):
    pass


class MemSaveMaxPool3d(_MaxPoolMixin, nn.MaxPool3d):
    pass


class MemSaveDropout(nn.Dropout):
    def forward(self, x):
        return MF.dropout(x, self.p, self.training)


#: torch.nn class -> memory-saving class (exact type match; subclasses are left alone).
SUPPORTED: dict[type, type] = {
    nn.Linear: MemSaveLinear,
    nn.Conv1d: MemSaveConv1d, nn.Conv2d: MemSaveConv2d, nn.Conv3d: MemSaveConv3d,
    nn.ConvTranspose1d: MemSaveConvTranspose1d, nn.ConvTranspose2d: MemSaveConvTranspose2d,
    nn.ConvTranspose3d: MemSaveConvTranspose3d,
    nn.BatchNorm1d: MemSaveBatchNorm1d, nn.BatchNorm2d: MemSaveBatchNorm2d,
    nn.BatchNorm3d: MemSaveBatchNorm3d,
    nn.LayerNorm: MemSaveLayerNorm, nn.GroupNorm: MemSaveGroupNorm,
    nn.ReLU: MemSaveReLU,
    nn.MaxPool1d: MemSaveMaxPool1d, nn.MaxPool2d: MemSaveMaxPool2d,
    nn.MaxPool3d: MemSaveMaxPool3d,
    nn.Dropout: MemSaveDropout,
}


def convert(model: nn.Module, *, inplace: bool = False, packed_relu: bool = False,
            layers: tuple[type, ...] | None = None) -> nn.Module:
    """Swap every supported layer of ``model`` for its memory-saving twin.

    Args:
      model: any ``torch.nn.Module`` (a supported layer itself is converted too).
      inplace: modify ``model`` (default: convert a deep copy, parameters copied).
      packed_relu: give ``MemSaveReLU`` 1-bit packed masks (default: bool masks, as the paper).
      layers: restrict to these ``torch.nn`` classes (e.g. ``(nn.Conv2d,)`` for the paper's
        "swap Convolution" row); default all of :data:`SUPPORTED`.

    Parameters, buffers and state_dict keys are unchanged (the classes are re-labelled).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"torch_ref.memsave.convert expects a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if layers is not None:
        bad = [c for c in layers if c not in SUPPORTED]
        if bad:
            raise ValueError(f"layers must be among {[c.__name__ for c in SUPPORTED]}, got "
                             f"{[getattr(c, '__name__', c) for c in bad]}")
    if not inplace:
        model = copy.deepcopy(model)
    wanted = SUPPORTED if layers is None else {c: SUPPORTED[c] for c in layers}
    for m in model.modules():
        new = wanted.get(type(m))
        if new is not None:
            m.__class__ = new
            if new is MemSaveReLU:
                m.packed = packed_relu
    return model
