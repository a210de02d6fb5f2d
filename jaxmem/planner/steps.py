"""The planned step: the loss run unit by unit with a choice of options, and the loss whose
gradient runs an OLLA-ordered step; :class:`StepCompiler` compiles the step of a choice."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem.planner import trace as _trace

__all__ = ["StepCompiler", "compiled_total", "make_step", "ordered_step"]


def _signature(fn):
    """``inspect.signature(fn)``, or ``None`` when it has none."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind(sig, args, kwargs):
    """``(args, kwargs)`` with every keyword argument that names a positional parameter of
    the loss moved into ``args`` (``TypeError`` for arguments the loss does not take)."""
    if sig is None:
        return tuple(args), dict(kwargs)
    try:
        ba = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"plan.step takes the loss's arguments: {e}") from None
    return tuple(ba.args), dict(ba.kwargs)


def _is_static(x) -> bool:
    """Leaves the planned step does not trace: strings, ``None`` and other non-numbers."""
    return not (isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
                or hasattr(x, "aval") or isinstance(x, jax.ShapeDtypeStruct))


def _hashable(x):
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


def _abstract(x):
    if isinstance(x, (bool, int, float, complex)):
        return jax.ShapeDtypeStruct((), jax.numpy.result_type(x), weak_type=True)
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def make_step(fn, factory, cut_labels, runs, conversions, fence=True):
    """The loss evaluated unit by unit: ``runs`` are ``(labels, option)`` over consecutive
    units (cut after ``cut_labels``), ``conversions`` the per-layer tracing conversions,
    recomputed units fenced (``fence``, see :func:`jaxmem.planner.trace.fenced_checkpoint`);
    takes the loss's positional and keyword arguments; re-traced for new shapes."""
    cache: dict[Any, tuple[Any, list[_trace.Unit], dict]] = {}
    cut_labels, runs = tuple(cut_labels), tuple(runs)
    conversions = dict(conversions)
    sig = _signature(fn)
    fn = _trace.unjit(fn)

    def step(*args, **kwargs):
        args, kwargs = _bind(sig, args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        static = tuple(i for i, a in enumerate(leaves) if _is_static(a))
        key = (tree, tuple((i, _hashable(a)) if i in static else
                           (tuple(np.shape(a)), str(jax.numpy.result_type(a)),
                            isinstance(a, (bool, int, float, complex)))
                           for i, a in enumerate(leaves)))
        if key not in cache:
            spec = [a if i in static else _abstract(a) for i, a in enumerate(leaves)]
            static_vals = {i: leaves[i] for i in static}

            def traced(*dyn):
                it = iter(dyn)
                full = [static_vals[i] if i in static_vals else next(it)
                        for i in range(len(leaves))]
                a, k = jax.tree_util.tree_unflatten(tree, full)
                return fn(*a, **k)

            dyn_spec = tuple(x for i, x in enumerate(spec) if i not in static_vals)
            tr = _trace.trace(traced, dyn_spec, factory() if factory else None,
                              conversions or None)
            units = _trace.units_at(tr, cut_labels)
            by_label = {u.label: u for u in units}
            merged, opts, used = [], {}, 0
            for labels, o in runs or [((u.label,), "store") for u in units]:
                present = [by_label[lbl] for lbl in labels if lbl in by_label]
                if not present:
                    raise ValueError(f"plan: the step traced with new shapes has no unit "
                                     f"{labels[-1]!r}; the plan was made for other code")
                used += len(present)
                u = present[0] if len(present) == 1 else _trace.Unit(
                    f"{present[0].label}..{present[-1].label}", present[0].start,
                    present[-1].stop, present[0].depth)
                merged.append(u)
                opts[u.label] = "recompute" if o == "segment" else o
            if used != len(units):
                raise ValueError(f"plan: the step traced with new shapes has {len(units)} "
                                 f"units, the plan covers {used}")
            cache[key] = (tr, merged, opts)
        tr, merged, opts = cache[key]
        dyn = [a for i, a in enumerate(leaves) if i not in static]
        outs = _trace.run_chunks(tr.closed, merged, opts, dyn, fence=fence)
        return jax.tree_util.tree_unflatten(tr.out_tree, outs)

    step.__name__ = getattr(fn, "__name__", "step") + "_planned"
    return step


def _float0_like(x):
    return np.zeros(np.shape(x), jax.dtypes.float0)


def ordered_step(fn, order_fn, example_args):
    """The loss whose gradient runs the OLLA-ordered ``value_and_grad`` step ``order_fn``.

    For arguments of the example's structure, shapes and dtypes the result is a
    ``jax.custom_vjp`` function: its value is ``fn``'s, its forward pass runs ``order_fn``
    (value and gradient w.r.t. the first argument, in the order), and its backward pass
    scales that gradient by the cotangent, so ``jax.grad`` / ``jax.value_and_grad`` of it
    compile to the ordered step. Cotangents of the other arguments (rarely wanted) are the
    untouched loss's, computed by an extra pass in the backward (XLA drops it when unused);
    non-float leaves get ``float0`` zeros. Other shapes run ``fn`` itself."""
    sig = _signature(fn)
    want = jax.tree_util.tree_structure(tuple(example_args))
    want_leaves = [(tuple(np.shape(a)), str(jax.numpy.result_type(a)))
                   for a in jax.tree_util.tree_leaves(tuple(example_args))]

    @jax.custom_vjp
    def ordered(*args):
        return fn(*args)

    def fwd(*args):
        v, g = order_fn(*args)
        return v, (g, args)

    def bwd(res, ct):
        g, args = res
        out = [jax.tree_util.tree_map(lambda x: (ct * x).astype(x.dtype), g)]
        rest = args[1:]
        leaves, tree = jax.tree_util.tree_flatten(rest)
        fl = [i for i, x in enumerate(leaves) if _trace._is_float(x)]
        cts = [_float0_like(x) for x in leaves]
        if fl:
            def on_float(*xf):
                full = list(leaves)
                for i, x in zip(fl, xf):
                    full[i] = x
                return fn(args[0], *jax.tree_util.tree_unflatten(tree, full))

            _, vjp = jax.vjp(on_float, *[leaves[i] for i in fl])
            for i, c in zip(fl, vjp(ct)):
                cts[i] = c
        out += list(jax.tree_util.tree_unflatten(tree, cts))
        return tuple(out)

    ordered.defvjp(fwd, bwd)

    def step(*args, **kwargs):
        args, kwargs = _bind(sig, args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(args)
        if not kwargs and tree == want and [
                (tuple(np.shape(a)), str(jax.numpy.result_type(a))) for a in leaves] \
                == want_leaves:
            return ordered(*args)
        return fn(*args, **kwargs)

    step.__name__ = getattr(fn, "__name__", "step") + "_ordered"
    return step


def compiled_total(fn: Callable[..., Any], args: tuple, target: str = "cpu") -> int:
    """Compiled bytes (temp + output + argument - alias) of ``jax.jit(fn)`` on ``args`` for
    ``target`` (:func:`jaxmem.measure.compiled_memory`)."""
    from jaxmem.measure import compiled_memory
    return compiled_memory(fn, *args, target=target).total_bytes


class StepCompiler:
    """The real compiler of the search (:class:`jaxmem.planner.search.Compiler`): builds the
    step a choice of ``candidates`` runs (:func:`make_step`) and compiles its
    ``value_and_grad`` / ``grad`` with ``compile_bytes`` (default :func:`compiled_total`).

    Recomputed units run behind the ``lax.cond`` fence on CPU (XLA:CPU undoes a bare
    ``jax.checkpoint``); on a GPU target the first choice compiled (the search compiles every
    unit recomputed first) is compiled fenced and unfenced, and the fewer bytes decide for
    every later choice (a line in ``notes``)."""

    def __init__(self, loss, factory, cut_labels, labels, candidates, args, target="cpu",
                 compile_bytes: Callable[..., int] = compiled_total):
        self.loss, self.factory, self.args, self.target = loss, factory, tuple(args), target
        self.cut_labels, self.labels = list(cut_labels), list(labels)
        self.candidates = list(candidates)
        self.compile_bytes = compile_bytes
        self.fence: bool | None = True if target == "cpu" else None
        self.notes: list[str] = []

    def realise(self, choice) -> tuple[tuple, dict]:
        """``(runs, conversions)`` of ``choice`` for :func:`make_step`."""
        runs, convs = [], {}
        for i in sorted(choice, key=lambda i: self.candidates[i].cover[0]):
            cand = self.candidates[i]
            conv = cand.option.conversion()
            if conv is not None:
                convs[self.labels[cand.cover[-1]]] = conv
            runs.append((tuple(self.labels[u] for u in cand.cover), cand.option.run_as))
        if any(c.kind == "fewbit" for c in convs.values()):
            for lbl in self.cut_labels:
                convs.setdefault(lbl, _trace.Conversion("exact"))
        return tuple(runs), convs

    def build(self, choice, fence: bool | None = None) -> Callable[..., Any]:
        """The step of ``choice`` (fenced as decided, unless ``fence`` is given)."""
        runs, convs = self.realise(choice)
        return make_step(self.loss, self.factory, self.cut_labels, runs, convs,
                         fence=self.fence if fence is None else fence)

    def value_and_grad(self, choice) -> int:
        if self.fence is None:
            return self._choose_fence(choice)
        return self.compile_bytes(jax.value_and_grad(self.build(choice)), self.args,
                                  self.target)

    def grad(self, choice) -> int:
        return self.compile_bytes(jax.grad(self.build(choice)), self.args, self.target)

    def _choose_fence(self, choice) -> int:
        fenced, unfenced = (self.compile_bytes(jax.value_and_grad(self.build(choice, f)),
                                               self.args, self.target) for f in (True, False))
        self.fence = fenced < unfenced
        mib = 2.0**20
        self.notes.append(f"{self.target} plan: recomputed units "
                          f"{'fenced' if self.fence else 'unfenced'} (every unit recomputed: "
                          f"fenced {fenced / mib:.2f} MiB, unfenced {unfenced / mib:.2f} MiB)")
        return min(fenced, unfenced)
