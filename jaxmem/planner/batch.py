"""``max_batch``: the largest batch whose gradient step fits a compiled-bytes budget."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["BatchFit", "max_batch"]


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """Largest batch within ``budget_bytes``: untouched step (``default_batch``, compiled
    ``default_bytes``) and planned step (``planned_batch``, ``planned_bytes``, ``plan``).
    A batch of 0 means even batch 1 does not fit."""

    budget_bytes: int
    default_batch: int
    default_bytes: int
    planned_batch: int
    planned_bytes: int
    plan: Any


def _largest(fits: Callable[[int], Any], start: int, limit: int) -> tuple[int, Any]:
    """Largest ``b`` in [1, limit] with ``fits(b)`` not None (fits assumed monotone): double
    from ``start``, then bisect. Returns (b, fits(b)); (0, None) if batch 1 does not fit."""
    lo, lo_val = 0, None
    b = max(1, min(start, limit))
    while True:
        v = fits(b)
        if v is None:
            hi = b
            break
        lo, lo_val = b, v
        if b >= limit:
            return lo, lo_val
        b = min(2 * b, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = fits(mid)
        if v is None:
            hi = mid
        else:
            lo, lo_val = mid, v
    return lo, lo_val


def max_batch(step: Callable[..., Any], make_args: Callable[[int], tuple], budget: Any, *,
              limit: int = 1 << 16, planned: bool = True, **plan_kwargs: Any) -> BatchFit:
    """Largest batch ``b`` whose step on ``make_args(b)`` compiles to at most ``budget``
    bytes, untouched and (``planned=True``) through :func:`jaxmem.plan`. Both hold
    :func:`jaxmem.plan`'s promise: ``jax.value_and_grad`` *and* ``jax.grad`` of the step
    within the budget (XLA may plan the two apart, either larger), on the plan's ``target``
    (``plan_kwargs``; XLA:CPU by default). So the planned batch is never below the default
    one: a plan of a batch whose untouched step fits is the step itself.

    Compiled bytes grow with the batch, so the search doubles ``b`` until it fails and then
    bisects (``O(log b)`` compiles for the default, as many :func:`plan` calls for the
    planned step, which starts from the default's batch: a plan can always store everything).

    Args:
      step: ``step(params, *batch) -> scalar`` loss.
      make_args: ``make_args(b) -> (params, *batch)`` example arguments for batch ``b``.
      budget: bytes (int) or a size string such as ``"256MiB"`` (a fraction is refused: the
        default's bytes change with the batch).
      limit: largest batch tried.
      planned: also search the planned step.
      **plan_kwargs: passed to :func:`jaxmem.plan` (e.g. ``max_iterations``).

    Returns:
      A :class:`BatchFit` (``default_bytes``: the larger of the untouched step's
      ``value_and_grad`` and ``grad`` compiled totals).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.planner import max_batch
      >>> w = jnp.ones((16, 16))
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> fit = max_batch(loss, lambda b: (w, jnp.ones((b, 16))), "64KiB", planned=False)
      >>> fit.default_batch > 0 and fit.default_bytes <= 64 * 1024
      True
    """
    from jaxmem.measure import compiled_memory
    from jaxmem.planner.api import BudgetError, budget_spec, parse_budget, plan

    if not callable(step):
        raise TypeError(f"max_batch: step must be callable, got {type(step).__name__}")
    if not callable(make_args):
        raise TypeError(f"max_batch: make_args must be callable (batch -> args), got "
                        f"{type(make_args).__name__}")
    if budget_spec(budget, "max_batch")[0] == "fraction":
        raise TypeError(f"max_batch: budget must be bytes or a size string such as '256MiB', "
                         f"got the fraction {budget!r} (the default's bytes change with batch)")
    if not (isinstance(limit, int) and limit >= 1):
        raise ValueError(f"max_batch: limit must be an int >= 1, got {limit!r}")
    budget_bytes = parse_budget(budget)

    def args_of(b):
        a = make_args(b)
        if not isinstance(a, tuple):
            raise TypeError(f"max_batch: make_args({b}) must return a tuple of arguments, got "
                            f"{type(a).__name__}")
        return a

    target = plan_kwargs.get("target", "cpu")

    def default_fits(b):
        args = args_of(b)
        t = 0
        for fn in (jax.value_and_grad(step), jax.grad(step)):   # grad only when vg fits
            t = max(t, compiled_memory(fn, *args, target=target).total_bytes)
            if t > budget_bytes:
                return None
        return t

    db, dbytes = _largest(default_fits, 1, limit)
    pb, pplan = 0, None
    if planned:
        def plan_fits(b):
            try:
                return plan(step, *args_of(b), budget=budget_bytes, **plan_kwargs)
            except BudgetError:
                return None

        pb, pplan = _largest(plan_fits, max(db, 1), limit)
    return BatchFit(budget_bytes, db, int(dbytes or 0), pb,
                    int(pplan.compiled_bytes) if pplan is not None else 0, pplan)
