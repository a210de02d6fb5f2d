"""Run a traced step in a planned order, freeing every buffer after its last use.

:func:`execute` evaluates the flat equations of a :class:`~jaxmem.schedule.jaxpr_graph.TracedStep`
one node at a time in ``plan.order`` (op by op, like PyTorch eager: each primitive is
dispatched with ``Primitive.bind``, which JAX compiles and caches per shape). A node whose
operands are folded views runs as one small ``jax.jit`` of ``views + primitive`` so the
view costs no buffer. After each node, every value whose last reader (in *this* order)
has run is dropped, so the buffers alive between nodes are exactly the plan's resident
set. The results are the same primitives applied to the same values as ``fn`` itself,
so outputs are identical to un-jitted ``fn`` (bitwise: same kernels, same order of
floating-point operations inside each primitive).

Measurement (``stats``): after every node we sum ``nbytes`` over ``jax.live_arrays()``
(deduplicated by buffer), minus what was alive before the step that is not an argument.
That is the live-buffer peak of the executor, to compare with ``plan.peak``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .jaxpr_graph import TracedStep, trace
from .plan import Schedule, optimize

__all__ = ["ExecStats", "Scheduled", "execute"]


@dataclasses.dataclass
class ExecStats:
    peak_live_bytes: int | None  # measured with jax.live_arrays (None if not measured)
    predicted_peak: int  # simulate(graph, order)
    profile: list  # measured live bytes after each node
    seconds: float


def _live_bytes() -> int:
    seen = set()
    total = 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted():
                continue
            key = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - sharded / deleted arrays
            key = id(a)
        if key in seen:
            continue
        seen.add(key)
        total += a.nbytes
    return total


def _bind(eq, invals):
    params = eq.primitive.get_bind_params(eq.params)
    if eq.source is not None:
        with eq.source.ctx.manager:
            out = eq.primitive.bind(*invals, **params)
    else:
        out = eq.primitive.bind(*invals, **params)
    return out if eq.primitive.multiple_results else [out]


_JIT_CACHE: dict = {}


def _run_with_views(ts: TracedStep, eq, env):
    """jit(views + eq) over the root buffers of its view operands."""
    chains = []
    roots = []
    for a in eq.invars:
        if isinstance(a, int) and a in ts.views:
            chain = []
            x = a
            while x in ts.views:
                veq, src = ts.views[x]
                chain.append(veq)
                x = src
            chains.append(tuple(reversed(chain)))
            roots.append(x)
        else:
            chains.append(None)
            roots.append(a)
    key = (id(eq.source), tuple(tuple(id(c.source) for c in ch) if ch else None for ch in chains),
           tuple(str(ts.avals[r]) if isinstance(r, int) else None for r in roots))
    fn = _JIT_CACHE.get(key)
    if fn is None:
        lit = [r[1] if isinstance(r, tuple) else None for r in roots]

        def body(*vals):
            ins = []
            for v, ch, lv in zip(vals, chains, lit):
                if lv is not None:
                    ins.append(lv)
                    continue
                if ch:
                    for veq in ch:
                        v = _bind(veq, [v] + [b[1] for b in veq.invars[1:]])[0]
                ins.append(v)
            return _bind(eq, ins)

        fn = jax.jit(body)
        _JIT_CACHE[key] = fn
    vals = [None if isinstance(r, tuple) else env[r] for r in roots]
    return fn(*vals)


def execute(
    traced: TracedStep | Callable,
    plan: Schedule | Sequence[str] | None,
    *args,
    measure: bool = False,
    return_stats: bool = False,
    keep_donated: bool = False,
):
    """Run ``traced`` (or trace ``fn`` on ``args``) in ``plan.order`` and return exactly
    what the function returns. ``plan`` may be a :class:`Schedule`, a node order, or None
    (program order). With ``measure``/``return_stats`` also return :class:`ExecStats`.

    Leaves of arguments traced with ``donate_argnums`` are *deleted* after their last
    use (like a donated buffer under ``jax.jit``; the caller must not reuse them) unless
    ``keep_donated=True`` (then they stay alive and the measured peak includes them).

    Args:
      traced: a :class:`TracedStep` from :func:`trace`, or the function itself (traced
        here on ``args``).
      plan: a :class:`Schedule` from :func:`optimize`, a node order, or None.
      *args: the function's arguments (same structure, shapes and dtypes as traced).
      measure: also measure the live bytes after each node (``jax.live_arrays``).
      return_stats: return :class:`ExecStats` (predicted peak, time) even unmeasured.
      keep_donated: keep donated argument leaves alive instead of deleting them.

    Returns:
      The function's output pytree; ``(output, ExecStats)`` with ``measure`` or
      ``return_stats``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem import schedule
      >>> def step(w, x):
      ...     return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
      >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
      >>> traced = schedule.trace(step, w, x)
      >>> plan = schedule.optimize(traced.graph, time_limit=2.0)
      >>> out = schedule.execute(traced, plan, w, x)
      >>> bool(jnp.allclose(out, step(w, x)))
      True
    """
    if not isinstance(traced, TracedStep):
        if not callable(traced):
            raise TypeError(f"traced: expected a TracedStep or a callable, got {type(traced)}")
        traced = trace(traced, *args)
    ts = traced
    g = ts.graph
    if plan is None:
        order = g.program_order
    elif isinstance(plan, Schedule):
        order = plan.order
    else:
        order = list(plan)
    g.check_order(order)
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    if in_tree != ts.in_tree:
        raise ValueError(f"args: structure {in_tree} does not match the traced {ts.in_tree}")
    for k, (x, i) in enumerate(zip(flat_args, ts.in_ids)):
        av = ts.avals[i]
        if tuple(getattr(x, "shape", ())) != tuple(av.shape) or jax.numpy.result_type(x) != av.dtype:
            raise ValueError(
                f"args: leaf {k} has shape/dtype {getattr(x, 'shape', ())}/{jax.numpy.result_type(x)}, "
                f"traced with {av.shape}/{av.dtype}"
            )
    pos = {v: t for t, v in enumerate(order)}
    # last reader step of every root buffer (views included)
    last_use: dict[int, int] = {}
    for e_id, ename in ts.edge_of.items():
        e = g.edges[ename]
        if e.persistent or e.output:
            continue
        last_use[e_id] = max((pos[s] for s in e.sinks), default=pos[e.src])
    free_at: dict[int, list[int]] = {}
    for i, t in last_use.items():
        free_at.setdefault(t, []).append(i)

    stats_on = measure or return_stats
    before = 0
    if stats_on:
        arg_keys = set()
        arg_bytes = 0
        for x in flat_args:
            if isinstance(x, jax.Array):
                k = x.unsafe_buffer_pointer()
                if k not in arg_keys:
                    arg_keys.add(k)
                    arg_bytes += x.nbytes
        before = _live_bytes() - arg_bytes
    env: dict[int, Any] = {}
    in_pos = {name: k for k, name in enumerate(n for n in g.nodes if n.startswith("in:"))}
    const_of = {}
    for i in ts.consts:
        ename = ts.edge_of.get(i)
        if ename is not None:
            const_of[g.edges[ename].src] = i
    profile = []
    t0 = time.perf_counter()
    for t, node in enumerate(order):
        if node in in_pos:
            k = in_pos[node]
            env[ts.in_ids[k]] = flat_args[k]
        elif node in const_of:
            i = const_of[node]
            env[i] = ts.consts[i]
        else:
            eq = ts.node_eqn[node]
            if any(isinstance(a, int) and a in ts.views for a in eq.invars):
                outs = _run_with_views(ts, eq, env)
            else:
                invals = [a[1] if isinstance(a, tuple) else env[a] for a in eq.invars]
                outs = _bind(eq, invals)
            for o, val in zip(eq.outvars, outs):
                if o is not None:
                    env[o] = val
            del outs
        if stats_on:
            jax.block_until_ready([v for v in env.values() if isinstance(v, jax.Array)])
            profile.append(_live_bytes() - before)
        for i in free_at.get(t, []):
            val = env.pop(i, None)
            if i in ts.donated_ids and isinstance(val, jax.Array) and not keep_donated:
                val.delete()  # donation: the caller's buffer is consumed, as under jit
    seconds = time.perf_counter() - t0

    def value(a):
        if isinstance(a, tuple):
            return a[1]
        if a in env:
            return env[a]
        # a view returned directly is never folded (trace keeps it as a node)
        raise RuntimeError(f"internal: output value {a} was freed")

    outs = [value(a) for a in ts.out_ids]
    result = jax.tree_util.tree_unflatten(ts.out_tree, outs)
    if stats_on:
        from .simulate import simulate

        stats = ExecStats(max(profile) if profile else 0, simulate(g, order), profile, seconds)
        return result, stats
    return result


class Scheduled:
    """``Scheduled(step)(*args)``: trace ``step`` on the first call (per input
    structure/shapes), optimise its order with OLLA, then run it with :func:`execute`.

    Attributes after a call: ``plan``, ``traced``, ``stats`` (when ``measure=True``).
    """

    def __init__(self, fn: Callable, *, time_limit: float = 10.0, placement: bool = False,
                 donate_argnums=(), measure: bool = False, **optimize_kwargs) -> None:
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self.fn = fn
        self.time_limit = time_limit
        self.placement = placement
        self.donate_argnums = donate_argnums
        self.measure = measure
        self.optimize_kwargs = optimize_kwargs
        self._cache: dict = {}
        self.plan: Schedule | None = None
        self.traced: TracedStep | None = None
        self.stats: ExecStats | None = None

    def __call__(self, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((getattr(x, "shape", ()), str(jax.numpy.result_type(x)))
                           for x in leaves))
        if key not in self._cache:
            ts = trace(self.fn, *args, donate_argnums=self.donate_argnums)
            plan = optimize(ts.graph, time_limit=self.time_limit, placement=self.placement,
                            **self.optimize_kwargs)
            self._cache[key] = (ts, plan)
        self.traced, self.plan = self._cache[key]
        if self.measure:
            out, self.stats = execute(self.traced, self.plan, *args, measure=True)
            return out
        return execute(self.traced, self.plan, *args)
