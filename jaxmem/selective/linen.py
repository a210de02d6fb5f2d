"""Flax Linen drop-in: run an existing model with the selective primitives.

``convert(model)`` returns a thin wrapper whose ``apply`` runs ``model.apply`` inside
:func:`scope`; parameters and their tree are untouched, ``init`` is passed through. Inside
``scope()``:

* ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` get the selective ``dot_general`` /
  ``conv_general_dilated`` (their ``dot_general`` / ``conv_general_dilated`` fields, set for
  the duration of the call; modules that already set a custom one are left alone);
  ``nn.ConvTranspose`` gets the selective ``conv_transpose`` (its module's ``lax`` is
  rebound for the duration of the call: every padding mode, ``transpose_kernel``, ``mask``);
* ``nn.BatchNorm``, ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` and
  ``jaxmem.models.BatchNorm`` are computed by :mod:`jaxmem.selective.norm` with the
  module's own parameters and running statistics (running statistics are updated the way the
  module would); configurations the selective norm cannot reproduce (``mask=``,
  ``axis_name``, non-default ``force_float32_reductions``, custom group reduction axes) fall
  back to the module's own code -- correct gradients, no saving -- and say so with a
  :class:`SelectiveFallbackWarning` (once per module class and reason);
* ``nn.Dropout`` uses :func:`jaxmem.selective.dropout` with the module's rng stream;
* the inline functions ``nn.relu``/``jax.nn.relu``, ``leaky_relu``, ``relu6``,
  ``hard_tanh`` and ``nn.max_pool`` are patched (scoped, restored on exit) to the 1-bit /
  packed-argmax versions.

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

import flax.linen as nn
import flax.linen.linear as _flax_linear
import jax.numpy as jnp
from jax import lax as _lax

from jaxmem.selective import linear as _lin
from jaxmem.selective import norm as _norm
from jaxmem.selective import patch as _patch
from jaxmem.selective.dropout import dropout as _dropout_fn

__all__ = ["SelectiveFallbackWarning", "SelectiveModel", "convert", "scope", "wrap"]


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


def _interceptor(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name != "__call__" or m.is_initializing():
        return next_fun(*args, **kwargs)
    handler = _handler_for(m)
    if handler is None:
        return next_fun(*args, **kwargs)
    return handler(m, next_fun, args, kwargs)


def _handler_for(m):
    if isinstance(m, (nn.Dense, nn.DenseGeneral)):
        return _dense
    if isinstance(m, nn.Conv) and getattr(m, "shared_weights", True):
        return _conv
    if isinstance(m, nn.ConvTranspose):
        return _conv_transpose
    if isinstance(m, nn.BatchNorm):
        return _flax_batch_norm
    if isinstance(m, nn.LayerNorm):
        return _flax_layer_norm
    if isinstance(m, nn.RMSNorm):
        return _flax_rms_norm
    if isinstance(m, nn.GroupNorm):
        return _flax_group_norm
    if isinstance(m, nn.Dropout):
        return _flax_dropout
    try:
        from jaxmem.models.batchnorm import BatchNorm as TwinBN
    except ImportError:  # pragma: no cover
        TwinBN = None
    if TwinBN is not None and type(m) is TwinBN:
        return _twin_batch_norm
    return None


def _dense(m, next_fun, args, kwargs):
    if m.dot_general is not None or m.dot_general_cls is not None:
        return next_fun(*args, **kwargs)
    with _swap_field(m, "dot_general", _lin.dot_general):
        return next_fun(*args, **kwargs)


def _conv(m, next_fun, args, kwargs):
    if m.conv_general_dilated is not None or m.conv_general_dilated_cls is not None:
        return next_fun(*args, **kwargs)
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


def _conv_transpose(m, next_fun, args, kwargs):
    with _lax_lock:
        old = _flax_linear.lax
        _flax_linear.lax = _LAX_PROXY
        try:
            return next_fun(*args, **kwargs)
        finally:
            _flax_linear.lax = old


def _first_arg(args, kwargs, name="inputs"):
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop(name), (), kwargs


def _feature_params(m, x, feature_axes):
    feature_axes = tuple(a % x.ndim for a in feature_axes)
    shape = [x.shape[a] for a in feature_axes]
    scale = m.param("scale", m.scale_init, shape, m.param_dtype) if m.use_scale else None
    bias = (m.param("bias", m.bias_init, shape, m.param_dtype)
            if getattr(m, "use_bias", False) else None)
    return scale, bias


def _norm_fallback_reason(m, kwargs):
    """Why the selective norm cannot stand in for ``m`` (``None``: it can)."""
    if kwargs.get("mask") is not None:
        return "called with mask="
    if getattr(m, "axis_name", None) is not None:
        return "axis_name set (cross-device statistics)"
    if not getattr(m, "force_float32_reductions", True):
        return "force_float32_reductions=False"
    return None


def _axes_tuple(a):
    return (a,) if isinstance(a, int) else tuple(a)


def _flax_layer_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest else _norm_fallback_reason(m, kw)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    red = _axes_tuple(m.reduction_axes)
    feat = _axes_tuple(m.feature_axes)
    scale, bias = _feature_params(m, x, feat)
    return _norm.normalize(x, scale, bias, axes=red, feature_axes=feat, eps=m.epsilon,
                           fast_variance=m.use_fast_variance, dtype=m.dtype)[0]


def _flax_rms_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest else _norm_fallback_reason(m, kw)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    red = _axes_tuple(m.reduction_axes)
    feat = _axes_tuple(m.feature_axes)
    fa = tuple(a % x.ndim for a in feat)
    shape = [x.shape[a] for a in fa]
    scale = m.param("scale", m.scale_init, shape, m.param_dtype) if m.use_scale else None
    return _norm.normalize(x, scale, None, axes=red, feature_axes=feat, eps=m.epsilon,
                           subtract_mean=False, dtype=m.dtype)[0]


def _flax_group_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    why = "extra positional arguments" if rest else _norm_fallback_reason(m, kw)
    if why is None and m.reduction_axes is not None:
        why = "custom reduction_axes"
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    c = x.shape[-1]
    groups = m.num_groups
    if m.group_size is not None:
        if groups is not None or c % m.group_size:
            return next_fun(*args, **kwargs)  # Flax raises its own error
        groups = c // m.group_size
    if groups is None or c % groups or x.ndim < 2:
        return next_fun(*args, **kwargs)  # Flax raises its own error
    scale, bias = _feature_params(m, x, (-1,))
    return _norm.group_norm(x, scale, bias, num_groups=groups, eps=m.epsilon, dtype=m.dtype,
                            fast_variance=m.use_fast_variance)


def _flax_batch_norm(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "x")
    ura = kw.pop("use_running_average", rest[0] if rest else None)
    why = "extra arguments" if len(rest) > 1 or set(kw) - {"mask"} else \
        _norm_fallback_reason(m, kw)
    if why:
        return _fallback(m, why, next_fun, args, kwargs)
    ura = nn.merge_param("use_running_average", m.use_running_average, ura)
    feat = tuple(a % x.ndim for a in _axes_tuple(m.axis))
    if len(feat) != 1:
        return _fallback(m, "several feature axes", next_fun, args, kwargs)
    (ax,) = feat
    c = x.shape[ax]
    ra_mean = m.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
    ra_var = m.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
    scale, bias = _feature_params(m, x, feat)
    if ura:
        y, _, _ = _norm.batch_norm(x, scale, bias, ra_mean.value, ra_var.value, train=False,
                                   eps=m.epsilon, axis=ax, dtype=m.dtype)
        return y
    y, new_m, new_v = _norm.batch_norm(
        x, scale, bias, ra_mean.value, ra_var.value, train=True, momentum=m.momentum,
        eps=m.epsilon, axis=ax, dtype=m.dtype, fast_variance=m.use_fast_variance)
    ra_mean.value = new_m
    ra_var.value = new_v
    return y


def _twin_batch_norm(m, next_fun, args, kwargs):
    """``jaxmem.models.BatchNorm`` (torch-exact twin): two-pass variance, ``1/sqrt``,
    unbiased running variance, output in ``m.dtype`` or the input dtype."""
    x, rest, kw = _first_arg(args, kwargs, "x")
    train = kw.pop("train", rest[0] if rest else None)
    if not isinstance(train, bool) or kw or len(rest) > 1:
        return next_fun(*args, **kwargs)
    c = x.shape[-1]
    if train:
        n = x.size // c
        if n <= 1:
            return next_fun(*args, **kwargs)  # let the module raise its own error
    scale = m.param("scale", nn.initializers.ones, (c,), jnp.float32)
    bias = m.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    ra_mean = m.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32))
    ra_var = m.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32))
    out_dtype = m.dtype if m.dtype is not None else x.dtype
    y, new_m, new_v = _norm.batch_norm(
        x, scale, bias, ra_mean.value, ra_var.value, train=train, momentum=m.momentum,
        eps=m.epsilon, axis=-1, dtype=out_dtype, fast_variance=False, inv_mode="recip_sqrt",
        unbiased_running_var=True)
    if train:
        ra_mean.value = new_m
        ra_var.value = new_v
    return y


def _flax_dropout(m, next_fun, args, kwargs):
    x, rest, kw = _first_arg(args, kwargs, "inputs")
    det = kw.pop("deterministic", rest[0] if rest else None)
    rng = kw.pop("rng", rest[1] if len(rest) > 1 else None)
    if kw or len(rest) > 2 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return next_fun(*args, **kwargs)
    det = nn.merge_param("deterministic", m.deterministic, det)
    if det or m.rate == 0.0 or m.rate == 1.0:
        return next_fun(*args, **kwargs)
    if rng is None:
        rng = m.make_rng(m.rng_collection)
    return _dropout_fn(rng, x, m.rate, broadcast_dims=tuple(m.broadcast_dims))


# ------------------------------------------------------------------------- public API
@contextlib.contextmanager
def scope(functions: bool = True):
    """Within this context, Linen modules (and, with ``functions``, the inline
    activations / ``max_pool``) trace to the selective primitives (see the module
    docstring). Re-entrant; everything is restored on exit."""
    with contextlib.ExitStack() as stack:
        if functions:
            stack.enter_context(_patch.patch_functions())
        stack.enter_context(nn.intercept_methods(_interceptor))
        yield


def wrap(fn):
    """Decorator: run ``fn`` (e.g. a loss that calls ``model.apply``) inside :func:`scope`."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)

    return wrapped


class SelectiveModel:
    """A Linen model whose ``apply`` uses the selective primitives. ``init`` and all other
    attributes are those of the wrapped ``model``; parameters are shared unchanged."""

    def __init__(self, model: nn.Module):
        self.model = model

    def apply(self, variables, *args, **kwargs):
        with scope():
            return self.model.apply(variables, *args, **kwargs)

    def init(self, *args, **kwargs):
        return self.model.init(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __repr__(self):
        return f"SelectiveModel({self.model!r})"


def convert(model) -> SelectiveModel:
    """One call: a Linen ``model`` whose ``apply`` stores only what requested gradients need.

    Raises ``TypeError`` for anything that is not a ``flax.linen.Module`` (for NNX modules
    use :func:`jaxmem.selective.nnx.convert`).
    """
    if isinstance(model, SelectiveModel):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(
            "jaxmem.selective.linen.convert expects a flax.linen.Module, got "
            f"{type(model).__module__}.{type(model).__name__}; for flax.nnx modules use "
            "jaxmem.selective.nnx.convert")
    return SelectiveModel(model)
