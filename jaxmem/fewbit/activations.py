"""Registry of the activations few-bit tables are shipped for.

Each entry names the *exact* JAX function (the forward pass of the few-bit op and the
source of the derivative that is fitted, by autodiff in float64) and whether its derivative
is even (then the code is taken of ``|x|``, paper section 3 / Fig. 3c).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmem._prims.host import on_host

__all__ = ["TABLE_ACTIVATIONS", "MASK_ACTIVATIONS", "Activation", "get_activation"]


@dataclasses.dataclass(frozen=True)
class Activation:
    """An elementwise activation with a fitted few-bit derivative table.

    Attributes:
      name: registry key (also the table file name ``tables/<name>.json``).
      fn: the exact JAX function ``f`` (forward of the few-bit op).
      symmetric: ``f'`` is even; codes are computed from ``|x|``.
      torch: name of the matching ``torch.nn.functional`` call (documentation only).
    """

    name: str
    fn: Callable[[jax.Array], jax.Array]
    symmetric: bool = False
    torch: str = ""


# Captured at import: jaxmem.scope may later replace the jax.nn attributes.
_JAX_GELU = jax.nn.gelu
_JAX_LEAKY_RELU = jax.nn.leaky_relu


def _gelu_erf(x):
    return _JAX_GELU(x, approximate=False)


def _gelu_tanh(x):
    return _JAX_GELU(x, approximate=True)


TABLE_ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in [
        Activation("gelu", _gelu_erf, False, "gelu(x)"),
        Activation("gelu_tanh", _gelu_tanh, False, "gelu(x, approximate='tanh')"),
        Activation("silu", jax.nn.silu, False, "silu(x)"),
        Activation("sigmoid", jax.nn.sigmoid, True, "sigmoid(x)"),
        Activation("tanh", jnp.tanh, True, "tanh(x)"),
        Activation("selu", jax.nn.selu, False, "selu(x)"),
        Activation("softplus", jax.nn.softplus, False, "softplus(x)"),
        Activation("elu", jax.nn.elu, False, "elu(x)"),
        Activation("celu", jax.nn.celu, False, "celu(x)"),
        Activation("mish", jax.nn.mish, False, "mish(x)"),
        Activation("softsign", jax.nn.soft_sign, True, "softsign(x)"),
        Activation("log_sigmoid", jax.nn.log_sigmoid, False, "logsigmoid(x)"),
        Activation("hard_swish", jax.nn.hard_swish, False, "hardswish(x)"),
    ]
}

#: Piecewise-linear activations whose derivative takes two values: exact with a 1-bit mask.
#: name -> (predicate on x giving the "inside" bit, level outside, level inside); the
#: predicates reproduce JAX's own derivative at the kinks (e.g. relu'(0) = 0,
#: leaky_relu'(0) = 1, relu6'(0) = relu6'(6) = 0, hard_tanh'(±1) = 1).
MASK_ACTIVATIONS: dict[str, tuple[Callable, Callable, float, float]] = {
    "relu": (jax.nn.relu, lambda x: x > 0, 0.0, 1.0),
    "relu6": (jax.nn.relu6, lambda x: (x > 0) & (x < 6), 0.0, 1.0),
    "hard_tanh": (jax.nn.hard_tanh, lambda x: (x >= -1) & (x <= 1), 0.0, 1.0),
}


def get_activation(name: str) -> Activation:
    """Look up a registered activation, with a clear error for unknown names."""
    try:
        return TABLE_ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown activation {name!r}; known: {sorted(TABLE_ACTIVATIONS)} "
            f"(1-bit exact: {sorted(MASK_ACTIVATIONS)} and leaky_relu)"
        ) from None


@functools.cache
def numpy_derivative(fn: Callable) -> Callable:
    """``f'`` as a vectorised float64 numpy callable, by JAX autodiff under x64."""
    import numpy as np

    grad = jax.jit(jax.vmap(jax.grad(lambda t: fn(t))))  # built once; traced per shape

    def d(x):
        x = np.asarray(x, dtype=np.float64)
        out = on_host(lambda: np.asarray(grad(jnp.asarray(x.reshape(-1), dtype=jnp.float64)),
                                         dtype=np.float64))
        return out.reshape(x.shape)

    return d
