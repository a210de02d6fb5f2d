"""Exact piecewise-linear activations that keep a 1-bit packed mask for the backward pass.

For ``y = f(x)`` whose derivative takes two values, ``f'(x) = high`` where ``M(x)`` holds and
``low`` elsewhere::

    forward:   y  = f(x)                                   (the exact JAX function)
    residual:  pack(M(x), 1, blocks)                       (1/8 byte per element)
    backward:  dx = where(M(x), high * dy, low * dy)       (in dy's dtype)

A level ``1`` passes ``dy`` through and a level ``0`` gives ``0`` (so a non-finite ``dy`` where
the slope is zero still gives ``0``, as ``jax.nn.relu``'s derivative); other levels multiply in
``dy``'s dtype, as ``jax.nn.leaky_relu``'s derivative does (``leaky_relu`` multiplies also
by a zero slope, as JAX does).  The mask is stored only when ``x``
is differentiated (``custom_vjp`` with symbolic zeros), packed by the reduction of
:mod:`jaxmem._prims.bitpack` so that XLA materialises 1 bit per element instead of keeping
the float input (``jax.nn.relu`` keeps 5 B per element in float32).  Under a mesh in context
(``jax.set_mesh``) the mask is packed in ``blocks = shard_blocks(x.shape[-1], 1)`` blocks along
the last axis, so each device packs its own shard of a feature-sharded ``x`` (no collective);
``blocks`` is fixed when the op is called and shared by the forward and backward passes.

The regions reproduce ``jax.nn``'s derivative at the kinks exactly:

==============  ======================  ============================
function        ``M`` (slope 1)         slope outside ``M``
==============  ======================  ============================
relu            ``x > 0``               0
leaky_relu      ``x >= 0``              ``negative_slope``
relu6           ``0 < x < 6``           0
hard_tanh       ``-1 <= x <= 1``        0
==============  ======================  ============================

The named ops tag their mask ``jaxmem.selective.<name>.mask`` (``jax.ad_checkpoint.
checkpoint_name``), so remat policies such as ``save_only_these_names`` can select it.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxmem._prims.bitpack import pack, shard_blocks, unpack
from jaxmem._prims.recipes import then

__all__ = ["MASKED", "check_floating", "hard_tanh", "leaky_relu", "mask_op", "relu", "relu6"]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)

# The originals, bound at import: the Flax glue later patches jax.nn.relu & co. in its scopes.
_jnn_relu, _jnn_relu6, _jnn_hard_tanh = jax.nn.relu, jax.nn.relu6, jax.nn.hard_tanh
_jnn_leaky_relu = jax.nn.leaky_relu

#: Tag prefix of the named ops' mask residuals.
TAG_PREFIX = "jaxmem.selective."


def check_floating(name: str, x) -> jax.Array:
    """``x`` as an array of a floating dtype JAX differentiates, else ``TypeError``."""
    x = jnp.asarray(x)
    if not any(x.dtype == d for d in _FLOATS):
        raise TypeError(f"{name}: x must be a floating-point array (float32, bfloat16, float16 "
                        f"or float64 under x64), got dtype {x.dtype}")
    return x


def _check_level(v, name: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a float, got {v!r}")
    v = float(v)
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(v)))
    if not finite:
        raise ValueError(f"{name} must be finite in float32, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One mask op: ``f``, the predicate ``M``, the two slopes and the residual's tag."""

    fn: Callable
    predicate: Callable
    low: float
    high: float
    tag: str | None
    select_zero: bool = True  # a zero slope selects 0 (else multiplies, as leaky_relu does)


def _scaled(g, level: float, select_zero: bool):
    if level == 1.0:
        return g
    if level == 0.0 and select_zero:
        return jnp.zeros((), g.dtype)
    return g * jnp.asarray(level, g.dtype)


def _blocks(x) -> int:
    """Blocks of the packed mask of ``x`` (see :func:`jaxmem._prims.bitpack.shard_blocks`)."""
    return shard_blocks(x.shape[-1], 1) if x.ndim else 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _masked(spec: _Spec, blocks: int, x):
    return spec.fn(x)


def _masked_fwd(spec: _Spec, blocks: int, x):
    y = spec.fn(x.value)
    if not x.perturbed:
        return y, (None,)
    packed = pack(spec.predicate(x.value), 1, blocks)
    if spec.tag is not None:
        packed = checkpoint_name(packed, spec.tag)
    return y, (packed,)


def _masked_bwd(spec: _Spec, blocks: int, res, g):
    (packed,) = res
    if packed is None or g is None or isinstance(g, SymbolicZero):
        return (None,)
    m = unpack(packed, 1, g.shape, blocks).astype(jnp.bool_)
    return (jnp.where(m, _scaled(g, spec.high, spec.select_zero),
                      _scaled(g, spec.low, spec.select_zero)),)


_masked.defvjp(_masked_fwd, _masked_bwd, symbolic_zeros=True)


@functools.cache
def _build(spec: _Spec, name: str) -> Callable:
    def apply(x):
        src = x
        x = check_floating(name, x)
        y = _masked(spec, _blocks(x), x)
        # ``y = f(x)`` with ``x`` recomputable (a norm's output): so is ``y``, from the same
        # residuals, and a bilinear layer fed ``y`` keeps those instead of ``y``
        then(y, spec.fn, src)
        return y

    apply.__name__ = name
    apply.__qualname__ = name
    apply.__doc__ = (f"{name}: exact forward, dx = dy * ({spec.high} if M(x) else {spec.low}) "
                     f"from a packed 1-bit mask.")
    apply.bits, apply.symmetric = 1, False
    apply.borders = np.zeros((0,), np.float32)
    apply.levels = np.asarray([spec.low, spec.high], np.float32)
    return apply


def mask_op(fn: Callable, predicate: Callable, low: float, high: float, *, name: str = "mask",
            tag: str | None = None) -> Callable:
    """Exact 1-bit op for ``f`` with ``f'(x) = high if predicate(x) else low``.

    Args:
      fn: the exact elementwise forward ``f``.
      predicate: ``x -> bool array`` (the region ``M`` where the slope is ``high``).
      low, high: the two slopes, finite in float32.
      name: the op's name (in errors and ``__name__``).
      tag: optional ``checkpoint_name`` put on the packed mask.

    Returns:
      ``x -> f(x)`` whose backward keeps only ``pack(predicate(x), 1)``; one cached function
      per ``(fn, predicate, low, high, name, tag)``.
    """
    if not callable(fn) or not callable(predicate):
        raise TypeError(f"mask_op: fn and predicate must be callables, got "
                        f"{type(fn).__name__} and {type(predicate).__name__}")
    spec = _Spec(fn, predicate, _check_level(low, "low"), _check_level(high, "high"), tag)
    return _build(spec, str(name))


def _relu_region(x):
    return x > 0


def _leaky_region(x):
    return x >= 0


def _relu6_region(x):
    return (x > 0) & (x < 6)


def _hard_tanh_region(x):
    return (x >= -1) & (x <= 1)


#: name -> (forward, region M, slope outside M, slope inside M) of the named mask ops
MASKED: dict[str, tuple[Callable, Callable, float, float]] = {
    "relu": (_jnn_relu, _relu_region, 0.0, 1.0),
    "relu6": (_jnn_relu6, _relu6_region, 0.0, 1.0),
    "hard_tanh": (_jnn_hard_tanh, _hard_tanh_region, 0.0, 1.0),
}


@functools.cache
def named(name: str) -> Callable:
    """The mask op of ``relu``, ``relu6`` or ``hard_tanh`` (tagged ``<TAG_PREFIX><name>.mask``)."""
    fn, region, low, high = MASKED[name]
    return mask_op(fn, region, low, high, name=name, tag=f"{TAG_PREFIX}{name}.mask")


def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)``; ``dx = dy * [x > 0]`` from a packed 1-bit mask (1/8 B per element)."""
    return named("relu")(x)


def relu6(x: jax.Array) -> jax.Array:
    """``min(max(x, 0), 6)``; ``dx = dy * [0 < x < 6]`` from a packed 1-bit mask."""
    return named("relu6")(x)


def hard_tanh(x: jax.Array) -> jax.Array:
    """``clip(x, -1, 1)``; ``dx = dy * [-1 <= x <= 1]`` from a packed 1-bit mask."""
    return named("hard_tanh")(x)


@functools.cache
def _leaky(slope: float) -> Callable:
    # dy * slope also for slope 0 (a non-finite dy stays non-finite), as jax.nn.leaky_relu
    spec = _Spec(functools.partial(_jnn_leaky_relu, negative_slope=slope), _leaky_region,
                 slope, 1.0, f"{TAG_PREFIX}leaky_relu.mask", select_zero=False)
    return _build(spec, "leaky_relu")


def _split(x):
    """``(where(x >= 0, x, 0), where(x >= 0, 0, x))``: ``x`` split by sign."""
    m = x >= 0
    zero = jnp.zeros((), x.dtype)
    return jnp.where(m, x, zero), jnp.where(m, zero, x)


# the VJP keeps a 1-bit packed mask in ``blocks`` blocks
_split_sign = jax.custom_vjp(lambda blocks, x: _split(x), nondiff_argnums=(0,))


def _split_sign_fwd(blocks, x):
    out = _split(x.value)
    return out, (pack(x.value >= 0, 1, blocks) if x.perturbed else None)


def _split_sign_bwd(blocks, packed, g):
    dpos, dneg = g
    if packed is None or all(isinstance(d, SymbolicZero) for d in g):
        return (None,)
    shape = next(d.shape for d in g)
    m = unpack(packed, 1, shape, blocks).astype(jnp.bool_)
    zero = jnp.zeros((), next(d.dtype for d in g))
    dpos = zero if isinstance(dpos, SymbolicZero) else dpos
    dneg = zero if isinstance(dneg, SymbolicZero) else dneg
    return (jnp.where(m, dpos, dneg),)


_split_sign.defvjp(_split_sign_fwd, _split_sign_bwd, symbolic_zeros=True)


def leaky_relu(x: jax.Array, negative_slope: float | jax.Array = 0.01) -> jax.Array:
    """``where(x >= 0, x, negative_slope * x)``; ``dx = dy * where(x >= 0, 1, slope)`` from a
    packed 1-bit mask ``x >= 0``.

    ``negative_slope``: a Python/NumPy real (one cached op; finite in float32), or a JAX array
    (traced under jit/vmap/grad; a scalar or broadcastable to ``x``, cast to ``x.dtype``).
    With an array slope ``y = pos(x) + slope * neg(x)``, where ``(pos, neg)`` split ``x`` by
    sign and keep only the packed mask, so ``dslope = sum(dy * neg(x))`` (autodiff keeps
    ``neg(x)`` only when the slope is differentiated).
    """
    if isinstance(negative_slope, (bool, np.bool_)):
        raise TypeError(f"leaky_relu: negative_slope must be a float, got {negative_slope!r}")
    if isinstance(negative_slope, numbers.Real):
        return _leaky(_check_level(negative_slope, "leaky_relu: negative_slope"))(x)
    s = jnp.asarray(negative_slope)
    if not (jnp.issubdtype(s.dtype, jnp.floating) or jnp.issubdtype(s.dtype, jnp.integer)):
        raise TypeError(f"leaky_relu: negative_slope must be real, got dtype {s.dtype}")
    x = check_floating("leaky_relu", x)
    try:
        ok = jnp.broadcast_shapes(s.shape, x.shape) == x.shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"leaky_relu: negative_slope of shape {s.shape} does not broadcast to "
                         f"x of shape {x.shape}")
    pos, neg = _split_sign(_blocks(x), x)
    return pos + s.astype(x.dtype) * neg
