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
bools with the structure of the parameters (a prefix is allowed). Boxed parameters
(``nn.Partitioned``, ``nn.LogicallyPartitioned``, NNX ``Param``) have paths ending in
``/value``; a regex is also matched against the path without that suffix, so
``'Dense_0/kernel$'`` selects a boxed kernel. A filter that selects no leaf is an error in
:func:`value_and_grad`, :func:`grad` and :func:`train_step` (it would train nothing).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

#: a ``trainable`` filter: bool, ``(path, leaf) -> bool``, regex string or pytree of bools
Trainable = bool | str | Callable[[Any, Any], bool] | Any

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


_KEYED = (jax.tree_util.DictKey, jax.tree_util.GetAttrKey, jax.tree_util.SequenceKey)


def path_str(path: Sequence[Any]) -> str:
    """``'params/block1/conv/kernel'`` for a ``jax.tree_util`` key path."""
    # jax.tree_util.keystr(path, simple=True, separator="/") for dict, attribute and sequence
    # keys; any other key keeps its str() with quotes, dots and brackets stripped: a
    # FlattenedIndexKey (children of nodes registered without keys, e.g.
    # jax.tree_util.Partial) is "<flat index i>" here, where keystr writes "i".
    return "/".join(jax.tree_util.keystr((k,), simple=True) if isinstance(k, _KEYED)
                    else str(k).strip(".[]'\"") for k in path)


def _layer_path(s: str) -> str:
    """``'params/Dense_0/kernel'`` for the boxed ``'params/Dense_0/kernel/value'``."""
    return s[:-len("/value")] if s.endswith("/value") else s


def trainable_mask(params: Any, trainable: Trainable) -> Any:
    """A pytree of Python bools (same structure as ``params``) from a ``trainable`` filter."""
    if isinstance(trainable, bool):
        return jax.tree.map(lambda _: trainable, params)
    if isinstance(trainable, str):
        try:
            pat = re.compile(trainable)
        except re.error as e:
            raise ValueError(f"trainable={trainable!r} is not a valid regular expression: "
                             f"{e}") from None

        def match(p, _):
            s = path_str(p)
            return bool(pat.search(s) or pat.search(_layer_path(s)))
        return jax.tree_util.tree_map_with_path(match, params)
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


def _check_selects(params, trainable, mask, who):
    """Raise if ``trainable`` selects no leaf of ``params`` (nothing would be trained)."""
    flags = jax.tree.leaves(mask)
    if any(flags):
        return
    paths = [_layer_path(path_str(p)) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    shown = ", ".join(repr(p) for p in paths[:5]) + (", ..." if len(paths) > 5 else "")
    raise ValueError(
        f"{who}: trainable={trainable!r} selects none of the {len(paths)} parameter leaves, "
        f"so nothing would be trained; parameter paths look like: {shown or '(no leaves)'}")


def partition(params: Any, trainable: Trainable) -> tuple[Any, Any]:
    """Split ``params`` into ``(trainable_part, frozen_part)``, ``None`` in the gaps."""
    mask = trainable_mask(params, trainable)
    t = jax.tree.map(lambda m, x: x if m else None, mask, params)
    f = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return t, f


def combine(*trees: Any) -> Any:
    """Merge trees from :func:`partition`: at each leaf take the first non-``None`` value."""
    def pick(*xs):
        for x in xs:
            if x is not None:
                return x
        return None
    return jax.tree.map(pick, *trees, is_leaf=lambda x: x is None)


def value_and_grad(fn: Callable, argnums: int = 0, has_aux: bool = False, *,
                   trainable: Trainable = True) -> Callable:
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
        mask = trainable_mask(args[argnums], trainable)
        _check_selects(args[argnums], trainable, mask, "value_and_grad")
        t, f = partition(args[argnums], mask)

        def inner(t_):
            a = list(args)
            a[argnums] = combine(t_, f)
            return fn(*a, **kwargs)

        return jax.value_and_grad(inner, has_aux=has_aux)(t)

    return wrapped


def grad(fn: Callable, argnums: int = 0, has_aux: bool = False, *,
         trainable: Trainable = True) -> Callable:
    """``value_and_grad`` without the value (``(grads, aux)`` with ``has_aux``).

    Args:
      fn: the function to differentiate.
      argnums: the positional argument holding the parameters (a pytree).
      has_aux: ``fn`` returns ``(value, aux)``; ``aux`` is passed through.
      trainable: which leaves are differentiated: a bool, a regex on the leaf path, a
        ``(path, leaf) -> bool`` callable or a pytree (prefix) of bools.

    Returns:
      A function with ``fn``'s signature returning ``grads`` (``(grads, aux)`` with
      ``has_aux``): the parameters' structure, ``None`` at frozen leaves.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmem.selective import subset
      >>> params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}
      >>> f = lambda p, x: jnp.sum(p["w"] * x) + p["b"]
      >>> g = subset.grad(f, trainable="w")(params, jnp.array([3.0, 4.0]))
      >>> g["b"] is None, g["w"].tolist()
      (True, [3.0, 4.0])
    """
    vg = value_and_grad(fn, argnums, has_aux, trainable=trainable)

    def wrapped(*args, **kwargs):
        out, g = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped


class TrainStep(NamedTuple):
    """``init(params) -> opt_state`` and ``step(params, opt_state, *batch) ->
    (params, opt_state, loss)`` (``(params, opt_state, loss, aux)`` with ``has_aux``); the
    optimizer state covers trainable leaves only."""

    init: Callable
    step: Callable


def train_step(loss_fn: Callable, optimizer: Any, trainable: Trainable = True, *,
               has_aux: bool = False, jit: bool = True) -> TrainStep:
    """An optax training step for ``loss_fn(params, *batch) -> scalar`` (``-> (scalar, aux)``
    with ``has_aux``, e.g. the new batch statistics of a train-mode BatchNorm) that
    differentiates and updates only the ``trainable`` leaves (frozen leaves are returned
    unchanged).

    Args:
      loss_fn: ``loss_fn(params, *batch)`` returning a scalar (``(scalar, aux)`` with
        ``has_aux``).
      optimizer: an ``optax.GradientTransformation``.
      trainable: which leaves are trained (as in :func:`grad`).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``step`` then also returns ``aux``.
      jit: wrap ``step`` in ``jax.jit``.

    Returns:
      A :class:`TrainStep` ``(init, step)``: ``init(params) -> opt_state`` and
      ``step(params, opt_state, *batch) -> (params, opt_state, loss)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from jaxmem.selective import subset
      >>> params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}
      >>> loss = lambda p, x: (jnp.sum(p["w"] * x) + p["b"]) ** 2
      >>> ts = subset.train_step(loss, optax.sgd(0.1), trainable="b")
      >>> opt_state = ts.init(params)
      >>> new, opt_state, l = ts.step(params, opt_state, jnp.array([3.0, 4.0]))
      >>> round(float(l), 4), round(float(new["b"]), 4), new["w"].tolist()
      (132.25, -1.8, [1.0, 2.0])
    """
    import optax  # local: optax is only needed here

    vg = value_and_grad(loss_fn, 0, has_aux=has_aux, trainable=trainable)

    def init(params):
        mask = trainable_mask(params, trainable)
        _check_selects(params, trainable, mask, "train_step")
        t, _ = partition(params, mask)
        return optimizer.init(t)

    def step(params, opt_state, *batch):
        out, g = vg(params, *batch)
        t, f = partition(params, trainable)
        updates, opt_state = optimizer.update(g, opt_state, t)
        t = optax.apply_updates(t, updates)
        if has_aux:
            loss, aux = out
            return combine(t, f), opt_state, loss, aux
        return combine(t, f), opt_state, out

    return TrainStep(init, jax.jit(step) if jit else step)


def nnx_value_and_grad(fn: Callable, trainable: Any = None, *, argnums: int = 0,
                       has_aux: bool = False, argnum: int | None = None) -> Callable:
    """NNX form: ``flax.nnx.value_and_grad`` restricted to the state selected by the NNX
    filter ``trainable`` (e.g. ``nnx.Param``, ``nnx.PathContains('head')``, or a predicate).

    Only the selected Variables are differentiated (``nnx.DiffState``), so selective
    primitives inside the model see the other weights as not perturbed. ``argnums`` is
    spelled as in ``jax.grad``; ``argnum`` is a deprecated alias (a
    :class:`jaxmem.JaxmemDeprecationWarning`; a TypeError when both are given with different
    values).
    """
    from flax import nnx  # local: keeps `import jaxmem.selective` light

    if argnum is not None:
        from jaxmem import _deprecation
        _deprecation.warn("jaxmem.selective.nnx_value_and_grad(argnum=...)",
                          "nnx_value_and_grad(argnums=...)")
        if argnums != 0 and argnums != argnum:
            raise TypeError(f"nnx_value_and_grad: got argnums={argnums!r} and the deprecated "
                            f"argnum={argnum!r}; pass argnums only")
        argnums = argnum
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"nnx_value_and_grad: argnums must be an int, got {argnums!r}")
    if trainable is None:
        trainable = nnx.Param
    return nnx.value_and_grad(fn, argnums=nnx.DiffState(argnums, trainable), has_aux=has_aux)
