"""Gradients for a trainable subset of a parameter pytree.

Freezing with ``optax.masked`` / ``optax.set_to_zero`` still differentiates *every*
parameter: autodiff keeps every layer input a weight gradient needs, and the gradients of
frozen weights are computed and thrown away. Differentiating only the trainable leaves lets
autodiff (and the selective primitives, through ``.perturbed``) skip all of that.

``partition(params, trainable)`` splits a pytree into ``(trainable, frozen)`` trees of the
same structure with ``None`` in the other's places; ``combine`` merges them back.
``value_and_grad(fn, trainable=...)`` differentiates ``fn`` w.r.t. the trainable part of its
``argnums`` argument only and returns gradients in the trainable tree (``None`` at frozen
leaves). ``train_step(loss_fn, optimizer, trainable)`` wires that to an optax optimizer whose
state covers only the trainable leaves.

A ``trainable`` filter is one of: ``True``/``False`` (everything / nothing), a callable
``(path, leaf) -> bool`` (``path`` is a ``jax.tree_util`` key path; see :func:`path_str`), a
regular-expression string matched (``re.search``) against ``path_str(path)``, or a pytree of
bools with the structure of the parameters (a prefix is allowed).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = [
    "combine",
    "grad",
    "nnx_value_and_grad",
    "partition",
    "path_str",
    "train_step",
    "trainable_mask",
    "value_and_grad",
]


def path_str(path) -> str:
    """``'params/block1/conv/kernel'`` for a ``jax.tree_util`` key path."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k).strip(".[]'\""))
    return "/".join(parts)


def trainable_mask(params, trainable) -> Any:
    """A pytree of Python bools (same structure as ``params``) from a ``trainable`` filter."""
    if isinstance(trainable, bool):
        return jax.tree.map(lambda _: trainable, params)
    if isinstance(trainable, str):
        pat = re.compile(trainable)
        return jax.tree_util.tree_map_with_path(
            lambda p, _: bool(pat.search(path_str(p))), params)
    if callable(trainable):
        def f(p, leaf):
            out = trainable(p, leaf)
            if not isinstance(out, bool):
                raise TypeError(f"trainable predicate must return a Python bool, got "
                                f"{type(out).__name__} for {path_str(p)!r}")
            return out
        return jax.tree_util.tree_map_with_path(f, params)
    # a mask pytree (possibly a prefix of params)
    try:
        return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: _as_bool(m), sub),
                            trainable, params)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "trainable must be a bool, a (path, leaf) -> bool callable, a regex string or a "
            f"pytree of bools matching the parameters; the mask did not match: {e}") from None


def _as_bool(m):
    if not isinstance(m, bool):
        raise TypeError(f"trainable mask leaves must be Python bools, got {m!r}")
    return m


def partition(params, trainable):
    """Split ``params`` into ``(trainable_part, frozen_part)``, ``None`` in the gaps."""
    mask = trainable_mask(params, trainable)
    t = jax.tree.map(lambda m, x: x if m else None, mask, params)
    f = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return t, f


def combine(*trees):
    """Merge trees from :func:`partition`: at each leaf take the first non-``None`` value."""
    def pick(*xs):
        for x in xs:
            if x is not None:
                return x
        return None
    return jax.tree.map(pick, *trees, is_leaf=lambda x: x is None)


def value_and_grad(fn: Callable, argnums: int = 0, has_aux: bool = False, *,
                   trainable=True) -> Callable:
    """Like ``jax.value_and_grad`` but differentiates only the trainable leaves of
    argument ``argnums``; frozen leaves enter ``fn`` as non-differentiated constants.

    Returns ``(value, grads)`` (``((value, aux), grads)`` with ``has_aux``) where ``grads``
    has the structure of the parameters with ``None`` at frozen leaves.
    """
    if not isinstance(argnums, int):
        raise TypeError(f"value_and_grad: argnums must be an int, got {argnums!r}")

    def wrapped(*args, **kwargs):
        if not -len(args) <= argnums < len(args):
            raise ValueError(f"value_and_grad: argnums={argnums} but only {len(args)} "
                             "positional arguments were given")
        t, f = partition(args[argnums], trainable)

        def inner(t_):
            a = list(args)
            a[argnums] = combine(t_, f)
            return fn(*a, **kwargs)

        return jax.value_and_grad(inner, has_aux=has_aux)(t)

    return wrapped


def grad(fn: Callable, argnums: int = 0, has_aux: bool = False, *, trainable=True):
    """``value_and_grad`` without the value (``(grads, aux)`` with ``has_aux``)."""
    vg = value_and_grad(fn, argnums, has_aux, trainable=trainable)

    def wrapped(*args, **kwargs):
        out, g = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped


class TrainStep(NamedTuple):
    """``init(params) -> opt_state`` and ``step(params, opt_state, *batch) ->
    (params, opt_state, loss)``; the optimizer state covers trainable leaves only."""

    init: Callable
    step: Callable


def train_step(loss_fn: Callable, optimizer, trainable=True, *, jit: bool = True) -> TrainStep:
    """An optax training step for ``loss_fn(params, *batch) -> scalar`` that differentiates
    and updates only the ``trainable`` leaves (frozen leaves are returned unchanged)."""
    import optax  # local: optax is only needed here

    vg = value_and_grad(loss_fn, 0, trainable=trainable)

    def init(params):
        t, _ = partition(params, trainable)
        return optimizer.init(t)

    def step(params, opt_state, *batch):
        loss, g = vg(params, *batch)
        t, f = partition(params, trainable)
        updates, opt_state = optimizer.update(g, opt_state, t)
        t = optax.apply_updates(t, updates)
        return combine(t, f), opt_state, loss

    return TrainStep(init, jax.jit(step) if jit else step)


def nnx_value_and_grad(fn: Callable, trainable=None, *, argnum: int = 0,
                       has_aux: bool = False) -> Callable:
    """NNX form: ``flax.nnx.value_and_grad`` restricted to the state selected by the NNX
    filter ``trainable`` (e.g. ``nnx.Param``, ``nnx.PathContains('head')``, or a predicate).

    Only the selected Variables are differentiated (``nnx.DiffState``), so selective
    primitives inside the model see the other weights as not perturbed.
    """
    from flax import nnx  # local: keeps `import jaxmem.selective` light

    if trainable is None:
        trainable = nnx.Param
    return nnx.value_and_grad(fn, argnums=nnx.DiffState(argnum, trainable), has_aux=has_aux)
