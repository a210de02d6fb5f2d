"""Small helpers shared by the JAX twin models."""
from __future__ import annotations


def scaled(channels: int, width: float) -> int:
    """``max(1, round(channels * width))``: a channel count under a width multiplier."""
    if not (isinstance(width, (int, float)) and width > 0):
        raise ValueError(f"width must be a positive number (a multiplier), got {width!r}")
    return max(1, round(channels * width))


def check_channels(x, expected: int, model: str) -> None:
    """Raise a clear ValueError when an NHWC input has the wrong channel count."""
    if x.ndim != 4:
        raise ValueError(f"{model}: input must be NHWC (4-D), got shape {tuple(x.shape)}")
    if x.shape[-1] != expected:
        raise ValueError(
            f"{model}: input has {x.shape[-1]} channels (last axis, NHWC), expected {expected}")
