"""TorchBatchNorm: a BatchNorm whose statistics match ``torch.nn.BatchNorm2d`` exactly.

Forward (train mode), over every axis but the last (features) one, with ``n`` the number of
elements reduced per feature::

    mu    = mean(x)
    var   = mean((x - mu)**2)                    # biased: used to normalise
    y     = (x - mu) * rsqrt(var + eps) * scale + bias
    mean' = momentum * mean + (1 - momentum) * mu
    var'  = momentum * var  + (1 - momentum) * var * n / (n - 1)   # UNBIASED, as torch

Eval mode uses the running ``mean``/``var``. Flax's ``nn.BatchNorm`` updates the running
variance with the *biased* batch variance; torch uses the unbiased one, so the two drift apart
after one training step. This module uses torch's rule so that transferred models keep
identical running statistics. ``momentum`` follows the flax convention (weight of the old
value): flax ``momentum = 1 - torch momentum``, so the default 0.9 is torch's 0.1. ``epsilon``
defaults to torch's 1e-5. Variable names match flax's BatchNorm (params ``scale``/``bias``,
batch_stats ``mean``/``var``). Statistics are computed in float32 for half-precision inputs.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class TorchBatchNorm(nn.Module):
    """Torch-exact BatchNorm over the last axis (NHWC / NC inputs).

    Attributes:
      momentum: flax convention, weight of the old running value (torch 0.1 == 0.9 here).
      epsilon: added to the variance (torch default 1e-5).
      dtype: output dtype (default: the input's dtype).

    Call: ``bn(x, train)``. ``train=True`` normalises with batch statistics and, unless the
    module is initialising, updates ``batch_stats`` (apply with ``mutable=['batch_stats']``);
    ``train=False`` uses the running statistics.
    """

    momentum: float = 0.9
    epsilon: float = 1e-5
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool):
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"TorchBatchNorm: momentum must be in [0, 1] (flax convention), got {self.momentum}")
        feat = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (feat,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (feat,), jnp.float32)
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((feat,), jnp.float32))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((feat,), jnp.float32))
        out_dtype = self.dtype if self.dtype is not None else x.dtype
        stat_dtype = jnp.promote_types(x.dtype, jnp.float32)
        xs = x.astype(stat_dtype)
        if train:
            axes = tuple(range(x.ndim - 1))
            n = 1
            for a in axes:
                n *= x.shape[a]
            if n <= 1:
                raise ValueError(
                    "TorchBatchNorm: train=True needs more than 1 value per channel "
                    f"(input shape {x.shape}), as torch.nn.BatchNorm2d")
            mu = jnp.mean(xs, axis=axes)
            var = jnp.mean(jnp.square(xs - mu), axis=axes)
            if not self.is_initializing():
                m = self.momentum
                ra_mean.value = (m * ra_mean.value + (1.0 - m) * mu).astype(ra_mean.value.dtype)
                unbiased = var * (n / (n - 1))
                ra_var.value = (m * ra_var.value + (1.0 - m) * unbiased).astype(ra_var.value.dtype)
        else:
            mu = ra_mean.value.astype(stat_dtype)
            var = ra_var.value.astype(stat_dtype)
        inv = jnp.reciprocal(jnp.sqrt(var + self.epsilon))
        y = (xs - mu) * (inv * scale.astype(stat_dtype)) + bias.astype(stat_dtype)
        return y.astype(out_dtype)
