"""Flax NNX drop-in: convert the layers of an existing NNX module in place.

``convert(module)`` walks the module graph and re-classes each supported layer to a subclass
of its own NNX class (same fields, same Variables; ``nnx.split``/``nnx.merge``, ``nnx.clone``,
``nnx.jit``, ``nnx.scan``, ``nnx.vmap``, ``nnx.remat`` see an ordinary NNX module whose
graphdef names the subclass):

* ``nnx.Linear`` / ``nnx.LinearGeneral`` get the selective ``dot_general``, ``nnx.Conv`` the
  selective ``conv_general_dilated``, ``nnx.ConvTranspose`` the selective ``conv_transpose``,
  ``nnx.Einsum`` a selective ``jnp.einsum``, and
  ``nnx.Embed.attend`` a selective ``query @ embedding.T``: each stores its input only if the
  weight is differentiated and its weight only if the input is (``y = f(x, W)`` is bilinear:
  ``dL/dx`` needs ``W``, ``dL/dW`` needs ``x``). ``nnx.Embed.__call__`` is a gather whose
  backward needs only the integer indices: there is nothing to save.
* ``nnx.BatchNorm`` / ``nnx.LayerNorm`` / ``nnx.RMSNorm`` / ``nnx.GroupNorm`` compute the
  same function with :mod:`jaxmem.selective.norm` (one input-sized residual; running
  statistics updated as NNX does). ``BatchNorm(axis_name=...)`` takes its batch statistics
  with ``lax.pmean`` over ``axis_name`` (NNX's formula).
* ``nnx.Dropout`` uses :func:`jaxmem.selective.dropout`: ``y = where(m, x / (1 - rate), 0)``
  with the same key and the same ``jax.random.bernoulli`` draw as NNX (identical outputs);
  backward regenerates ``m`` from the key instead of storing it.

A configuration the selective code cannot reproduce (``mask=``, a custom ``dot_general`` /
``einsum_op``, ``out_sharding``, ...) runs NNX's own code -- exact gradients, no saving --
with a :class:`SelectiveFallbackWarning`. Every converted layer reports what it did at trace
time to ``jaxmem.report`` (``status`` ``'converted'``, ``'fallback'`` or
``'nothing-to-save'``, with the reason).

Inline activations (``nnx.relu(x)``) are functions, not modules: they get the 1-bit masks
through :func:`jaxmem.nnx.convert` (which uses this module) or :func:`jaxmem.scope`.
Deprecated: ``convert`` and ``scope`` here; use :func:`jaxmem.nnx.convert` /
:func:`jaxmem.scope`.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import flax.nnx.nn.linear as _flax_nnx_linear
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from jaxmem import _deprecation
from jaxmem.selective import linear as _lin
from jaxmem.selective import norm as _norm
from jaxmem.selective.dropout import dropout as _dropout_fn
from jaxmem.selective.linen import (
    SelectiveFallbackWarning,
    _axes_tuple,
    _warn_fallback,
    selective_lax,
)

__all__ = ["SelectiveFallbackWarning", "einsum"]

_PATH_ATTR = "_jaxmem_path"


# ------------------------------------------------------------------------------ report
@functools.cache
def _recorder():
    try:
        from jaxmem._glue.report import record
    except ImportError:
        return None
    return record


def _base(m) -> type:
    """The NNX class a converted module derives from (also when ``jaxmem.nnx.convert``
    subclassed the converted layer again, as the root of what it converts)."""
    for cls in type(m).__mro__:
        if cls in _BASE:
            return _BASE[cls]
    return type(m)


def _record(m, status: str, reason: str = "") -> None:
    rec = _recorder()
    if rec is None:
        return
    rec(kind="module", target=f"flax.nnx.{_base(m).__name__}", technique="selective",
        status=status, reason=reason, path=getattr(m, _PATH_ATTR, None))


def _fallback(m, reason: str) -> None:
    """Record and warn (once per class and reason) that ``m`` runs NNX's own code."""
    _record(m, "fallback", reason)
    _warn_fallback(m, reason)


def _first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# ---------------------------------------------------------------- bilinear layers
def _note(m, converted: bool, reason: str) -> None:
    """Record ``m`` as converted, or as falling back (warned once) for ``reason``."""
    if converted:
        _record(m, "converted")
    else:
        _fallback(m, reason)


class _SelectiveLinear(nnx.Linear):
    def __call__(self, inputs, out_sharding=None):
        _note(self, self.dot_general is _lin.dot_general, "custom dot_general")
        return super().__call__(inputs, out_sharding=out_sharding)


class _SelectiveLinearGeneral(nnx.LinearGeneral):
    def __call__(self, inputs, out_sharding=None):
        _note(self, self.dot_general is _lin.dot_general and self.dot_general_cls is None,
              "custom dot_general")
        return super().__call__(inputs, out_sharding=out_sharding)


class _SelectiveConv(nnx.Conv):
    def __call__(self, inputs, out_sharding=None):
        _note(self, self.conv_general_dilated is _lin.conv_general_dilated,
              "custom conv_general_dilated")
        return super().__call__(inputs, out_sharding=out_sharding)


class _SelectiveConvTranspose(nnx.ConvTranspose):
    """``nnx.ConvTranspose`` with the selective ``conv_transpose`` (the layer calls
    ``lax.conv_transpose`` of its module, rebound for the call by ``selective_lax``)."""

    def __call__(self, inputs):
        _record(self, "converted")
        with selective_lax(_flax_nnx_linear):
            return super().__call__(inputs)


def einsum(subscripts: str, x: ArrayLike, w: ArrayLike, *, precision: Any = None,
           preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """Drop-in for ``jnp.einsum(subscripts, x, w)`` (as ``nnx.Einsum(einsum_op=...)``) that
    stores ``x`` only if ``w`` is differentiated and ``w`` only if ``x`` is (an einsum of two
    operands is linear in each). With ``out_sharding`` it is ``jnp.einsum`` itself."""
    if out_sharding is not None:
        return jnp.einsum(subscripts, x, w, precision=precision,
                          preferred_element_type=preferred_element_type,
                          out_sharding=out_sharding)
    fn = functools.partial(jnp.einsum, subscripts, precision=precision,
                           preferred_element_type=preferred_element_type)
    return _lin.bilinear(fn, x, w, name="einsum")


class _SelectiveEinsum(nnx.Einsum):
    def __call__(self, inputs, einsum_str=None, out_sharding=None):
        if self.einsum_op is not einsum:
            _fallback(self, "custom einsum_op")
        elif out_sharding is not None:
            _fallback(self, "called with out_sharding=")
        else:
            _record(self, "converted")
        return super().__call__(inputs, einsum_str, out_sharding=out_sharding)


class _SelectiveEmbed(nnx.Embed):
    def __call__(self, inputs, out_sharding=None):
        _record(self, "nothing-to-save",
                "a gather: its backward needs only the integer indices")
        return super().__call__(inputs, out_sharding=out_sharding)

    def attend(self, query, out_sharding=None):
        """``query @ embedding.T`` (NNX's ``attend``) with selective residuals."""
        why = None
        if out_sharding is not None:
            why = "attend called with out_sharding="
        elif jnp.ndim(query) < 1:
            why = "attend with a 0-d query"
        if why is None:
            q, emb = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
            if not (_is_float(q) and _is_float(emb)) or q.dtype != emb.dtype:
                why = "attend with non-float or mixed-dtype operands"
        if why:
            _fallback(self, why)
            return super().attend(query, out_sharding=out_sharding)
        _record(self, "converted")
        return _lin.dot_general(q, emb, (((q.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=q.dtype)


# -------------------------------------------------------------------------- dropout
class _SelectiveDropout(nnx.Dropout):
    def __call__(self, inputs, *, deterministic=None, rngs=None):
        det = _first(deterministic, self.deterministic)
        why = None
        if det is None or not isinstance(det, (bool, np.bool_)):
            why = "deterministic is not a Python bool"
        elif det or self.rate == 0.0:
            _record(self, "nothing-to-save", "deterministic or rate 0: the identity")
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        elif not isinstance(self.rate, (int, float)) or not 0.0 < self.rate < 1.0:
            why = f"rate {self.rate!r}"
        elif not _is_float(inputs):
            why = "non-float input"
        elif not _unsharded(inputs):
            why = "explicitly sharded input"
        stream = _first(rngs, self.rngs)
        if why is None and not isinstance(stream, (nnx.Rngs, nnx.RngStream, jax.Array)):
            why = "no usable rngs"
        if why:
            _fallback(self, why)
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        # the key NNX's Dropout would draw, from the same stream
        if isinstance(stream, nnx.Rngs):
            key = stream[self.rng_collection]()
        elif isinstance(stream, nnx.RngStream):
            key = stream()
        else:
            key = stream
        _record(self, "converted")
        return _dropout_fn(key, inputs, float(self.rate),
                           broadcast_dims=tuple(self.broadcast_dims))


def _unsharded(x) -> bool:
    try:
        mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
        return True
    return bool(getattr(mesh, "empty", True))


# ---------------------------------------------------------------------------- norms
def _why_norm(m, mask):
    if mask is not None:
        return "called with mask="
    return None


@functools.cache
def _bn_takes_axis_name() -> bool:
    return "axis_name" in inspect.signature(_norm.batch_norm).parameters


class _SelectiveBatchNorm(nnx.BatchNorm):
    def __call__(self, x, use_running_average=None, *, mask=None):
        ura = _first(use_running_average, self.use_running_average)
        if ura is None:  # NNX raises its own error
            return super().__call__(x, use_running_average, mask=mask)
        why = _why_norm(self, mask)
        if why is None and not isinstance(self.axis, int):
            why = "several feature axes"
        if why is None and self.axis_name is not None and not ura and \
                not _bn_takes_axis_name():
            why = "axis_name set (cross-device statistics)"
        if why is None and not _is_float(x):
            why = "non-float input"
        if why:
            _fallback(self, why)
            return super().__call__(x, use_running_average, mask=mask)
        _record(self, "converted")
        ax = self.axis % x.ndim
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
        if ura:
            return _norm.batch_norm(x, scale, bias, mean, var, train=False, eps=self.epsilon,
                                    axis=ax, dtype=self.dtype)[0]
        extra = {}
        if self.axis_name is not None:
            extra = {"axis_name": self.axis_name, "axis_index_groups": self.axis_index_groups}
        y, new_m, new_v = _norm.batch_norm(
            x, scale, bias, mean, var, train=True, momentum=self.momentum, eps=self.epsilon,
            axis=ax, dtype=self.dtype, fast_variance=self.use_fast_variance, **extra)
        # as NNX: the running statistics carry no gradient when they can be updated here
        if self.mean._can_update or self.var._can_update:
            new_m, new_v = jax.lax.stop_gradient(new_m), jax.lax.stop_gradient(new_v)
        self.mean[...] = new_m
        self.var[...] = new_v
        return y


class _SelectiveLayerNorm(nnx.LayerNorm):
    def __call__(self, x, *, mask=None):
        why = _why_norm(self, mask)
        if why is None and self.axis_name is not None:
            why = "axis_name set (cross-device statistics)"
        if why:
            _fallback(self, why)
            return super().__call__(x, mask=mask)
        _record(self, "converted")
        scale = self.scale[...] if self.scale else None
        bias = self.bias[...] if self.bias else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        red = _axes_tuple(self.reduction_axes)
        feat = _axes_tuple(self.feature_axes)
        return _norm.normalize(x, scale, bias, axes=red, feature_axes=feat, eps=self.epsilon,
                               fast_variance=self.use_fast_variance, dtype=self.dtype)[0]


class _SelectiveRMSNorm(nnx.RMSNorm):
    def __call__(self, x, *, mask=None):
        why = _why_norm(self, mask)
        if why is None and self.axis_name is not None:
            why = "axis_name set (cross-device statistics)"
        if why:
            _fallback(self, why)
            return super().__call__(x, mask=mask)
        _record(self, "converted")
        scale = self.scale[...] if self.scale else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        red = _axes_tuple(self.reduction_axes)
        feat = _axes_tuple(self.feature_axes)
        return _norm.normalize(x, scale, None, axes=red, feature_axes=feat, eps=self.epsilon,
                               subtract_mean=False, dtype=self.dtype)[0]


class _SelectiveGroupNorm(nnx.GroupNorm):
    def __call__(self, x, *, mask=None):
        why = _why_norm(self, mask)
        if why is None and self.axis_name is not None:
            why = "axis_name set (cross-device statistics)"
        if why is None and self.reduction_axes is not None:
            why = "custom reduction_axes"
        if why is None and (x.ndim < 2 or self.feature_axis not in (-1, x.ndim - 1)):
            why = "feature axis not last"
        if why:
            _fallback(self, why)
            return super().__call__(x, mask=mask)
        _record(self, "converted")
        scale = self.scale[...] if self.scale else None
        bias = self.bias[...] if self.bias else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return _norm.group_norm(x, scale, bias, num_groups=self.num_groups, eps=self.epsilon,
                                dtype=self.dtype, fast_variance=self.use_fast_variance)


# --------------------------------------------------------------------------- convert
_RECLASS = {
    nnx.Linear: _SelectiveLinear,
    nnx.LinearGeneral: _SelectiveLinearGeneral,
    nnx.Conv: _SelectiveConv,
    nnx.ConvTranspose: _SelectiveConvTranspose,
    nnx.Einsum: _SelectiveEinsum,
    nnx.Embed: _SelectiveEmbed,
    nnx.Dropout: _SelectiveDropout,
    nnx.BatchNorm: _SelectiveBatchNorm,
    nnx.LayerNorm: _SelectiveLayerNorm,
    nnx.RMSNorm: _SelectiveRMSNorm,
    nnx.GroupNorm: _SelectiveGroupNorm,
}
_BASE = {v: k for k, v in _RECLASS.items()}


def _path_str(path) -> str:
    return "/".join(str(p) for p in path)


def _supported_base(cls):
    """The NNX class of :data:`_RECLASS` that ``cls`` strictly subclasses (``None``: none,
    or ``cls`` is one of jaxmem's own classes or a subclass ``jaxmem.nnx.convert`` made of
    one)."""
    if (cls in _RECLASS or any(k in _BASE for k in cls.__mro__)
            or getattr(cls, "_jaxmem_watched_base", None)):
        return None
    for base in cls.__mro__[1:]:
        if base in _RECLASS:
            return base
    return None


def _watched_reduce_ex(self, protocol):
    from jaxmem._glue import pickling

    return pickling.reduce(self, protocol, "jaxmem.selective.nnx._watched_class",
                           (type(self)._jaxmem_watched_base,))


@functools.cache
def _watched_class(cls):
    """A subclass of ``cls`` (a user subclass of a supported NNX layer, e.g.
    ``nnx.LoRALinear``) that runs ``cls``'s own code and records a ``'fallback'`` entry at
    each call: its ``__call__`` may compute something the selective layer does not."""
    base = _supported_base(cls)
    target = f"{cls.__module__}.{cls.__qualname__}"
    reason = (f"subclass of nnx.{base.__name__}: its own code runs (jaxmem converts NNX's own "
              "layer classes only)")

    def __call__(self, *args, **kwargs):
        rec = _recorder()
        if rec is not None:
            rec(kind="module", target=target, technique="selective", status="fallback",
                reason=reason, path=getattr(self, _PATH_ATTR, None))
        return super(sub, self).__call__(*args, **kwargs)

    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "__call__": __call__, "_jaxmem_watched_base": cls,
          "__reduce_ex__": _watched_reduce_ex}
    sub = type(cls)(cls.__name__, (cls,), ns)
    return sub


def _convert(module: nnx.Module) -> nnx.Module:
    """Convert the supported layers of ``module`` in place (same Variables); returns it.

    The layer pass of :func:`jaxmem.nnx.convert`. Deprecated under its public name
    ``jaxmem.selective.nnx.convert``: use ``jaxmem.nnx.convert(module, fewbit=None,
    attention=False, copy=False)``.

    Idempotent. Only layers whose class is exactly one of NNX's (``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Conv``, ``nnx.ConvTranspose``, ``nnx.Einsum``, ``nnx.Embed``,
    ``nnx.Dropout``,
    ``nnx.BatchNorm``, ``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.GroupNorm``) are
    converted; subclasses of them (``nnx.LoRALinear``, a user's own) run their own code and
    are listed as ``'fallback'`` in :func:`jaxmem.report` at each call (their class becomes
    a subclass that records the call and can be pickled).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            "jaxmem.selective.nnx.convert: module must be a flax.nnx.Module, got "
            f"{type(module).__module__}.{type(module).__name__}; for flax.linen modules use "
            "jaxmem.linen.convert")
    for path, m in nnx.iter_graph(module):
        if not isinstance(m, nnx.Module):
            continue
        cls = type(m)
        if cls not in _RECLASS:  # already converted, or not an NNX layer we convert
            if _supported_base(cls) is not None:  # a user subclass: reported, left as is
                m.__class__ = _watched_class(cls)
                setattr(m, _PATH_ATTR, _path_str(path))
            continue
        default_dot = (m.dot_general is jax.lax.dot_general if cls is nnx.Linear else
                       cls is nnx.LinearGeneral and m.dot_general is None
                       and m.dot_general_cls is None)
        if default_dot:
            m.dot_general = _lin.dot_general
        elif cls is nnx.Conv and m.conv_general_dilated is jax.lax.conv_general_dilated:
            m.conv_general_dilated = _lin.conv_general_dilated
        elif cls is nnx.Einsum and m.einsum_op is jnp.einsum:
            m.einsum_op = einsum
        m.__class__ = _RECLASS[cls]
        setattr(m, _PATH_ATTR, _path_str(path))
    return module


__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.nnx", {
    "convert": ("jaxmem.selective.nnx:_convert",
                "jaxmem.nnx.convert(module, fewbit=None, attention=False, copy=False)"),
    "scope": ("jaxmem.selective.patch:_patch_functions",
              "jaxmem.scope(fewbit=None, attention=False)"),
})
