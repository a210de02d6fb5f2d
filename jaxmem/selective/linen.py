"""Flax Linen handlers of the selective part, and its compatibility entry points.

The one way in is :func:`jaxmem.linen.convert` / :func:`jaxmem.scope`; this module registers
what the selective part does with Linen layers inside a scope (``register_module``):

* ``nn.Dense`` / ``nn.DenseGeneral`` (any axes) / ``nn.Conv`` get the selective
  ``dot_general`` / ``conv_general_dilated`` (their fields, set for the duration of the call;
  modules that already set a custom one are left alone); ``nn.Einsum`` runs its einsum with
  the selective ``dot_general``; ``nn.Embed.attend`` is a selective ``dot_general``
  (``nn.Embed.__call__`` is a gather: its backward keeps only the integer indices, nothing to
  save); ``nn.ConvTranspose`` gets the selective ``conv_transpose`` (its module's ``lax`` is
  rebound for the duration of the call: every padding mode, ``transpose_kernel``, ``mask``);
* ``nn.BatchNorm`` (also with ``axis_name``: cross-replica statistics), ``nn.LayerNorm``,
  ``nn.GroupNorm``, ``nn.RMSNorm`` and ``jaxmem.models.TorchBatchNorm`` are computed by
  :mod:`jaxmem.selective.norm` with the module's own parameters and running statistics;
  configurations the selective norm cannot reproduce (``mask=``, non-default
  ``force_float32_reductions``, custom group reduction axes) fall back to the module's own
  code -- correct gradients, no saving -- and say so with a
  :class:`SelectiveFallbackWarning` (once per module class and reason) and in
  :func:`jaxmem.report`;
* ``nn.Dropout`` uses :func:`jaxmem.selective.dropout` with the module's rng stream.

Inline functions (``nn.relu``, ``nn.max_pool``, ...) are registered in
:mod:`jaxmem.selective.patch`. Arguments of a call are never mutated.

Deprecated: ``convert``, ``scope`` and ``wrap`` here (the selective-only forms); use
:func:`jaxmem.linen.convert` / :func:`jaxmem.scope` with ``fewbit=None, attention=False``.

Everything is interception at trace time: wrap the *traced* function (``jax.jit`` it
outside or inside the scope; a function already compiled outside the scope keeps its old
trace). Forward-mode ``jax.jvp`` (and ``jax.jacfwd``, forward-over-reverse Hessian-vector
products) through selective layers is not supported: they are ``jax.custom_vjp`` functions
and JAX raises ``TypeError: can't apply forward-mode autodiff (jvp) to a custom_vjp
function``. Use the unconverted model for those (same parameters); reverse mode, including
reverse-over-reverse, works.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import flax.linen.linear as _flax_linear
import jax.numpy as jnp
from jax import lax as _lax

from jaxmem import _deprecation
from jaxmem._glue import options as _options
from jaxmem._glue import patch as _gpatch
from jaxmem._glue import report as _report
from jaxmem.selective import linear as _lin
from jaxmem.selective import norm as _norm
from jaxmem.selective.dropout import dropout as _dropout_fn

__all__ = ["SelectiveFallbackWarning"]


class SelectiveFallbackWarning(UserWarning):
    """A converted module ran its own (Flax) code because the selective primitive cannot
    reproduce its configuration: gradients are exact, but nothing is saved for that module."""


_warned: set = set()


def _warn_fallback(m, reason):
    """Warn (once per module class and reason) that ``m`` runs its own Flax code."""
    name = type(m).__name__.replace("_Selective", "")
    key = (name, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"jaxmem.selective: {name} ({reason}) is not converted; it runs Flax's own code "
            "(exact gradients, no memory saving).", SelectiveFallbackWarning, stacklevel=4)


def _fallback(m, reason, next_fun, args, kwargs):
    """Run the module's own code, with a :class:`SelectiveFallbackWarning`."""
    _warn_fallback(m, reason)
    _record(m, "fallback", reason)
    return next_fun(*args, **kwargs)


def _record(m, status, reason="", method=None):
    target = type(m).__name__ + ("" if method is None else f".{method}")
    _report.record(kind="module", target=target, technique="selective", status=status,
                   reason=reason)


def _converted(m, method=None):
    _record(m, "converted", method=method)


def _own_code(m, reason, next_fun, args, kwargs, status="fallback"):
    """Run the module's own code (no warning: Flax raises its own error or nothing is
    lost), noting why in the report."""
    _record(m, status, reason)
    return next_fun(*args, **kwargs)

# ------------------------------------------------------------------- method interceptor
@contextlib.contextmanager
def _swap_field(module, field, value):
    old = getattr(module, field)
    object.__setattr__(module, field, value)
    try:
        yield
    finally:
        object.__setattr__(module, field, old)


def _dense(m, next_fun, args, kwargs):
    if m.dot_general is not None or m.dot_general_cls is not None:
        return _own_code(m, "custom dot_general set", next_fun, args, kwargs)
    _converted(m)
    with _swap_field(m, "dot_general", _lin.dot_general):
        return next_fun(*args, **kwargs)


def _conv(m, next_fun, args, kwargs):
    if m.conv_general_dilated is not None or m.conv_general_dilated_cls is not None:
        return _own_code(m, "custom conv_general_dilated set", next_fun, args, kwargs)
    _converted(m)
    with _swap_field(m, "conv_general_dilated", _lin.conv_general_dilated):
        return next_fun(*args, **kwargs)


class _LaxWithSelectiveConvTranspose:
    """``jax.lax`` with ``conv_transpose`` replaced by the selective one (everything else is
    looked up in ``jax.lax``)."""

    def __getattr__(self, name):
        return getattr(_lax, name)

    @staticmethod
    def conv_transpose(lhs, rhs, strides, padding, rhs_dilation=None, dimension_numbers=None,
                       transpose_kernel=False, precision=None, preferred_element_type=None):
        import functools
        fn = functools.partial(
            _lax.conv_transpose, strides=tuple(strides), padding=padding,
            rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
            dimension_numbers=dimension_numbers, transpose_kernel=transpose_kernel,
            precision=precision, preferred_element_type=preferred_element_type)
        return _lin.bilinear(fn, lhs, rhs, name="conv_transpose")


_LAX_PROXY = _LaxWithSelectiveConvTranspose()
_lax_lock = threading.RLock()


@contextlib.contextmanager
def selective_lax(flax_module: Any) -> Iterator[None]:
    """Within the block, ``flax_module.lax`` (a Flax layer module's ``from jax import lax``) is
    ``jax.lax`` with the selective ``conv_transpose``; Flax's ``ConvTranspose`` layers call
    ``lax.conv_transpose`` directly and have no field to swap. Re-entrant; serialised by a lock
    (the attribute is module-global); restored on exit, also on error."""
    with _lax_lock:
        old = flax_module.lax
        flax_module.lax = _LAX_PROXY
        try:
            yield
        finally:
            flax_module.lax = old


def _conv_transpose(m, next_fun, args, kwargs):
    _converted(m)
    with selective_lax(_flax_linear):
        return next_fun(*args, **kwargs)


def _first_arg(args, kwargs, name="inputs"):
    """``(x, other positional args, a *copy* of kwargs without x)``: never mutates the
    caller's ``kwargs``."""
    kwargs = dict(kwargs)
    if args:
        return args[0], args[1:], kwargs
    if name not in kwargs:
        return None, (), kwargs
    return kwargs.pop(name), (), kwargs


def _feature_params(m, x, feature_axes):
    feature_axes = tuple(a % x.ndim for a in feature_axes)
    shape = [x.shape[a] for a in feature_axes]
    scale = m.param("scale", m.scale_init, shape, m.param_dtype) if m.use_scale else None
    bias = (m.param("bias", m.bias_init, shape, m.param_dtype)
            if getattr(m, "use_bias", False) else None)
    return scale, bias


def _norm_fallback_reason(m, kwargs, sync_ok=False):
    """Why the selective norm cannot stand in for ``m`` (``None``: it can)."""
    if kwargs.get("mask") is not None:
        return "called with mask="
    if getattr(m, "axis_name", None) is not None and not sync_ok:
        return "axis_name set (cross-device statistics)"
    if not getattr(m, "force_float32_reductions", True):
        return "force_float32_reductions=False"
    return None


def _axes_tuple(a):
    return (a,) if isinstance(a, int) else tuple(a)


def _flax_layer_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest or x is None else _norm_fallback_reason(m, kw)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    _converted(m)
    red = _axes_tuple(m.reduction_axes)
    feat = _axes_tuple(m.feature_axes)
    scale, bias = _feature_params(m, x, feat)
    return _norm.normalize(x, scale, bias, axes=red, feature_axes=feat, eps=m.epsilon,
                           fast_variance=m.use_fast_variance, dtype=m.dtype)[0]


def _flax_rms_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest or x is None else _norm_fallback_reason(m, kw)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    _converted(m)
    red = _axes_tuple(m.reduction_axes)
    feat = _axes_tuple(m.feature_axes)
    fa = tuple(a % x.ndim for a in feat)
    shape = [x.shape[a] for a in fa]
    scale = m.param("scale", m.scale_init, shape, m.param_dtype) if m.use_scale else None
    return _norm.normalize(x, scale, None, axes=red, feature_axes=feat, eps=m.epsilon,
                           subtract_mean=False, dtype=m.dtype)[0]


def _flax_group_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest or x is None else _norm_fallback_reason(m, kw)
    if why is None and m.reduction_axes is not None:
        why = "custom reduction_axes"
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    c = x.shape[-1]
    groups = m.num_groups
    if m.group_size is not None:
        if groups is not None or c % m.group_size:
            return _own_code(m, "invalid group configuration", next_fun, args, kwargs)
        groups = c // m.group_size
    if groups is None or c % groups or x.ndim < 2:
        return _own_code(m, "invalid group configuration", next_fun, args, kwargs)
    _converted(m)
    scale, bias = _feature_params(m, x, (-1,))
    return _norm.group_norm(x, scale, bias, num_groups=groups, eps=m.epsilon, dtype=m.dtype,
                            fast_variance=m.use_fast_variance)


def _flax_batch_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    ura = kw.pop("use_running_average", rest[0] if rest else None)
    if x is None or len(rest) > 1 or set(kw) - {"mask"}:
        why = "extra arguments"
    else:
        why = _norm_fallback_reason(m, kw, sync_ok=True)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    ura = nn.merge_param("use_running_average", m.use_running_average, ura)
    feat = tuple(a % x.ndim for a in _axes_tuple(m.axis))
    if len(feat) != 1:
        return _fallback(m, "several feature axes", next_fun, args, kwargs)
    (ax,) = feat
    c = x.shape[ax]
    _converted(m)
    ra_mean = m.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
    ra_var = m.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
    scale, bias = _feature_params(m, x, feat)
    if ura:
        y, _, _ = _norm.batch_norm(x, scale, bias, ra_mean.value, ra_var.value, train=False,
                                   eps=m.epsilon, axis=ax, dtype=m.dtype)
        return y
    y, mean, var = _norm.batch_norm(
        x, scale, bias, None, None, train=True, eps=m.epsilon, axis=ax, dtype=m.dtype,
        fast_variance=m.use_fast_variance, axis_name=m.axis_name,
        axis_index_groups=m.axis_index_groups)
    # Flax's update, with its dtype promotion (float64 statistics under jax_enable_x64)
    ra_mean.value = m.momentum * ra_mean.value + (1 - m.momentum) * mean
    ra_var.value = m.momentum * ra_var.value + (1 - m.momentum) * var
    return y


def _twin_batch_norm(m, next_fun, args, kwargs):
    """``jaxmem.models.TorchBatchNorm`` (torch-exact twin): two-pass variance, ``1/sqrt``,
    unbiased running variance, output in ``m.dtype`` or the input dtype."""
    x, rest, kw = _first_arg(args, kwargs, "x")
    train = kw.pop("train", rest[0] if rest else None)
    if x is None or not isinstance(train, bool) or kw or len(rest) > 1:
        return _own_code(m, "train is not a Python bool or extra arguments", next_fun, args,
                         kwargs)
    c = x.shape[-1]
    if train:
        n = x.size // c
        if n <= 1:
            return next_fun(*args, **kwargs)  # let the module raise its own error
    _converted(m)
    axis_name = getattr(m, "axis_name", None)
    scale = m.param("scale", nn.initializers.ones, (c,), jnp.float32)
    bias = m.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    ra_mean = m.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32))
    ra_var = m.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32))
    out_dtype = m.dtype if m.dtype is not None else x.dtype
    y, new_m, new_v = _norm.batch_norm(
        x, scale, bias, ra_mean.value, ra_var.value, train=train, momentum=m.momentum,
        eps=m.epsilon, axis=-1, dtype=out_dtype, fast_variance=False, inv_mode="recip_sqrt",
        unbiased_running_var=True, axis_name=axis_name)
    if train:
        ra_mean.value = new_m
        ra_var.value = new_v
    return y


def _flax_dropout(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "inputs")
    det = kw.pop("deterministic", rest[0] if rest else None)
    rng = kw.pop("rng", rest[1] if len(rest) > 1 else None)
    if x is None or kw or len(rest) > 2 or not jnp.issubdtype(jnp.result_type(x),
                                                              jnp.floating):
        return _own_code(m, "non-float input or extra arguments", next_fun, args, kwargs)
    det = nn.merge_param("deterministic", m.deterministic, det)
    if det or m.rate == 0.0 or m.rate == 1.0:
        return _own_code(m, "deterministic / rate 0 or 1: nothing stored", next_fun, args,
                         kwargs, status="nothing-to-save")
    _converted(m)
    if rng is None:
        rng = m.make_rng(m.rng_collection)
    return _dropout_fn(rng, x, m.rate, broadcast_dims=tuple(m.broadcast_dims))


def _embed(m, next_fun, args, kwargs):
    """``nn.Embed.__call__`` is a gather: its backward keeps only the integer indices."""
    return _own_code(m, "gather: the backward keeps only the integer indices", next_fun,
                     args, kwargs, status="nothing-to-save")


def _embed_attend(m, next_fun, args, kwargs):
    """``nn.Embed.attend``: ``query @ embedding.T`` with the selective ``dot_general``."""
    q, rest, kw = _first_arg(args, kwargs, "query")
    if q is None or rest or kw:
        _record(m, "fallback", "extra arguments", method="attend")
        return next_fun(*args, **kwargs)
    _converted(m, method="attend")
    q, emb = m.promote_dtype(q, m.embedding, dtype=m.dtype)
    return _lin.dot_general(q, emb, (((q.ndim - 1,), (1,)), ((), ())))


def _einsum(m, next_fun, args, kwargs):
    """``nn.Einsum``: Flax's arithmetic with ``jnp.einsum(..., _dot_general=selective)``."""
    x, rest, kw = _first_arg(args, kwargs, "inputs")
    eq = kw.pop("einsum_str", rest[0] if rest else None)
    if x is None or kw or len(rest) > 1:
        return _own_code(m, "extra arguments", next_fun, args, kwargs)
    try:
        eq = nn.merge_param("einsum_str", m.einsum_str, eq).replace(" ", "")
    except Exception:  # noqa: BLE001 - Flax raises its own error
        return next_fun(*args, **kwargs)
    if "->" not in eq or eq.count(",") != 1:
        return next_fun(*args, **kwargs)  # Flax raises its own error
    _converted(m)
    kernel = m.param("kernel", m.kernel_init, m.shape, m.param_dtype)
    if m.use_bias:
        bias_shape, bshape = m._get_bias_shape(eq, x, kernel)
        bias = m.param("bias", m.bias_init, bias_shape, m.param_dtype)
    else:
        bias = None
    x, kernel, bias = m.promote_dtype(x, kernel, bias, dtype=m.dtype)
    y = jnp.einsum(eq, x, kernel, precision=m.precision,
                   preferred_element_type=m.preferred_element_type,
                   _dot_general=_lin.dot_general)
    if bias is not None:
        y += jnp.reshape(bias, bshape)
    return y


def _twin_bn_class():
    from jaxmem.models.batchnorm import TorchBatchNorm

    return TorchBatchNorm


def _register():
    reg = _gpatch.register_module
    reg("selective", lambda m: isinstance(m, (nn.Dense, nn.DenseGeneral)), _dense)
    reg("selective", lambda m: isinstance(m, nn.Conv) and getattr(m, "shared_weights", True),
        _conv)
    reg("selective", lambda m: isinstance(m, nn.ConvTranspose), _conv_transpose)
    reg("selective", lambda m: isinstance(m, nn.BatchNorm), _flax_batch_norm)
    reg("selective", lambda m: isinstance(m, nn.LayerNorm), _flax_layer_norm)
    reg("selective", lambda m: isinstance(m, nn.RMSNorm), _flax_rms_norm)
    reg("selective", lambda m: isinstance(m, nn.GroupNorm), _flax_group_norm)
    reg("selective", lambda m: isinstance(m, nn.Dropout), _flax_dropout)
    reg("selective", lambda m: isinstance(m, nn.Embed), _embed)
    reg("selective", lambda m: isinstance(m, nn.Einsum), _einsum)
    twin = _twin_bn_class()
    reg("selective", lambda m: type(m) is twin, _twin_batch_norm)
    reg("selective", lambda m: isinstance(m, nn.Embed), _embed_attend, method="attend")


_register()


# ------------------------------------------------------------------------- public API
def _selective_options(functions=True):
    only = frozenset({"selective"} if functions else {"selective:modules"})
    return _options.Options(selective=True, fewbit=None, attention=False, only=only)


@contextlib.contextmanager
def _scope(functions: bool = True) -> Iterator[None]:
    """Deprecated: use ``jaxmem.scope(fewbit=None, attention=False)``.

    Within this context, Linen modules (and, with ``functions``, the inline
    activations / pooling) trace to the selective primitives: ``jaxmem.scope(selective=True,
    fewbit=None, attention=False)`` restricted to the selective part (so it composes with
    enclosing scopes). Re-entrant and thread-safe."""
    with _gpatch.scope_options(_selective_options(functions),
                               label="jaxmem.selective.linen.scope"):
        yield


def _wrap(fn: Callable) -> Callable:
    """Deprecated: call ``fn`` inside ``jaxmem.scope(fewbit=None, attention=False)``.

    Decorator: run ``fn`` (e.g. a loss that calls ``model.apply``) inside ``scope()``."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _scope():
            return fn(*args, **kwargs)

    return wrapped


def _convert(model: nn.Module) -> nn.Module:
    """Deprecated: use ``jaxmem.linen.convert(model, fewbit=None, attention=False)``.

    The selective part of :func:`jaxmem.linen.convert`: a real Linen Module (same fields,
    same parameter tree) whose calls store only what requested gradients need; functions
    and layers of other parts are left to enclosing scopes.

    Raises ``TypeError`` for anything that is not a ``flax.linen.Module`` (for NNX modules
    use :func:`jaxmem.nnx.convert`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "jaxmem.selective.linen.convert: model must be a flax.linen.Module, got "
            f"{type(model).__module__}.{type(model).__name__}; for flax.nnx modules use "
            "jaxmem.nnx.convert")
    from jaxmem import linen as _jl
    return _jl._convert_with(model, _selective_options(True))


__getattr__ = _deprecation.deprecated_attributes("jaxmem.selective.linen", {
    "convert": ("jaxmem.selective.linen:_convert",
                "jaxmem.linen.convert(model, fewbit=None, attention=False)"),
    "scope": ("jaxmem.selective.linen:_scope", "jaxmem.scope(fewbit=None, attention=False)"),
    "wrap": ("jaxmem.selective.linen:_wrap",
             "a call inside jaxmem.scope(fewbit=None, attention=False)"),
})
