"""``ordered``: run a step in a low-peak (OLLA) order that XLA cannot undo.

XLA schedules a jitted computation itself, so re-emitting a step's equations in another
order changes nothing by itself. :func:`ordered` traces ``fn`` to its dataflow graph
(:func:`jaxmem.schedule.trace`), finds a node order of low resident-set peak, re-emits the
step in that order cut into ``k`` consecutive chunks (:func:`jaxmem.schedule.xla.as_function`:
at each cut every value still needed later passes through one ``lax.optimization_barrier``,
so no work crosses the cut), compiles it for every ``k`` in ``chunks`` and keeps the fenced
step only when XLA plans fewer bytes for it than for ``fn``:

    applied  <=>  min_k  compiled(ordered_k)  <  (1 - min_reduction) * compiled(fn)

where ``compiled(g) = temp + output + argument - alias`` of ``jax.jit(g)`` on the example
arguments (:func:`jaxmem.measure.compiled_memory`). The fenced step evaluates the same
primitives on the same values, so it returns ``fn``'s outputs (up to float rounding of a
different fusion); with ``verify=True`` both are run on the example arguments and the
fenced step is dropped unless they agree. Anything that cannot be ordered (a callback, a
side effect, a collective outside ``shard_map``), or an ordering or compilation that fails,
gives ``applied=False`` with the reason and ``fn`` itself, never an exception.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["OrderResult", "ordered"]

_MIB = 2.0**20
_SEARCHES = ("local", "ilp")


@dataclasses.dataclass(frozen=True)
class OrderResult:
    """What :func:`ordered` found.

    Attributes:
      fn: the fenced step when ``applied`` (same signature, outputs and pytree structure as
        the input function, for arguments of the example shapes and dtypes), else the input
        function itself.
      compiled_bytes: compiled bytes of ``fn`` on the example arguments.
      baseline_bytes: compiled bytes of the input function.
      applied: True only when the fenced step compiles to fewer bytes.
      why: one line saying what was done and why.
      chunks: number of fenced chunks of the step kept (``None`` when not applied).
      order_peak: resident-set peak of the order found (op-level graph, bytes; ``None`` when
        the step could not be traced); ``program_peak`` the same for the jaxpr's own order.
      order_seconds: wall time of tracing ``fn`` and searching the order.
      seconds: wall time of the whole call (trace, order search, compiles, verification).
    """

    fn: Callable[..., Any]
    compiled_bytes: int
    baseline_bytes: int
    applied: bool
    why: str
    chunks: int | None = None
    order_peak: int | None = None
    program_peak: int | None = None
    order_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def reduction(self) -> float:
        """``1 - compiled_bytes / baseline_bytes`` (0 when not applied)."""
        return 1.0 - self.compiled_bytes / max(self.baseline_bytes, 1)


def _check_args(fn, time_limit, chunks, search, verify,
                min_reduction) -> tuple[float, tuple[int, ...]]:
    if not callable(fn):
        raise TypeError(f"ordered: fn must be callable, got {type(fn).__name__} {fn!r}")
    if (isinstance(time_limit, (bool, np.bool_)) or not isinstance(time_limit, numbers.Real)
            or not math.isfinite(time_limit) or time_limit <= 0):
        raise ValueError(f"ordered: time_limit must be a finite number of seconds > 0, got "
                         f"{time_limit!r}")
    if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, (bool, np.bool_)):
        chunks = (chunks,)
    if not isinstance(chunks, Sequence) or not chunks or any(
            isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) or c < 2
            for c in chunks):
        raise ValueError(f"ordered: chunks must be an int >= 2 or a non-empty sequence of "
                         f"them (the number of fenced pieces to try), got {chunks!r}")
    if search not in _SEARCHES:
        raise ValueError(f"ordered: search must be one of {_SEARCHES}, got {search!r}")
    if (isinstance(min_reduction, (bool, np.bool_))
            or not isinstance(min_reduction, numbers.Real) or not 0 <= min_reduction < 1):
        raise ValueError(f"ordered: min_reduction must be a number in [0, 1) (the least "
                         f"fraction of compiled bytes the order must save), got "
                         f"{min_reduction!r}")
    if not isinstance(verify, (bool, np.bool_)):
        raise TypeError(f"ordered: verify must be a bool, got {type(verify).__name__} "
                        f"{verify!r}")
    return float(time_limit), tuple(sorted({int(c) for c in chunks}))


def _compile(fn, args, target="cpu"):
    """``(executable, temp + output + argument - alias)`` of ``jax.jit(fn)`` on ``args``
    (the figure :func:`jaxmem.measure.compiled_memory` reports as ``total_bytes``); a
    function that is already jitted is lowered as it is, so calling it reuses the compile.
    For a GPU ``target`` the bytes are XLA:GPU's plan and the executable is ``None`` (the
    compile-only devices run nothing)."""
    if target != "cpu":
        from jaxmem.measure import compiled_memory
        return None, compiled_memory(fn, *args, target=target).total_bytes
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)   # a jitted fn keeps its cache
    exe = jitted.lower(*args).compile()
    m = exe.memory_analysis()
    if m is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory_analysis()")
    total = (int(m.temp_size_in_bytes) + int(m.output_size_in_bytes)
             + int(m.argument_size_in_bytes) - int(m.alias_size_in_bytes))
    return exe, total


def _search_order(graph, time_limit: float, search: str) -> tuple[list[str], int, bool]:
    """``(order, peak, finished)``: a low-peak topological order of ``graph``.

    ``"local"``: the best greedy list schedule, then local search and block relocation, each
    run until no move lowers the peak (deterministic when they finish within
    ``time_limit``). ``"ilp"``: :func:`jaxmem.schedule.optimize` (adds the ordering ILP; its
    result depends on the time it gets). ``finished`` is False when a stage was cut by the
    time limit."""
    from jaxmem.schedule import improve_order, optimize, relocate_blocks
    from jaxmem.schedule.graph import OutOfTime
    from jaxmem.schedule.order import best_greedy_order
    from jaxmem.schedule.reach import Reach

    if search == "ilp":
        p = optimize(graph, time_limit=time_limit, placement=False)
        return list(p.order), int(p.peak), p.status in ("OPTIMAL", "WITHIN_GAP")
    t0 = time.perf_counter()
    end = t0 + time_limit
    order, peak, _ = best_greedy_order(graph, deadline=t0 + 0.25 * time_limit)
    finished = time.perf_counter() < t0 + 0.25 * time_limit
    try:
        reach = Reach(graph, deadline=t0 + 0.5 * time_limit)
    except OutOfTime:
        return order, int(peak), False
    for stage, share in ((improve_order, 0.4), (relocate_blocks, 1.0)):
        budget = share * (end - time.perf_counter())
        if budget <= 0:
            return order, int(peak), False
        s0 = time.perf_counter()
        o2, p2 = stage(graph, order, time_budget=budget, reach=reach)
        finished = finished and time.perf_counter() - s0 < 0.95 * budget
        if p2 < peak:
            order, peak = o2, p2
    return order, int(peak), finished


def _fenced_step(ts, order: list[str], k: int, name: str):
    """``ts``'s function re-emitted in ``order`` with ``k`` fenced chunks, on the original
    pytrees; arguments must have the traced shapes and dtypes."""
    from jaxmem.schedule.xla import as_function

    flat_fn = as_function(ts, order, k)
    # the avals' own dtypes: jnp.dtype() refuses extended dtypes such as typed PRNG keys
    want = [(tuple(ts.avals[i].shape), ts.avals[i].dtype) for i in ts.in_ids]

    def step(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != ts.in_tree:
            raise ValueError(f"ordered step: arguments must have the structure {ts.in_tree} "
                             f"of the example arguments, got {tree}")
        for j, (a, (shape, dtype)) in enumerate(zip(leaves, want)):
            got = (tuple(np.shape(a)), jnp.result_type(a))
            if got != (shape, dtype):
                raise ValueError(
                    f"ordered step: leaf {j} of the arguments has shape {got[0]} and dtype "
                    f"{got[1]}; the order was found for shape {shape} and dtype {dtype} "
                    "(call ordered() again for new shapes)")
        outs = flat_fn(*leaves)
        return jax.tree_util.tree_unflatten(ts.out_tree, outs)

    step.__name__ = name + "_ordered"
    return jax.jit(step)


def _max_rel_err(a, b) -> float:
    """Largest ``max|x - y| / max|y|`` over the leaves (``inf`` for a mismatch in structure,
    shape or a non-float leaf)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return math.inf
    worst = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            if not np.array_equal(x, y):
                return math.inf
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        if not np.array_equal(np.isnan(x), np.isnan(y)):
            return math.inf
        fin = ~np.isnan(y)
        if not fin.any():
            continue
        scale = float(np.max(np.abs(y[fin]))) or 1.0
        worst = max(worst, float(np.max(np.abs(x[fin] - y[fin]))) / scale)
    return worst


def _tolerance(out) -> float:
    """1e-4 when every float output has >= 32 bits, 5e-2 with a 16-bit float output."""
    small = any(jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                and jnp.dtype(jnp.result_type(x)).itemsize < 4
                for x in jax.tree_util.tree_leaves(out))
    return 5e-2 if small else 1e-4


def _unsupported_why(err: Exception) -> str:
    msg = str(err)
    m = re.search(r"(?:primitive|equation) '([^']+)'", msg)
    what = f"unsupported primitive {m.group(1)}" if m else f"unsupported step ({msg})"
    return f"{what}: kept XLA's order"


def ordered(fn: Callable[..., Any], *example_args: Any, time_limit: float = 10.0,
            chunks: int | Sequence[int] = (4, 16), search: str = "local",
            verify: bool = True, min_reduction: float = 0.0,
            target: str = "cpu") -> OrderResult:
    """Fence ``fn`` into a low-peak order when that lowers XLA's compiled bytes.

    Args:
      fn: a function of array pytrees, e.g. ``jax.value_and_grad(loss)`` or a whole
        training step.
      *example_args: arguments of the shapes and dtypes to order for (arrays, or
        ``jax.ShapeDtypeStruct`` leaves: then nothing is run and ``verify`` is skipped).
      time_limit: seconds for the order search (finite, > 0); tracing and compiling come on
        top (one compile of ``fn`` and one per entry of ``chunks``).
      chunks: the numbers of fenced pieces to try (ints >= 2); the one of fewest compiled
        bytes is kept (fewer pieces on a tie).
      search: ``"local"`` (greedy list schedule + local search + block relocation, each run
        to convergence: the same input gives the same order) or ``"ilp"`` (also the ordering
        ILP of :func:`jaxmem.schedule.optimize`; the order depends on the time it gets).
      verify: run ``fn`` and the fenced step on the example arguments and keep the fenced
        step only when every output leaf agrees within ``max|a - b| <= tol * max|b|``
        (``tol`` 1e-4, 5e-2 with a 16-bit float output).
      min_reduction: keep the fenced step only when it saves more than this fraction of
        the compiled bytes, ``ordered < (1 - min_reduction) * baseline`` (default 0: any
        saving).
      target: whose compiled bytes decide (:func:`jaxmem.measure.compiled_memory`'s
        ``target``: ``"cpu"`` or a GPU such as ``"h100"``); ``verify`` runs both steps on
        this process's CPU.

    Returns:
      An :class:`OrderResult`; ``result.fn`` is the fenced step when ``result.applied``,
      else ``fn``. Only bad arguments of ``ordered`` itself raise (``TypeError`` /
      ``ValueError``), and a ``fn`` that does not compile on ``example_args``
      (:class:`jaxmem.measure.TraceError`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.planner.order import ordered
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
      >>> r = ordered(jax.value_and_grad(loss), w, x, time_limit=1.0)
      >>> r.compiled_bytes <= r.baseline_bytes
      True
      >>> bool(jnp.allclose(r.fn(w, x)[0], loss(w, x)))
      True
    """
    time_limit, ks = _check_args(fn, time_limit, chunks, search, verify, min_reduction)
    from jaxmem.measure import compiled_memory
    from jaxmem.measure.target import check_target
    target = check_target(target, 1, "ordered")
    t0 = time.perf_counter()
    args = tuple(example_args)
    try:
        base_exe, base = _compile(fn, args, target)
    except Exception:
        compiled_memory(fn, *args, target=target)   # raises TraceError naming fn
        raise
    try:
        found = _find_order(fn, args, time_limit, search)
        step, exe, total, k = _best_fenced(found, ks, getattr(fn, "__name__", "step"), args,
                                           target)
        _check_gain(total, base, k, min_reduction, found)
        if verify:
            _verify(fn, step, base_exe, exe, args, found)
    except _Kept as kept:
        return OrderResult(fn=fn, compiled_bytes=base, baseline_bytes=base, applied=False,
                           why=kept.why, seconds=time.perf_counter() - t0, **kept.info)
    return OrderResult(
        fn=step, compiled_bytes=total, baseline_bytes=base, applied=True,
        why=(f"order lowered compiled bytes {base / _MIB:.2f} -> {total / _MIB:.2f} MiB "
             f"({k} fenced chunks){found.note}"),
        chunks=k, seconds=time.perf_counter() - t0, **found.info)


class _Kept(Exception):
    """The input function is kept: ``why``, and the :class:`OrderResult` fields known."""

    def __init__(self, why: str, **info):
        super().__init__(why)
        self.why, self.info = why, info


@dataclasses.dataclass
class _Found:
    """A traced step and the order found for it."""

    ts: Any
    order: list
    peak: int
    program_peak: int | None
    order_seconds: float
    finished: bool

    @property
    def note(self) -> str:
        return "" if self.finished else " (order search stopped at its time limit)"

    @property
    def info(self) -> dict:
        return {"order_peak": self.peak, "program_peak": self.program_peak,
                "order_seconds": self.order_seconds}


def _find_order(fn, args, time_limit: float, search: str) -> _Found:
    """Trace ``fn`` to its dataflow graph and search a low-peak order (``_Kept`` when the
    graph cannot be built or the search fails)."""
    from jaxmem.schedule.jaxpr_graph import UnsupportedPrimitiveError, trace
    from jaxmem.schedule.simulate import simulate

    t_order = time.perf_counter()
    try:
        ts = trace(fn, *args)
    except UnsupportedPrimitiveError as e:
        raise _Kept(_unsupported_why(e), order_seconds=time.perf_counter() - t_order) from None
    except Exception as e:  # noqa: BLE001 - a step whose graph cannot be built is kept
        raise _Kept(f"its dataflow graph could not be built ({type(e).__name__}: {e}): kept "
                    "XLA's order", order_seconds=time.perf_counter() - t_order) from None
    g = ts.graph
    try:
        program_peak = int(simulate(g, g.program_order))
    except ValueError:
        program_peak = None
    try:
        order, peak, finished = _search_order(g, time_limit, search)
    except Exception as e:  # noqa: BLE001 - a failed search keeps XLA's order
        raise _Kept(f"order search failed ({type(e).__name__}: {e}): kept XLA's order",
                    program_peak=program_peak,
                    order_seconds=time.perf_counter() - t_order) from None
    return _Found(ts, order, peak, program_peak, time.perf_counter() - t_order, finished)


def _best_fenced(found: _Found, ks, name: str, args, target: str):
    """``(step, executable, compiled bytes, k)`` of the fenced step of fewest bytes over
    ``k`` in ``ks`` (``_Kept`` when none compiles)."""
    best, errors = None, []
    for k in ks:
        try:
            step = _fenced_step(found.ts, found.order, k, name)
            exe, total = _compile(step, args, target)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
            errors.append(f"{k} chunks: {type(e).__name__}: {e}")
            continue
        if best is None or total < best[2]:
            best = (step, exe, total, k)
    if best is None:
        raise _Kept(f"the ordered step did not compile ({'; '.join(errors)}): kept XLA's "
                    "order", **found.info)
    return best


def _check_gain(total: int, base: int, k: int, min_reduction: float, found: _Found) -> None:
    """``_Kept`` unless the fenced step saves more than ``min_reduction`` of ``base``."""
    if total >= base:
        raise _Kept(f"XLA's own order is already as low: ordered {total / _MIB:.2f} MiB "
                    f"({k} fenced chunks) >= {base / _MIB:.2f} MiB{found.note}", **found.info)
    if min_reduction and not total < (1.0 - min_reduction) * base:
        raise _Kept(f"the order saves {1 - total / base:.2%} of the compiled bytes "
                    f"({base / _MIB:.2f} -> {total / _MIB:.2f} MiB, {k} fenced chunks), not "
                    f"more than min_reduction {min_reduction:.2%}: kept XLA's "
                    f"order{found.note}", **found.info)


def _verify(fn, step, base_exe, exe, args, found: _Found) -> None:
    """Run both steps on concrete example arguments; ``_Kept`` unless they agree."""
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(args)):
        return
    try:
        want = (base_exe or _compile(fn, args)[0])(*args)
        got = (exe or _compile(step, args)[0])(*args)
        err = _max_rel_err(got, want)
        tol = _tolerance(want)
    except Exception as e:  # noqa: BLE001 - an ordered step that cannot run is dropped
        raise _Kept(f"the ordered step failed on the example arguments "
                    f"({type(e).__name__}: {e}): kept XLA's order", **found.info) from None
    if not err <= tol:
        raise _Kept(f"the ordered step differs from fn on the example arguments (max "
                    f"relative error {err:.3g} > {tol:g}): kept XLA's order", **found.info)
