"""Flax NNX drop-in: swap layers of an existing NNX module in place.

``convert(module)`` walks the module graph and, sharing the very same Variables:

* gives every ``nnx.Linear`` the selective ``dot_general`` and every ``nnx.Conv`` the
  selective ``conv_general_dilated`` (their own constructor hooks);
* re-classes every ``nnx.BatchNorm`` / ``nnx.LayerNorm`` / ``nnx.RMSNorm`` / ``nnx.GroupNorm``
  to a subclass whose ``__call__`` computes the same function with
  :mod:`jaxmem.selective.norm` (running statistics updated as NNX does). ``mask=``,
  ``axis_name`` and custom GroupNorm ``reduction_axes`` fall back to NNX's own code (exact
  gradients, no saving) with a ``SelectiveFallbackWarning``.

Inline activations (``nnx.relu(x)``) are functions, not modules: trace the model inside
``jaxmem.selective.nnx.scope()`` (the scoped function patch) to get the 1-bit masks.
``convert`` returns the module (modified in place) and raises ``TypeError`` for anything
that is not an ``nnx.Module``.
"""
from __future__ import annotations

from flax import nnx

from jaxmem.selective import linear as _lin
from jaxmem.selective import norm as _norm
from jaxmem.selective.linen import SelectiveFallbackWarning, _axes_tuple, _warn_fallback
from jaxmem.selective.patch import patch_functions as scope

__all__ = ["SelectiveFallbackWarning", "convert", "scope"]


def _first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


class _SelectiveBatchNorm(nnx.BatchNorm):
    def __call__(self, x, use_running_average=None, *, mask=None):
        ura = _first(use_running_average, self.use_running_average)
        why = _why(self, mask)
        if why or ura is None:
            if why:
                _warn_fallback(self, why)
            return super().__call__(x, use_running_average, mask=mask)
        feat = (self.axis % x.ndim,) if isinstance(self.axis, int) else None
        if feat is None or len(feat) != 1:
            return super().__call__(x, use_running_average, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
        if ura:
            return _norm.batch_norm(x, scale, bias, mean, var, train=False, eps=self.epsilon,
                                    axis=feat[0], dtype=self.dtype)[0]
        y, new_m, new_v = _norm.batch_norm(
            x, scale, bias, mean, var, train=True, momentum=self.momentum, eps=self.epsilon,
            axis=feat[0], dtype=self.dtype, fast_variance=self.use_fast_variance)
        self.mean[...] = new_m
        self.var[...] = new_v
        return y


class _SelectiveLayerNorm(nnx.LayerNorm):
    def __call__(self, x, *, mask=None):
        why = _why(self, mask)
        if why:
            _warn_fallback(self, why)
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale else None
        bias = self.bias[...] if self.bias else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        red = _axes_tuple(self.reduction_axes)
        feat = _axes_tuple(self.feature_axes)
        return _norm.normalize(x, scale, bias, axes=red, feature_axes=feat, eps=self.epsilon,
                               fast_variance=self.use_fast_variance, dtype=self.dtype)[0]


class _SelectiveRMSNorm(nnx.RMSNorm):
    def __call__(self, x, *, mask=None):
        why = _why(self, mask)
        if why:
            _warn_fallback(self, why)
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        red = _axes_tuple(self.reduction_axes)
        feat = _axes_tuple(self.feature_axes)
        return _norm.normalize(x, scale, None, axes=red, feature_axes=feat, eps=self.epsilon,
                               subtract_mean=False, dtype=self.dtype)[0]


class _SelectiveGroupNorm(nnx.GroupNorm):
    def __call__(self, x, *, mask=None):
        why = _why(self, mask)
        if why is None and self.reduction_axes is not None:
            why = "custom reduction_axes"
        if why is None and (x.ndim < 2 or self.feature_axis not in (-1, x.ndim - 1)):
            why = "feature axis not last"
        if why:
            _warn_fallback(self, why)
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale else None
        bias = self.bias[...] if self.bias else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return _norm.group_norm(x, scale, bias, num_groups=self.num_groups, eps=self.epsilon,
                                dtype=self.dtype, fast_variance=self.use_fast_variance)


def _why(m, mask):
    if mask is not None:
        return "called with mask="
    if getattr(m, "axis_name", None) is not None:
        return "axis_name set (cross-device statistics)"
    return None


_RECLASS = {nnx.BatchNorm: _SelectiveBatchNorm, nnx.LayerNorm: _SelectiveLayerNorm,
            nnx.RMSNorm: _SelectiveRMSNorm, nnx.GroupNorm: _SelectiveGroupNorm}


def convert(module: nnx.Module) -> nnx.Module:
    """Swap supported layers of ``module`` in place (same Variables); returns ``module``."""
    if not isinstance(module, nnx.Module):
        raise TypeError(
            "jaxmem.selective.nnx.convert expects a flax.nnx.Module, got "
            f"{type(module).__module__}.{type(module).__name__}; for flax.linen modules use "
            "jaxmem.selective.linen.convert")
    for _, m in nnx.iter_graph(module):
        if not isinstance(m, nnx.Module):
            continue
        if type(m) is nnx.Linear and m.dot_general is not None:
            if m.dot_general is _lin.dot_general or _is_default(m.dot_general, "dot_general"):
                m.dot_general = _lin.dot_general
        elif type(m) is nnx.Conv:
            if _is_default(m.conv_general_dilated, "conv_general_dilated"):
                m.conv_general_dilated = _lin.conv_general_dilated
        elif type(m) in _RECLASS:
            m.__class__ = _RECLASS[type(m)]
    return module


def _is_default(fn, name):
    import jax
    return fn is getattr(jax.lax, name)
