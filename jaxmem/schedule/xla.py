"""Re-emit a traced step in a planned order as one traceable function (for ``jax.jit``).

XLA schedules a jitted computation itself, so the order of equations in a jaxpr is only
a hint. :func:`as_function` rebuilds the step from a node order and can insert
``lax.optimization_barrier`` fences: the order is cut into ``chunks`` consecutive
pieces and, at each cut, every value still needed later passes through one barrier, so
nothing after the cut can be hoisted above it and nothing before it sunk below. This is
the experiment behind "can the plan lower XLA's compiled bytes?" (see README.md (schedule section)
and ``benchmarks/schedule/xla_barriers.py``). :func:`apply_order` is the entry point that
uses it: it compiles the re-emitted step for a target (XLA:CPU or XLA:GPU's plan) and keeps
the order only where that plan is smaller than the step's own.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .executor import _bind
from .jaxpr_graph import TracedStep, trace

__all__ = ["AppliedOrder", "apply_order", "as_function"]


def as_function(ts: TracedStep, order: Sequence[str] | None = None, chunks: int = 1):
    """A function of the *flat* inputs returning the flat outputs, evaluating the
    equations in ``order`` (default: program order) with ``chunks - 1`` barrier cuts."""
    g = ts.graph
    order = list(order) if order is not None else g.program_order
    g.check_order(order)
    if not (isinstance(chunks, int) and chunks >= 1):
        raise ValueError(f"chunks: must be an int >= 1, got {chunks!r}")
    pos = {v: t for t, v in enumerate(order)}
    last = {}
    for vid, ename in ts.edge_of.items():
        e = g.edges[ename]
        last[vid] = len(order) if (e.output or e.persistent) else max(
            (pos[s] for s in e.sinks), default=pos[e.src])
    op_steps = [t for t, v in enumerate(order) if v in ts.node_eqn]
    cuts = set()
    if chunks > 1 and op_steps:
        k = len(op_steps)
        cuts = {op_steps[(i * k) // chunks] for i in range(1, chunks)}
    in_pos = {name: k for k, name in enumerate(n for n in g.nodes if n.startswith("in:"))}
    const_of = {g.edges[ts.edge_of[i]].src: i for i in ts.consts if i in ts.edge_of}

    def fn(*flat_args):
        env = {}

        def read(a):
            if isinstance(a, tuple):
                return a[1]
            if a in ts.views:
                veq, src = ts.views[a]
                return _bind(veq, [read(src)] + [b[1] for b in veq.invars[1:]])[0]
            return env[a]

        for t, node in enumerate(order):
            if t in cuts:
                keys = [k for k in env if last.get(k, len(order)) >= t]
                vals = jax.lax.optimization_barrier([env[k] for k in keys])
                env.update(zip(keys, vals))
            if node in in_pos:
                env[ts.in_ids[in_pos[node]]] = flat_args[in_pos[node]]
            elif node in const_of:
                env[const_of[node]] = ts.consts[const_of[node]]
            else:
                eq = ts.node_eqn[node]
                outs = _bind(eq, [read(a) for a in eq.invars])
                for o, val in zip(eq.outvars, outs):
                    if o is not None:
                        env[o] = val
        return [read(a) for a in ts.out_ids]

    return fn


@dataclasses.dataclass(frozen=True)
class AppliedOrder:
    """What :func:`apply_order` kept.

    Attributes:
      fn: the step re-emitted in the order (jitted, same signature, donation and output
        pytree as the input function) when ``applied``, else the input function itself.
      applied: True only when the re-emitted step compiles to fewer bytes on ``target``.
      chunks: the barrier chunks of the kept re-emission (``None`` when not applied).
      compiled_bytes: compiled bytes (``temp + output + argument - alias``) of ``fn``.
      baseline_bytes: compiled bytes of the input function on ``target``.
      baseline_temp_bytes / temp_bytes: the ``temp`` part of those two.
      candidates: chunks -> compiled bytes of every re-emission tried (a variant that did not
        compile is absent); ``candidate_temp_bytes`` the same for their ``temp`` part.
      target: the plan the bytes are from (``"cpu"``, ``"h100"``, ...).
      why: one line saying what was kept and why.
    """

    fn: Callable[..., Any]
    applied: bool
    chunks: int | None
    compiled_bytes: int
    baseline_bytes: int
    temp_bytes: int
    baseline_temp_bytes: int
    candidates: dict
    target: str
    why: str
    candidate_temp_bytes: dict = dataclasses.field(default_factory=dict)

    @property
    def reduction(self) -> float:
        """``1 - compiled_bytes / baseline_bytes`` (0 when not applied)."""
        return 1.0 - self.compiled_bytes / max(self.baseline_bytes, 1)


def _pytree_step(ts: TracedStep, order, chunks: int, donate: tuple, name: str):
    flat_fn = as_function(ts, order, chunks)

    def step(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != ts.in_tree:
            raise ValueError(f"apply_order: arguments must have the traced structure "
                             f"{ts.in_tree}, got {tree}")
        return jax.tree_util.tree_unflatten(ts.out_tree, flat_fn(*leaves))

    step.__name__ = f"{name}_ordered_{chunks}"
    return jax.jit(step, donate_argnums=donate)


def apply_order(fn: Callable[..., Any], order, *args: Any, traced: TracedStep | None = None,
                chunks: int | Sequence[int] = (1, 4, 16), target: str = "cpu",
                donate_argnums: int | Sequence[int] = ()) -> AppliedOrder:
    """Re-emit ``fn`` in ``order`` under ``jax.jit`` and keep it only where it lowers the plan.

    The step is rebuilt in ``order`` (:func:`as_function`) cut into ``k`` barrier-fenced
    chunks for every ``k`` in ``chunks``; each re-emission and ``fn`` itself are compiled
    for ``target`` (:func:`jaxmem.measure.compiled_memory`, the same ``donate_argnums``)
    and the re-emission of fewest compiled bytes is kept only when it is strictly below
    ``fn``'s bytes (fewer chunks on a tie). Otherwise ``fn`` is returned unchanged: an
    order never makes the target's plan larger. The order is judged on the target asked
    for: XLA:GPU (``"h100"``) and XLA:CPU schedule differently, and barriers that lower one
    can raise the other (``benchmarks/results/gpu_plan/schedule_zoo.md``).

    Args:
      fn: the step (a function of array pytrees).
      order: a :class:`~jaxmem.schedule.Schedule` or a node order of ``fn``'s graph
        (``trace(fn, *args, donate_argnums=...)``).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` leaves; nothing is run).
      traced: ``fn``'s :class:`TracedStep` when already traced (else traced here).
      chunks: barrier chunk counts to try (ints >= 1; 1 = the order without barriers).
      target: ``"cpu"`` or a GPU plan such as ``"h100"`` (compiled without a GPU).
      donate_argnums: arguments donated, both for ``fn`` and for the re-emitted step.

    Returns:
      An :class:`AppliedOrder`; ``result.fn`` is what to run.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem import schedule
      >>> def step(w, x):
      ...     return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
      >>> w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
      >>> ts = schedule.trace(step, w, x)
      >>> plan = schedule.optimize(ts.graph, time_limit=1.0)
      >>> r = schedule.apply_order(step, plan, w, x, traced=ts, target="cpu")
      >>> r.compiled_bytes <= r.baseline_bytes
      True
      >>> bool(jnp.allclose(r.fn(w, x), step(w, x)))
      True
    """
    from jaxmem.measure import compiled_memory
    from jaxmem.measure.target import check_target

    from .plan import Schedule

    if not callable(fn):
        raise TypeError(f"apply_order: fn must be callable, got {type(fn).__name__}")
    target = check_target(target, 1, "apply_order")
    if isinstance(chunks, int) and not isinstance(chunks, bool):
        chunks = (chunks,)
    ks = tuple(chunks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"apply_order: chunks must be an int >= 1 or a non-empty sequence "
                         f"of them, got {chunks!r}")
    ks = tuple(sorted(set(ks)))
    donate = tuple(sorted({donate_argnums} if isinstance(donate_argnums, int)
                          else set(donate_argnums)))
    ts = traced if traced is not None else trace(fn, *args, donate_argnums=donate)
    node_order = list(order.order) if isinstance(order, Schedule) else list(order)
    ts.graph.check_order(node_order)
    base = compiled_memory(fn, *args, donate_argnums=donate, target=target)
    name = getattr(fn, "__name__", "step")
    best, cands, temps, errors = None, {}, {}, []
    for k in ks:
        step = _pytree_step(ts, node_order, k, donate, name)
        try:
            c = compiled_memory(step, *args, donate_argnums=donate, target=target)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
            errors.append(f"{k} chunks: {type(e).__name__}")
            continue
        cands[k], temps[k] = c.total_bytes, c.temp_bytes
        if best is None or c.total_bytes < best[1].total_bytes:
            best = (step, c, k)
    mib = 2.0**20
    keep = best is not None and best[1].total_bytes < base.total_bytes
    if keep:
        step, c, k = best
        why = (f"the order lowers the {target} plan {base.total_bytes / mib:.2f} -> "
               f"{c.total_bytes / mib:.2f} MiB ({k} chunks)")
        return AppliedOrder(step, True, k, c.total_bytes, base.total_bytes, c.temp_bytes,
                            base.temp_bytes, cands, target, why, temps)
    if best is None:
        why = f"no re-emission compiled ({'; '.join(errors)}): kept fn"
    else:
        why = (f"XLA's own schedule is already as low on the {target} plan: order "
               f"{best[1].total_bytes / mib:.2f} MiB ({best[2]} chunks) >= "
               f"{base.total_bytes / mib:.2f} MiB: kept fn")
    return AppliedOrder(fn, False, None, base.total_bytes, base.total_bytes, base.temp_bytes,
                        base.temp_bytes, cands, target, why, temps)
