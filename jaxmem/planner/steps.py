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
    units (cut after ``cut_labels``; ``"segment"`` recomputes them as one chunk,
    ``"segment2"`` as one chunk whose units -- for one unit: its children,
    :func:`jaxmem.planner.trace.child_units` -- are checkpointed again inside it),
    ``conversions`` the per-layer tracing conversions, recomputed units fenced (``fence``,
    see :func:`jaxmem.planner.trace.fenced_checkpoint`);
    takes the loss's positional and keyword arguments; re-traced for new shapes."""
    cache: dict[Any, tuple[Any, list[_trace.Unit], dict, dict]] = {}
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
            merged, opts, inner, used = [], {}, {}, 0
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
                if o == "segment2" or o.startswith("partial"):
                    # nested: its units, or one unit's children, again; partial: its children
                    inner[u.label] = present if len(present) > 1 else \
                        _trace.child_units(tr, present[0])
            if used != len(units):
                raise ValueError(f"plan: the step traced with new shapes has {len(units)} "
                                 f"units, the plan covers {used}")
            cache[key] = (tr, merged, opts, inner)
        tr, merged, opts, inner = cache[key]
        dyn = [a for i, a in enumerate(leaves) if i not in static]
        outs = _trace.run_chunks(tr.closed, merged, opts, dyn, fence=fence, inner=inner)
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
    ``jax.checkpoint``). On a GPU target XLA keeps a plain ``jax.checkpoint``, so each choice
    is compiled unfenced first and that is kept when it fits ``budget`` (or the choice
    recomputes nothing); otherwise it is compiled fenced as well and the fewer bytes decide,
    for that choice only (which plan compiles smaller either way depends on the choice: GPT
    4x64 every block recomputed 10.44 MiB fenced vs 11.94 unfenced, blocks in pairs 16.69 vs
    16.21). A fenced choice costs ``fence_flops`` per checkpointed item
    (:meth:`extra_cost`); ``notes`` counts the choices each way."""

    def __init__(self, loss, factory, cut_labels, labels, candidates, args, target="cpu",
                 compile_bytes: Callable[..., int] = compiled_total, budget: int | None = None,
                 fence_flops: float = 0.0):
        self.loss, self.factory, self.args, self.target = loss, factory, tuple(args), target
        self.cut_labels, self.labels = list(cut_labels), list(labels)
        self.candidates = list(candidates)
        self.compile_bytes = compile_bytes
        self.budget = budget
        self.fence_flops = float(fence_flops)
        #: per compiled choice: whether its recomputed units run fenced
        self.fenced: dict[Any, bool] = {}

    @property
    def always_fenced(self) -> bool:
        """Whether every choice runs fenced (CPU)."""
        return self.target == "cpu"

    @property
    def notes(self) -> list[str]:
        if self.always_fenced:
            return []
        ck = [c for c in self.fenced if self.checkpointed(c)]
        if not ck:
            return []
        n_f = sum(self.fenced[c] for c in ck)
        return [(f"{self.target} plan: recomputed units run as plain jax.checkpoint (unfenced) "
                 f"in {len(ck) - n_f} of {len(ck)} compiled plans, behind the lax.cond fence "
                 f"in {n_f} (where unfenced exceeded the budget and fenced compiled smaller)")]

    def checkpointed(self, choice) -> int:
        """Number of ``jax.checkpoint`` calls (fences when fenced) the items of ``choice`` run
        (a nested segment: one, plus one per unit inside it)."""
        return sum(self.candidates[i].checkpoints for i in choice)

    def fence_of(self, choice) -> bool:
        """Whether ``choice`` runs fenced (on a GPU target: as decided when it was compiled;
        unfenced before that)."""
        return True if self.always_fenced else self.fenced.get(choice, False)

    def extra_cost(self, choice) -> float:
        """Predicted FLOPs the fence adds to ``choice`` beyond its candidates' costs."""
        if self.always_fenced or not self.fence_of(choice):
            return 0.0
        return self.fence_flops * self.checkpointed(choice)

    def realise(self, choice) -> tuple[tuple, dict]:
        """``(runs, conversions)`` of ``choice`` for :func:`make_step`."""
        runs, convs = [], {}
        for i in sorted(choice, key=lambda i: self.candidates[i].cover[0]):
            cand = self.candidates[i]
            conv = cand.option.conversion()
            if conv is not None:
                convs[cand.converts or self.labels[cand.cover[-1]]] = conv
            runs.append((tuple(self.labels[u] for u in cand.cover), cand.option.run_as))
        if any(c.kind == "fewbit" for c in convs.values()):
            for lbl in self.cut_labels:
                convs.setdefault(lbl, _trace.Conversion("exact"))
        return tuple(runs), convs

    def build(self, choice, fence: bool | None = None) -> Callable[..., Any]:
        """The step of ``choice`` (fenced as decided, unless ``fence`` is given)."""
        runs, convs = self.realise(choice)
        return make_step(self.loss, self.factory, self.cut_labels, runs, convs,
                         fence=self.fence_of(choice) if fence is None else fence)

    def _compile(self, fn) -> int:
        return self.compile_bytes(fn, self.args, self.target)

    def value_and_grad(self, choice) -> int:
        if self.always_fenced:
            return self._compile(jax.value_and_grad(self.build(choice, True)))
        plain = self._compile(jax.value_and_grad(self.build(choice, False)))
        self.fenced[choice] = False
        if not self.checkpointed(choice) or (self.budget is not None and plain <= self.budget):
            return plain
        fenced = self._compile(jax.value_and_grad(self.build(choice, True)))
        if fenced < plain:
            self.fenced[choice] = True
            return fenced
        return plain

    def grad(self, choice) -> int:
        return self._compile(jax.grad(self.build(choice)))
