"""Exact smooth elementwise activations that keep only their input.

For an elementwise ``y = f(x)`` (exact or tanh GELU, SiLU, softplus, ...) reverse-mode
autodiff keeps the intermediate values of ``f``'s linearisation: the exact GELU
``f(x) = x/2 (1 + erf(x / sqrt 2))`` keeps ``x/2``, ``erfc``-like and ``exp(-x^2/2)`` terms,
three ``x``-sized arrays.  The derivative

    dL/dx = f'(x) * g,        g = dL/dy

depends on ``x`` alone, so ``x`` is all the backward pass needs.  :func:`smooth_activation`
is a ``jax.custom_vjp`` (``symbolic_zeros=True``) that keeps ``x`` (tagged
``jaxmem.selective.<name>.input``) only when it is differentiated and, in the backward,
recomputes ``jax.vjp(f, x)`` -- JAX's own reverse-mode derivative of the very same ``f`` --
and applies it to ``g``.  The gradient is therefore JAX's (the same equations; equal up to
how XLA fuses them, i.e. bit for bit or at float rounding), in any float dtype, and higher
order derivatives work (the backward is itself differentiable).  The recomputation is tied
to ``g`` (:func:`jaxmem._prims.ties.tie_elementwise`) so XLA cannot merge it with the forward's ``f(x)``
and keep that alive instead.

The output ``y`` is also registered as ``f(x)`` (``_core.remember``): a selective bilinear
layer fed ``y`` (``jaxmem.selective.dot_general``, ``dense``, ``conv_general_dilated``) keeps
this same ``x`` -- one residual shared by both rules -- and recomputes ``y = f(x)`` in its
backward, instead of keeping ``y`` as well.  Per activation that is one ``x``-sized array
kept instead of ``f``'s linearisation plus ``y``.

``f`` must be elementwise (``f(x)[i]`` depends on ``x[i]`` only) and hashable (it is a
static argument: use the same function object for the same activation so traces are
cached).  Forward-mode ``jax.jvp`` through it raises JAX's ``custom_vjp`` error, as for the
other selective ops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.typing import ArrayLike

from jaxmem._prims.ties import tie, tie_elementwise
from jaxmem.selective._core import check_float, is_zero, remember, tag

__all__ = ["smooth_activation"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _smooth(f, name, tie_whole, x):
    del name, tie_whole
    return f(x)


def _smooth_fwd(f, name, tie_whole, x):
    del name, tie_whole
    y = f(x.value)
    # ``x`` arrives tagged (see ``smooth_activation``): stored as is, it is the very
    # residual a following bilinear layer keeps (``_core.recipe``), not a second copy
    return y, (x.value if x.perturbed else None)


def _smooth_bwd(f, name, tie_whole, res, g):
    del name
    if res is None or is_zero(g):
        return (None,)
    # tied to ``g``: recomputed in the backward pass, never merged with the forward's f(x)
    _, vjp = jax.vjp(f, (tie if tie_whole else tie_elementwise)(res, g))
    (dx,) = vjp(g)
    return (dx,)


_smooth.defvjp(_smooth_fwd, _smooth_bwd, symbolic_zeros=True)


def smooth_activation(f: Callable[[jax.Array], jax.Array], x: ArrayLike, *,
           name: str = "smooth", tie_whole: bool = False) -> jax.Array:
    """``f(x)`` for an elementwise ``f``, keeping only ``x`` for the backward pass.

    Args:
      f: elementwise function of one array (hashable; a static argument).
      x: floating-point array.
      name: tag of the kept input, ``jaxmem.selective.<name>.input``.
      tie_whole: how the backward pass reads the kept ``x`` (the same values either way).
        ``False``: through a scalar tie (:func:`jaxmem._prims.ties.tie_elementwise`), fused
        into the op reading ``x``, so a slice of a merged GEMM's output (XLA:GPU's
        ``[x W | x V]``) is read in place. ``True``: ``x`` tied whole
        (:func:`jaxmem._prims.ties.tie`), so XLA stores it as one array -- where ``x`` is a
        product's output that XLA:GPU computes as split-K partial sums, otherwise the
        partial sums are kept (their reduction fused into every reader).

    Returns:
      ``f(x)`` (the same computation).  ``dL/dx = vjp(f, x)(g)`` is recomputed from the kept
      ``x``; a selective bilinear layer applied to the result keeps ``x`` instead of
      ``f(x)`` (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.selective import smooth_activation
      >>> gelu = lambda a: jax.nn.gelu(a, approximate=False)
      >>> x = jnp.linspace(-3.0, 3.0, 7)
      >>> g = jax.grad(lambda x: jnp.sum(smooth_activation(gelu, x)))(x)
      >>> bool(jnp.allclose(g, jax.grad(lambda x: jnp.sum(gelu(x)))(x)))
      True
    """
    check_float("smooth_activation: x", x)
    if not isinstance(tie_whole, bool):
        raise TypeError(f"smooth_activation: tie_whole must be a bool, got {tie_whole!r}")
    x = tag(x, str(name) + ".input")
    y = _smooth(f, str(name), tie_whole, x)
    # the producer keeps ``x`` exactly when ``x`` is differentiated (argument 0)
    remember(y, f, (x,), kept_if=(0,))
    return y

