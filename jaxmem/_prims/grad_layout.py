"""Where a sharded train step wants each weight gradient reduced, for backward rules to use.

Under data or fully sharded parallelism (``jax.jit`` with shardings, XLA's SPMD partitioner)
the gradient of a weight ``W`` is the sum of the devices' partial gradients; the train step
reduce-scatters it onto the update layout (:func:`jaxmem.distributed.update_shardings`).
Nothing in the backward pass needs that reduced gradient, so XLA:GPU's scheduler is free to
form every layer's ``dW`` at the very end, next to the (combined) reduce-scatter, and it
does: each layer's cotangent and recomputed input then stay alive until the end of the
backward pass (measured on the H100 plan: a converted 4-layer GPT under 8-way DP held 24 MiB
at its peak where one device holds 15 MiB).

:func:`reduced_here` lets a backward rule reduce ``dW`` where it is formed, onto the layout
that the step in context (:func:`gradient_layout`) will put it in anyway
(``with_sharding_constraint``: values unchanged, the same reduce-scatter moved), and
:func:`jaxmem._prims.ties.after` with ``split=True`` then makes the rule's input gradient
wait for it. Outside :func:`gradient_layout` both are the identity.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxmem._prims.bitpack import shard_axes_in_context
from jaxmem._prims.ties import after, tie, together

__all__ = ["active", "bilinear_gradients", "gathered", "gradient_layout", "input_after",
           "placed", "reduced_here", "regathered_product", "regathering_recomputes",
           "repeated_collectives", "reslice_recomputable", "stored", "unplaced", "used",
           "weights_local", "weights_whole"]

_LAYOUT: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "jaxmem_gradient_layout", default=None)
_STORE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxmem_weight_store", default=None)
_REPEAT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxmem_repeat_collectives", default=False)


@contextlib.contextmanager
def gradient_layout(layout: Callable | None, store: Callable | None = None,
                    gather: Any = None) -> Iterator[None]:
    """Within the block, :func:`reduced_here` lays a weight gradient out as
    ``layout(shape) -> Sharding | None`` (``None``: leave it where XLA puts it).

    ``store`` and ``gather`` (fully sharded data parallelism): a layer keeps a weight for its
    backward pass laid out as ``store(shape)`` (its shard; the gathered copy is then dropped
    after the forward use) and gathers it back to ``gather`` once the backward pass reaches
    it (:func:`stored`, :func:`gathered`)."""
    for name, f in (("layout", layout), ("store", store)):
        if f is not None and not callable(f):
            raise TypeError(f"gradient_layout: {name} must be callable or None, got {f!r}")
    token = _LAYOUT.set(layout)
    # the third item: parameters the step placed (gathered) for the loss -> their shards
    token_s = _STORE.set(None if store is None else (store, gather, {}))
    try:
        yield
    finally:
        _STORE.reset(token_s)
        _LAYOUT.reset(token)


def active() -> bool:
    """Whether a :func:`gradient_layout` is in context."""
    return _LAYOUT.get() is not None


def _inside_shard_map() -> bool:
    """Whether the trace is inside ``shard_map`` (a manual mesh axis in context): there a
    per-device ``dW`` is reduced by the rule's own collectives, not by a layout."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    return not mesh.empty and any(t == manual for t in mesh.axis_types)


def split_by_spmd() -> bool:
    """Whether the trace is of a program XLA's SPMD partitioner splits: the mesh in context
    (``jax.set_mesh``, :mod:`jaxmem.distributed`'s steps) has an axis of size > 1 that is not
    manual (inside ``shard_map`` arrays are per-device: ``False``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = jax.sharding.AxisType.Manual
    return any(int(mesh.shape[n]) > 1 and t != manual
               for n, t in zip(mesh.axis_names, mesh.axis_types))


def weights_whole() -> bool:
    """Whether a layer's weight is whole on every device, so that recomputing a product of it
    in the backward pass adds no collective: no program split by XLA's SPMD partitioner, or
    a step in context that splits no feature axis (``shard_axes()`` with no names: data
    parallelism) and keeps no weight as its shard (no store layout: a fully sharded step
    without ``reduce_early`` reads the weights it gathered at the start)."""
    if not split_by_spmd():
        return True
    return shard_axes_in_context() == () and _STORE.get() is None


def weights_local() -> bool:
    """Whether a product of a weight with an input that every device holds whole runs on
    each device without a collective: :func:`weights_whole`, or a tensor parallel step in
    context (:func:`jaxmem._prims.bitpack.shard_axes` names feature axes, no store layout),
    whose rules split the query, key and value projections along their output features:
    each device forms its own slice of the output (a column-parallel ``q = LN(x) W_q``).
    Re-slicing such an output along those features (a fused ``q, k, v`` projection split in
    three) moves it between devices: :func:`weights_whole` alone says where that is free."""
    if weights_whole():
        return True
    return bool(shard_axes_in_context()) and _STORE.get() is None


@contextlib.contextmanager
def repeated_collectives(allow: bool) -> Iterator[None]:
    """Within the block (``allow=True``) backward rules may recompute a value whose forward
    moved data between devices, repeating those collectives for fewer bytes kept
    (:func:`reslice_recomputable`; ``jaxmem.distributed.train_step(...,
    repeat_collectives=True)``)."""
    if not isinstance(allow, bool):
        raise TypeError(f"repeated_collectives: allow must be True or False, got {allow!r}")
    token = _REPEAT.set(allow)
    try:
        yield
    finally:
        _REPEAT.reset(token)


def reslice_recomputable() -> bool:
    """Whether a recorded projection may still be recomputed after a ``slice`` / ``split``
    of its features (a fused ``q, k, v`` projection split three ways): where weights are
    whole (:func:`weights_whole`), or where the step in context lets collectives run again
    in the backward pass (:func:`repeated_collectives`) and each device forms its own slice
    (:func:`weights_local`: the split's collectives repeat) or the whole product from a
    gathered weight (:func:`regathering_recomputes`: the split is local)."""
    return weights_whole() or (_REPEAT.get() and (weights_local()
                                                  or regathering_recomputes()))


def regathering_recomputes() -> bool:
    """Whether a projection of a weight kept as its shard (a fully sharded step with a store
    layout, :func:`stored`) may be recomputed from that shard gathered once more: the step in
    context allows repeated collectives (:func:`repeated_collectives`; one more all-gather
    of the weight per recomputation) and the trace is not inside ``shard_map``."""
    return _REPEAT.get() and _store_gathers()


def regathered_product(fn: Callable):
    """``fn(x, w)`` with ``w`` (a shard kept for the backward pass) laid out as the step in
    context gathers weights (:func:`gradient_layout`'s ``gather``, read now): the product a
    recomputation forms from the shard (:func:`regathering_recomputes`)."""
    gather = _STORE.get()[1]

    def product(x, w, *rest):
        return fn(x, jax.lax.with_sharding_constraint(w, gather), *rest)

    return product


def reduced_here(dw):
    """``dw`` (values unchanged) laid out as the step in context reduces it; ``None`` when
    no layout is in context, it names none for ``dw``'s shape, or inside ``shard_map``."""
    layout = _LAYOUT.get()
    if layout is None or dw is None or _inside_shard_map():
        return None
    sharding = layout(tuple(dw.shape))
    if sharding is None:
        return None
    return jax.lax.with_sharding_constraint(dw, sharding)


def input_after(dx, grads, *, everywhere: bool = False):
    """``(dx, grads)``: a backward rule's input gradient ``dx`` made to wait (XLA:GPU) for its
    parameter gradients ``grads`` (an array, a tuple of them, ``None`` entries skipped).

    With a :func:`gradient_layout` in context each gradient is first laid out as the step
    reduces it (:func:`reduced_here`) and ``dx`` waits for every reduced one on every shard
    (``after(..., split=True)``); without one this is ``after(dx, g, everywhere=...)`` per
    gradient (nothing on XLA:CPU, nothing under SPMD) and ``grads`` are returned unchanged."""
    single = not isinstance(grads, tuple)
    out = []
    for g in ((grads,) if single else grads):
        if g is not None and dx is not None:
            placed = reduced_here(g)
            if placed is None:
                dx = after(dx, g, everywhere=everywhere)
            else:
                g = placed
                dx = after(dx, g, split=True)
        out.append(g)
    return dx, (out[0] if single else tuple(out))


def bilinear_gradients(dx, dw, joint: bool = True):
    """``(dx, dw)`` of a bilinear layer's backward pass, ordered for XLA:GPU.

    With a :func:`gradient_layout` in context, inside ``shard_map`` or when not ``joint``:
    :func:`input_after` (``dw`` reduced where it is formed, ``dx`` waiting for it; nothing on
    one device). Otherwise (one device, or a program XLA's SPMD partitioner splits):
    :func:`jaxmem._prims.ties.together`, one barrier over both on XLA:GPU where the program
    is not split, so the optimizer's in-place update of a donated weight follows the product
    ``g W^T`` that reads it and XLA does not copy the weight to protect that read; nothing
    on XLA:CPU. Convolutions pass ``joint=False``: on the H100 plan the joint barrier raised
    ResNet-18's "all" gradient step from 4.80 to 5.59 MiB."""
    if active() or _inside_shard_map() or not joint:
        return input_after(dx, dw)
    return together(dx, dw)


def stored(w, out):
    """``(out, w_kept)``: a weight kept for the backward pass, laid out as its shard when the
    step in context gathers weights where they are used (:func:`gradient_layout`'s
    ``store``), with the layer's output ``out`` made to wait for that shard (XLA:GPU), so
    the shard is cut in the forward pass and the gathered copy dies there (left free, XLA
    cuts it just before the backward uses it and keeps the whole gathered weight alive
    until then). ``(out, w)`` when no store layout is in context."""
    st = _STORE.get()
    if st is None or w is None or _inside_shard_map():
        return out, w
    sharding = st[0](tuple(w.shape))
    if sharding is None:
        return out, w
    kept = jax.lax.with_sharding_constraint(w, sharding)
    return after(out, kept, split=True), kept


def placed(w_use, w_shard) -> None:
    """Record that the step hands the loss ``w_use``, the parameter ``w_shard`` gathered for
    use (``"fsdp"``: replicated), so that a layer of jaxmem's reading ``w_use`` can gather
    ``w_shard`` itself, where it runs (:func:`unplaced`, :func:`used`). Nothing without a
    store layout in context."""
    st = _STORE.get()
    if st is not None:
        st[2][id(w_use)] = (w_use, w_shard)   # both held: the id stays theirs while tracing


def unplaced(w):
    """The shard that the step gathered into ``w`` (:func:`placed`), else ``w``.

    A step that gathers every parameter before the loss runs gives XLA independent
    all-gathers, which it combines into one at the start of the step: every gathered weight
    is then live at once (ResNet-50 w0.25 under 8-way FSDP on the H100 plan: 7.21 MiB temp
    per device). A layer that takes the shard instead gathers it where it runs
    (:func:`used`), and the step's own gathered copy, left without a use, is not made."""
    st = _STORE.get()
    if st is None or w is None:
        return w
    hit = st[2].get(id(w))
    return hit[1] if hit is not None and hit[0] is w else w


def used(w, dep, tied: bool = False):
    """A weight as the layer's forward pass uses it, once ``dep`` (the layer's input) exists.

    With a store layout in context (``"fsdp"``): :func:`gathered` (``w`` tied to ``dep`` and
    then laid out to be gathered), so each layer's all-gather runs where the layer does and
    no earlier (a weight the step already gathered is left as it is).
    Else ``tie(w, dep)`` if ``tied`` (a convolution's re-laid-out kernel copies made next to
    their use, :mod:`jaxmem.selective.linear`), or ``w``. Values unchanged."""
    if _gathers(w):
        return gathered(w, dep)
    return tie(w, dep) if tied and w is not None else w


def gathered(w, dep):
    """A weight from :func:`stored`, gathered back (``gradient_layout``'s ``gather``) only
    once ``dep`` (the backward's cotangent) exists: ``tie(w, dep)`` first, so XLA cannot
    gather it earlier (or keep the forward's gathered copy instead). ``w`` itself when no
    store layout is in context."""
    if not _gathers(w):
        return w
    return jax.lax.with_sharding_constraint(tie(w, dep), _STORE.get()[1])


def _gathers(w) -> bool:
    """Whether :func:`gathered` gathers ``w``: a weight, and :func:`_store_gathers`."""
    return w is not None and _store_gathers()


def _store_gathers() -> bool:
    """A store layout in context (weights kept as shards, gathered where used), outside
    ``shard_map``."""
    return _STORE.get() is not None and not _inside_shard_map()
