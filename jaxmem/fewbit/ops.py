"""Few-bit activations: exact forward, quantised backward (``jax.custom_vjp``).

For an elementwise ``f`` and a table (borders ``s``, levels ``y``, ``k = 2**bits``)::

    forward:   out = f(x)                          (the exact JAX function)
    residual:  pack(code(x), bits),  code(x) = Σ_i [x >= s_i]     (bits/8 bytes per element)
    backward:  dx = dy * y[code(x)]                (computed in float32, cast to dy.dtype)

so autodiff keeps ``bits/8`` bytes per element instead of the float input (and whatever
``f``'s own derivative needs).  The gradient is *defined* to be ``dy * q(x)`` with ``q`` the
piecewise-constant approximation of ``f'`` (paper eq. 2); it is reproduced bit-for-bit by
``torch_ref.fewbit``.

Non-finite inputs: ``+inf`` falls in the top bin, ``-inf`` and ``NaN`` in bin 0 (``NaN``
compares false; for symmetric tables ``±inf`` in the top bin of ``|x|``).  The forward is
``f(x)`` as JAX computes it (so ``NaN`` in gives ``NaN`` out); the backward stays finite for
finite ``dy``.

The ReLU family is exact with a 1-bit mask (the derivative takes two values); those ops use
the same packing with ``code = predicate(x)``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .activations import _JAX_LEAKY_RELU, MASK_ACTIVATIONS, get_activation
from .pack import _check_bits, pack, unpack
from .tables import load_table

__all__ = [
    "activation",
    "celu",
    "elu",
    "fewbit_op",
    "gelu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "log_sigmoid",
    "mask_op",
    "mish",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softplus",
    "softsign",
    "swish",
    "tanh",
]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _check_input(x, name: str):
    x = jnp.asarray(x)
    if not any(x.dtype == d for d in _FLOATS):
        raise TypeError(
            f"few-bit {name}: x must be float32, bfloat16 or float16 (float64 under x64), "
            f"got dtype {x.dtype}"
        )
    return x


def _backward(dy, c, levels: np.ndarray):
    lv = jnp.asarray(levels, dtype=jnp.float32)
    q = lv[c.astype(jnp.int32)] if levels.size > 2 else jnp.where(c > 0, lv[1], lv[0])
    return (dy.astype(jnp.float32) * q).astype(dy.dtype)


@functools.cache
def _build(fn: Callable, name: str, bits: int, borders: tuple, levels: tuple,
           symmetric: bool, predicate: Callable | None) -> Callable:
    """The custom_vjp op for one (f, table); cached so repeated calls share one function."""
    b32 = np.asarray(borders, dtype=np.float32)
    l32 = np.asarray(levels, dtype=np.float32)

    def code(x):
        if predicate is not None:
            return predicate(x).astype(jnp.uint8)
        xf = x.astype(jnp.float32)
        if symmetric:
            xf = jnp.abs(xf)
        c = jnp.zeros(x.shape, jnp.uint8)
        for v in b32:
            c = c + (xf >= v).astype(jnp.uint8)
        return c

    @jax.custom_vjp
    def op(x):
        return fn(x)

    def fwd(x):
        return fn(x), pack(code(x), bits)

    def bwd(res, dy):
        c = unpack(res, bits, dy.shape)
        return (_backward(dy, c, l32),)

    op.defvjp(fwd, bwd)

    def apply(x):
        x = _check_input(x, name)
        return op(x)

    apply.__name__ = f"fewbit_{name}_{bits}bit"
    apply.__doc__ = f"few-bit {name} ({bits}-bit backward): exact forward, dy * levels[code(x)]."
    apply.borders, apply.levels, apply.bits, apply.symmetric = b32, l32, bits, symmetric
    return apply


def _table_array(values, name: str, n: int, bits: int) -> tuple:
    """``values`` as a tuple of ``n`` floats, finite in float32, or a clear ValueError."""
    try:
        a = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of {n} real numbers, got {values!r}") from None
    if a.ndim > 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    a = a.reshape(-1)
    if a.size != n:
        raise ValueError(
            f"a {bits}-bit table needs {2**bits - 1} borders and {2**bits} levels; "
            f"{name} has {a.size} entries"
        )
    with np.errstate(over="ignore"):
        bad = ~np.isfinite(a.astype(np.float32))
    if bad.any():
        raise ValueError(
            f"{name} must be finite (in float32, where the table is applied); entry "
            f"{int(np.argmax(bad))} is {float(a[bad][0])!r}"
        )
    return tuple(float(v) for v in a)


def fewbit_op(fn: Callable, borders: Sequence[float], levels: Sequence[float], bits: int, *,
              symmetric: bool = False, name: str = "activation") -> Callable:
    """Few-bit version of elementwise ``fn`` with the given table.

    ``borders``: ``2**bits - 1`` finite values, non-decreasing in float32 (equal borders
    leave an empty bin); ``levels``: ``2**bits`` finite values.  Anything else (NaN, inf,
    unsorted, wrong length, values that overflow float32) raises ``ValueError``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    bits = _check_bits(bits)
    borders = _table_array(borders, "borders", 2**bits - 1, bits)
    levels = _table_array(levels, "levels", 2**bits, bits)
    b32 = np.asarray(borders, dtype=np.float32)
    if np.any(np.diff(b32) < 0):
        i = int(np.argmax(np.diff(b32) < 0))
        raise ValueError(
            f"borders must be sorted ascending (in float32); borders[{i}] = {borders[i]!r} > "
            f"borders[{i + 1}] = {borders[i + 1]!r}"
        )
    return _build(fn, name, bits, borders, levels, bool(symmetric), None)


def _check_level(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python float, got {v!r}")
    v = float(v)
    if not np.isfinite(np.float32(v)):
        raise ValueError(f"{name} must be finite in float32, got {v!r}")
    return v


def mask_op(fn: Callable, predicate: Callable, low: float, high: float, *,
            name: str = "mask") -> Callable:
    """Exact 1-bit op for ``f`` with ``f'(x) = high if predicate(x) else low``."""
    if not callable(fn) or not callable(predicate):
        raise TypeError("mask_op: fn and predicate must be callables")
    return _build(fn, name, 1, (), (_check_level(low, "low"), _check_level(high, "high")),
                  False, predicate)


def activation(name: str, bits: int = 3) -> Callable:
    """The few-bit op of a registered activation with its shipped table."""
    bits = _check_bits(bits)
    if name in MASK_ACTIVATIONS:
        fn, pred, lo, hi = MASK_ACTIVATIONS[name]
        return mask_op(fn, pred, lo, hi, name=name)
    act = get_activation(name)
    t = load_table(name, bits)
    return _build(act.fn, name, bits, t.borders, t.levels, t.symmetric, None)


# ---------------------------------------------------------------- named activations

def gelu(x, bits: int = 3, approximate: bool = False):
    """GELU, exact forward (erf form, or tanh form if ``approximate``), few-bit backward.

    Note: ``approximate=False`` is the default here (``jax.nn.gelu`` defaults to True).
    """
    return activation("gelu_tanh" if approximate else "gelu", bits)(x)


def silu(x, bits: int = 3):
    """SiLU/Swish ``x * sigmoid(x)`` with a few-bit backward."""
    return activation("silu", bits)(x)


swish = silu


def sigmoid(x, bits: int = 3):
    """Sigmoid with a few-bit backward (symmetric table: code of ``|x|``)."""
    return activation("sigmoid", bits)(x)


def tanh(x, bits: int = 3):
    """Tanh with a few-bit backward (symmetric table: code of ``|x|``)."""
    return activation("tanh", bits)(x)


def selu(x, bits: int = 3):
    """SELU with a few-bit backward."""
    return activation("selu", bits)(x)


def softplus(x, bits: int = 3):
    """Softplus ``log(1 + e^x)`` with a few-bit backward."""
    return activation("softplus", bits)(x)


def elu(x, bits: int = 3):
    """ELU (alpha = 1) with a few-bit backward."""
    return activation("elu", bits)(x)


def celu(x, bits: int = 3):
    """CELU (alpha = 1) with a few-bit backward."""
    return activation("celu", bits)(x)


def mish(x, bits: int = 3):
    """Mish ``x * tanh(softplus(x))`` with a few-bit backward."""
    return activation("mish", bits)(x)


def softsign(x, bits: int = 3):
    """Softsign ``x / (1 + |x|)`` with a few-bit backward (symmetric table)."""
    return activation("softsign", bits)(x)


soft_sign = softsign


def log_sigmoid(x, bits: int = 3):
    """``log(sigmoid(x))`` with a few-bit backward."""
    return activation("log_sigmoid", bits)(x)


def hard_swish(x, bits: int = 3):
    """Hard-Swish ``x * relu6(x + 3) / 6`` with a few-bit backward."""
    return activation("hard_swish", bits)(x)


def relu(x):
    """ReLU, exact gradient from a packed 1-bit mask ``x > 0``."""
    return activation("relu")(x)


def relu6(x):
    """ReLU6, exact gradient from a packed 1-bit mask ``0 < x < 6``."""
    return activation("relu6")(x)


def hard_tanh(x):
    """Hard-tanh, exact gradient from a packed 1-bit mask ``-1 <= x <= 1``."""
    return activation("hard_tanh")(x)


@functools.cache
def _leaky(slope: float) -> Callable:
    return mask_op(lambda x: _JAX_LEAKY_RELU(x, slope), lambda x: x >= 0, slope, 1.0,
                   name=f"leaky_relu_{slope}")


@jax.custom_vjp
def _split_sign(x):
    """``(where(x >= 0, x, 0), where(x >= 0, 0, x))``; the VJP keeps a 1-bit packed mask."""
    m = x >= 0
    zero = jnp.zeros((), x.dtype)
    return jnp.where(m, x, zero), jnp.where(m, zero, x)


def _split_sign_fwd(x):
    return _split_sign(x), pack((x >= 0).astype(jnp.uint8), 1)


def _split_sign_bwd(res, g):
    dpos, dneg = g
    m = unpack(res, 1, dpos.shape) > 0
    return (jnp.where(m, dpos, dneg),)


_split_sign.defvjp(_split_sign_fwd, _split_sign_bwd)


def leaky_relu(x, negative_slope: float = 0.01):
    """Leaky ReLU ``where(x >= 0, x, slope * x)``; exact gradient from a 1-bit mask ``x >= 0``.

    ``negative_slope``: a Python/NumPy float (one cached op), or a JAX array (traced under
    jit/vmap/grad, scalar or broadcastable to ``x``, cast to ``x.dtype``).  With an array slope
    ``y = pos(x) + slope * neg(x)`` where ``(pos, neg)`` split ``x`` by sign and keep only the
    packed mask: ``dx = dy * where(x >= 0, 1, slope)`` and ``dslope = Σ dy * neg(x)`` (to
    differentiate the slope autodiff keeps ``neg(x)``; otherwise only the mask and the slope).
    """
    if isinstance(negative_slope, bool):
        raise TypeError(f"leaky_relu: negative_slope must be a float, got {negative_slope!r}")
    if isinstance(negative_slope, (int, float, np.integer, np.floating)):
        return _leaky(_check_level(negative_slope, "negative_slope"))(x)
    s = jnp.asarray(negative_slope)
    if not (jnp.issubdtype(s.dtype, jnp.floating) or jnp.issubdtype(s.dtype, jnp.integer)):
        raise TypeError(f"leaky_relu: negative_slope must be real, got dtype {s.dtype}")
    x = _check_input(x, "leaky_relu")
    try:
        if jnp.broadcast_shapes(s.shape, x.shape) != x.shape:
            raise ValueError
    except ValueError:
        raise ValueError(f"leaky_relu: negative_slope of shape {s.shape} does not broadcast to "
                         f"x of shape {x.shape}") from None
    pos, neg = _split_sign(x)
    return pos + s.astype(x.dtype) * neg
