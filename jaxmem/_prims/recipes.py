"""Recipes: values that a backward rule may recompute instead of storing.

``remember(y, fn, args, kept_if)`` records ``y == fn(*args)`` bit for bit, where the producer
of ``y`` keeps ``args`` for its own backward whenever one of ``args[i]``, ``i in kept_if``, is
differentiated. A normalisation registers its output with the tensors its backward keeps
(``x``, statistics, parameters), an exact smooth activation its output with its input, and a
1-bit mask activation (:mod:`jaxmem._prims.mask`) applied to a recorded value registers its
own output as ``f(fn(*args))`` with the same ``args`` (:func:`then`).
:func:`combine` records an elementwise function of *several* recorded values (the residual
add ``bn3(c3) + shortcut`` of a ResNet block, whose ReLU then records the block output): its
``args`` are all of theirs, kept only when every producer keeps its own (``kept_if`` holds
one group of indices per producer, :func:`kept`). A bilinear layer fed such a value
(``jaxmem.selective.linear``) then keeps those same tensors (one residual shared by all the
rules) instead of a second input-sized array, and recomputes its input in the backward pass.
:func:`extend` records a *pointwise convolution* of such a value (``conv(relu(bn2(c2)), W)``,
the 1x1 expansion of a ResNet bottleneck): a normalisation fed it keeps the producer's
arguments and ``W`` instead of its own input, and recomputes the convolution in the backward
pass. A recipe's ``depth`` counts such non-elementwise steps; it is at most one (a value
recorded with :func:`extend` is not extended again), so no backward rule recomputes more than
one convolution per value it reads. :func:`project` records a *dense projection* of such a
value (``LN(x) W``: an attention's queries, keys and values) at depth :data:`PROJECTED`;
only the attention core (:mod:`jaxmem.selective.attention`) reads those, keeping the norm's
residuals and ``W`` instead of ``q, k, v`` -- bilinear layers and normalisations ignore them,
so no other rule starts recomputing products.
XLA would not do this by itself: it keeps what the rules store. The recomputation is the
forward's own arithmetic; XLA may still fuse it differently (a multiply-add contracted in one
fusion and not in the other), so a kernel gradient computed from it can differ from the
stored-input one at f32 rounding level (bit-identical for the ResNets measured, CPU).
"""
from __future__ import annotations

import functools
import weakref

__all__ = ["PROJECTED", "combine", "depth", "extend", "kept", "project", "recipe", "remember",
           "remember_weight", "then", "weight_recipe"]

# ``id(y) -> (ref, fn, args, groups, depth)``; an entry goes when ``y`` is garbage.
_recipes: dict = {}
# ``id(w) -> (ref, fn, args)``: weights computed from the step's inputs (:func:`remember_weight`)
_weights: dict = {}

#: the depth of a recipe recorded by :func:`project`: read by the attention core only
PROJECTED = 2

#: the most arguments a recipe may collect (:func:`combine` chains grow with the depth of
#: a residual stage; past this the value is simply stored)
MAX_ARGS = 64


def _groups(kept_if) -> tuple:
    """``kept_if`` as a tuple of index groups: ``(0, 3)`` is one group, ``((0, 3), (5,))``
    two (every group must have a differentiated member)."""
    kept_if = tuple(kept_if)
    if not kept_if:  # no argument differentiated can make the producer keep them
        return ((),)
    if all(isinstance(g, tuple) for g in kept_if):
        return tuple(tuple(int(i) for i in g) for g in kept_if)
    return (tuple(int(i) for i in kept_if),)


def remember(y, fn, args, kept_if=(0, 3), depth=0) -> None:
    """Record that ``y`` equals ``fn(*args)`` bit for bit (until ``y`` is garbage), and that
    the producer of ``y`` keeps ``args`` for its backward when any ``args[i]``,
    ``i in kept_if``, is differentiated (the default: a normalisation's ``x`` and ``scale``).
    ``kept_if`` may also be a tuple of such groups: the ``args`` are kept when every group
    has a differentiated member (:func:`combine`). ``depth``: how many non-elementwise ops
    (convolutions) ``fn`` runs (:func:`extend`)."""
    key = id(y)

    def _drop(_, key=key):
        _recipes.pop(key, None)

    try:
        ref = weakref.ref(y, _drop)
    except TypeError:  # not weak-referenceable (plain numbers): nothing to record
        return
    _recipes[key] = (ref, fn, tuple(args), _groups(kept_if), int(depth))


def recipe(x):
    """``(fn, args, groups)`` recorded by :func:`remember` for this very object ``x``, else
    ``None``; ``groups`` is a tuple of index groups (see :func:`kept`)."""
    entry = _recipes.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3]


def depth(x) -> int:
    """How many convolutions the recipe of ``x`` recomputes (0 without a recipe)."""
    entry = _recipes.get(id(x))
    if entry is None or entry[0]() is not x:
        return 0
    return entry[4]


def kept(args, groups, perturbed) -> bool:
    """Whether the producers keep ``args`` for their own backward: every group of indices
    has a member ``args[i]`` for which ``perturbed(args[i])`` holds."""
    return all(any(perturbed(args[i]) for i in g) for g in groups)


def _composed(outer, inner, *args):
    return outer(inner(*args))


def then(y, outer, x) -> None:
    """Record ``y == outer(x)`` as ``outer(fn(*args))`` when ``x`` has a recipe
    ``(fn, args, groups)`` (same ``args`` and ``groups``); nothing otherwise. ``outer`` must
    be elementwise and deterministic, so the recomputation is ``y`` bit for bit."""
    r = recipe(x)
    if r is not None:
        fn, args, groups = r
        remember(y, functools.partial(_composed, outer, fn), args, groups, depth(x))


def _combined(op, parts, *args):
    vals = [fn(*args[lo:hi]) if fn is not None else args[lo] for fn, lo, hi in parts]
    return op(*vals)


def combine(y, op, *xs) -> bool:
    """Record ``y == op(*xs)`` when every array in ``xs`` has a recipe: ``op`` applied to
    their recomputations, from all of their ``args`` (concatenated), kept when every one of
    their producers keeps its own (their index groups, shifted). ``op`` must be elementwise,
    deterministic and exact as computed (``y`` bit for bit). Python scalars in ``xs`` are
    constants of ``op``; anything else without a recipe records nothing. Returns whether
    ``y`` was recorded."""
    parts, args, groups, deepest = [], [], [], 0
    for x in xs:
        if isinstance(x, (int, float, bool, complex)):
            parts.append((None, len(args), len(args) + 1))
            args.append(x)
            continue
        r = recipe(x)
        if r is None:
            return False
        fn, a, gs = r
        deepest = max(deepest, depth(x))
        lo = len(args)
        parts.append((fn, lo, lo + len(a)))
        args.extend(a)
        groups.extend(tuple(lo + i for i in g) for g in gs)
    if not groups or len(args) > MAX_ARGS:
        return False
    remember(y, functools.partial(_combined, op, tuple(parts)), tuple(args), tuple(groups),
             deepest)
    return True


def _extended(op, inner, n, *args):
    return op(inner(*args[:n]), *args[n:])


def extend(y, op, x, extra=(), *, elementwise=False) -> bool:
    """Record ``y == op(x, *extra)`` when ``x`` has a one-producer recipe: ``op`` applied to
    the recomputed ``x``, from that recipe's ``args`` followed by ``extra``, kept under the
    same condition (the producer keeps its ``args``; ``op``'s own rule keeps ``extra``
    whenever ``x`` is differentiated). ``op`` must be deterministic. ``elementwise=False``:
    ``op`` is a convolution (a pointwise one, its weight in ``extra``): recorded with depth 1,
    and only for an ``x`` of depth 0. ``elementwise=True``: ``op`` is elementwise in ``x``
    (given ``extra``: a norm's output from its input and statistics; a rotary embedding's
    ``sin`` / ``cos`` factors), the depth is ``x``'s, and ``x``'s recipe may have several
    producers (:func:`combine`: the halves of a projection concatenated).
    Returns whether ``y`` was recorded."""
    if elementwise:
        return _extend(y, op, x, extra, depth(x), any_producers=True)
    return depth(x) == 0 and _extend(y, op, x, extra, 1)


def _extend(y, op, x, extra, new_depth: int, any_producers: bool = False) -> bool:
    """``y == op(recomputed x, *extra)`` at ``new_depth`` when ``x`` has a one-producer
    recipe (:func:`extend`, :func:`project`), or any recipe with ``any_producers`` (an
    elementwise ``op``: the same producers keep the same ``args``)."""
    r = recipe(x)
    if r is None:
        return False
    fn, args, groups = r
    if (len(groups) != 1 and not any_producers) or len(args) + len(extra) > MAX_ARGS:
        return False
    remember(y, functools.partial(_extended, op, fn, len(args)), tuple(args) + tuple(extra),
             groups, new_depth)
    return True


def project(y, op, x, extra=()) -> bool:
    """Record ``y == op(x, *extra)`` -- a dense product of ``x`` with a weight in ``extra`` --
    when ``x`` has a one-producer recipe of depth 0 (a normalisation's or an exact smooth
    activation's output): ``op`` applied to the recomputed ``x``, from that recipe's ``args``
    followed by ``extra``, at depth :data:`PROJECTED`. Only the attention core reads such a
    recipe (its ``q, k, v`` recomputed in its backward pass from what the norm keeps anyway,
    one product each). ``op`` must be deterministic. Returns whether ``y`` was recorded."""
    return depth(x) == 0 and _extend(y, op, x, extra, PROJECTED)


def remember_weight(w, fn, args) -> None:
    """Record that the weight ``w`` equals ``fn(*args)`` bit for bit, where every array in
    ``args`` is an input of the step (a parameter: alive for the whole step, so keeping it
    costs nothing) and ``fn`` runs a few parameter-sized ops (a merged LoRA weight
    ``W + A B``, a cast ``W.astype(bfloat16)``). A bilinear layer that would keep ``w`` for
    its input gradient keeps ``args`` instead and recomputes ``w`` in its backward pass
    (:func:`weight_recipe`)."""
    key = id(w)

    def _drop(_, key=key):
        _weights.pop(key, None)

    try:
        ref = weakref.ref(w, _drop)
    except TypeError:
        return
    _weights[key] = (ref, fn, tuple(args))


def weight_recipe(w):
    """``(fn, args)`` recorded by :func:`remember_weight` for this very object ``w``, else
    ``None``."""
    entry = _weights.get(id(w))
    if entry is None or entry[0]() is not w:
        return None
    return entry[1], entry[2]
