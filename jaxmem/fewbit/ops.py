"""Few-bit activations: exact forward, quantised backward (``jax.custom_vjp``).

For an elementwise ``f`` and a table (borders ``s``, levels ``y``, ``k = 2**bits``)::

    forward:   out = f(x)                          (the exact JAX function)
    residual:  pack(code(x), bits, blocks),  code(x) = Σ_i [x >= s_i]   (bits/8 B per element)
    backward:  dx = dy * y[code(x)]                (computed in float32, cast to dy.dtype)

so autodiff keeps ``bits/8`` bytes per element instead of the float input (and whatever
``f``'s own derivative needs).  ``blocks = shard_blocks(x.shape[-1], bits)`` (1 outside a mesh
in context) packs each shard of a feature-sharded ``x`` on its own device
(:mod:`jaxmem._prims.bitpack`); it is fixed when the op is called.  The gradient is *defined* to be ``dy * q(x)`` with ``q`` the
piecewise-constant approximation of ``f'`` (paper eq. 2); it is reproduced bit-for-bit by
``torch_ref.fewbit``.

Non-finite inputs: ``+inf`` falls in the top bin, ``-inf`` and ``NaN`` in bin 0 (``NaN``
compares false; for symmetric tables ``±inf`` in the top bin of ``|x|``).  The forward is
``f(x)`` as JAX computes it (so ``NaN`` in gives ``NaN`` out); the backward stays finite for
finite ``dy``.

The ReLU family (``relu``, ``relu6``, ``hard_tanh``, ``leaky_relu``, and :func:`mask_op` for
any ``f`` whose derivative takes two values) is exact with a 1-bit mask; those are the shared
ops of :mod:`jaxmem._prims.mask` (``jaxmem.selective.relu`` is the same function).  Aliases:
``swish`` = ``silu`` and ``soft_sign`` = ``softsign`` (``jax.nn``'s spellings).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._prims.bitpack import pack, shard_blocks, unpack
from jaxmem._prims.checks import check_bits
from jaxmem._prims.codes import bin_codes
from jaxmem._prims.mask import (  # the exact 1-bit ops (used by name, not exported)
    MASKED,
    check_floating,
    hard_tanh,  # noqa: F401
    leaky_relu,
    mask_op,
    named,
    relu,  # noqa: F401
    relu6,  # noqa: F401
)

from .activations import get_activation
from .tables import load_table

__all__ = [
    "activation",
    "celu",
    "elu",
    "fewbit_op",
    "gelu",
    "hard_swish",
    "leaky_relu",
    "log_sigmoid",
    "mask_op",
    "mish",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softplus",
    "softsign",
    "swish",
    "tanh",
]


def _backward(dy, c, levels: np.ndarray):
    lv = jnp.asarray(levels, dtype=jnp.float32)
    q = lv[c.astype(jnp.int32)] if levels.size > 2 else jnp.where(c > 0, lv[1], lv[0])
    return (dy.astype(jnp.float32) * q).astype(dy.dtype)


@functools.cache
def _build(fn: Callable, name: str, bits: int, borders: tuple, levels: tuple,
           symmetric: bool) -> Callable:
    """The custom_vjp op for one (f, table); cached so repeated calls share one function."""
    b32 = np.asarray(borders, dtype=np.float32)
    l32 = np.asarray(levels, dtype=np.float32)

    # blocks: the packing blocks along the last axis (shard_blocks under a mesh in context),
    # fixed at the call so that the forward and backward passes share one layout
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(blocks, x):
        return fn(x)

    def fwd(blocks, x):
        return fn(x), pack(bin_codes(x, b32, symmetric=symmetric), bits, blocks)

    def bwd(blocks, res, dy):
        c = unpack(res, bits, dy.shape, blocks)
        return (_backward(dy, c, l32),)

    op.defvjp(fwd, bwd)

    def apply(x: jax.Array) -> jax.Array:
        x = check_floating(f"few-bit {name}", x)
        return op(shard_blocks(x.shape[-1], bits) if x.ndim else 1, x)

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


def fewbit_op(fn: Callable[[jax.Array], jax.Array], borders: Sequence[float],
              levels: Sequence[float], bits: int, *, symmetric: bool = False,
              name: str = "activation") -> Callable[[jax.Array], jax.Array]:
    """Few-bit version of elementwise ``fn`` with the given table.

    ``borders``: ``2**bits - 1`` finite values, non-decreasing in float32 (equal borders
    leave an empty bin); ``levels``: ``2**bits`` finite values.  Anything else (NaN, inf,
    unsorted, wrong length, values that overflow float32) raises ``ValueError``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    bits = check_bits(bits)
    borders = _table_array(borders, "borders", 2**bits - 1, bits)
    levels = _table_array(levels, "levels", 2**bits, bits)
    b32 = np.asarray(borders, dtype=np.float32)
    if np.any(np.diff(b32) < 0):
        i = int(np.argmax(np.diff(b32) < 0))
        raise ValueError(
            f"borders must be sorted ascending (in float32); borders[{i}] = {borders[i]!r} > "
            f"borders[{i + 1}] = {borders[i + 1]!r}"
        )
    return _build(fn, name, bits, borders, levels, bool(symmetric))


def activation(name: str, bits: int = 3) -> Callable[[jax.Array], jax.Array]:
    """The few-bit op of a registered activation with its shipped table.

    ``relu``, ``relu6`` and ``hard_tanh`` are exact at any ``bits`` (their 1-bit mask op).
    """
    bits = check_bits(bits)
    if name in MASKED:
        return named(name)
    act = get_activation(name)
    t = load_table(name, bits)
    return _build(act.fn, name, bits, t.borders, t.levels, t.symmetric)


# ---------------------------------------------------------------- named activations

def gelu(x: jax.Array, bits: int = 3, approximate: bool = False) -> jax.Array:
    """GELU, exact forward (erf form, or tanh form if ``approximate``), few-bit backward.

    Note: ``approximate=False`` is the default here (``jax.nn.gelu`` defaults to True).
    """
    return activation("gelu_tanh" if approximate else "gelu", bits)(x)


def silu(x: jax.Array, bits: int = 3) -> jax.Array:
    """SiLU ``x * sigmoid(x)`` with a few-bit backward (alias :func:`swish`)."""
    return activation("silu", bits)(x)


#: alias of :func:`silu` (``jax.nn.swish``'s name)
swish = silu


def sigmoid(x: jax.Array, bits: int = 3) -> jax.Array:
    """Sigmoid with a few-bit backward (symmetric table: code of ``|x|``)."""
    return activation("sigmoid", bits)(x)


def tanh(x: jax.Array, bits: int = 3) -> jax.Array:
    """Tanh with a few-bit backward (symmetric table: code of ``|x|``)."""
    return activation("tanh", bits)(x)


def selu(x: jax.Array, bits: int = 3) -> jax.Array:
    """SELU with a few-bit backward."""
    return activation("selu", bits)(x)


def softplus(x: jax.Array, bits: int = 3) -> jax.Array:
    """Softplus ``log(1 + e^x)`` with a few-bit backward."""
    return activation("softplus", bits)(x)


def elu(x: jax.Array, bits: int = 3) -> jax.Array:
    """ELU (alpha = 1) with a few-bit backward."""
    return activation("elu", bits)(x)


def celu(x: jax.Array, bits: int = 3) -> jax.Array:
    """CELU (alpha = 1) with a few-bit backward."""
    return activation("celu", bits)(x)


def mish(x: jax.Array, bits: int = 3) -> jax.Array:
    """Mish ``x * tanh(softplus(x))`` with a few-bit backward."""
    return activation("mish", bits)(x)


def softsign(x: jax.Array, bits: int = 3) -> jax.Array:
    """Softsign ``x / (1 + |x|)`` with a few-bit backward (symmetric table; alias
    :func:`soft_sign`)."""
    return activation("softsign", bits)(x)


#: alias of :func:`softsign` (``jax.nn.soft_sign``'s name)
soft_sign = softsign


def log_sigmoid(x: jax.Array, bits: int = 3) -> jax.Array:
    """``log(sigmoid(x))`` with a few-bit backward."""
    return activation("log_sigmoid", bits)(x)


def hard_swish(x: jax.Array, bits: int = 3) -> jax.Array:
    """Hard-Swish ``x * relu6(x + 3) / 6`` with a few-bit backward."""
    return activation("hard_swish", bits)(x)
