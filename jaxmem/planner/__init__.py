"""``jaxmem.planner``: fit a training step's gradient into a memory budget.

:func:`plan` traces the loss with its Flax Linen layers tagged, cuts it into units, chooses
per unit whether to keep its residuals, recompute them (``jax.checkpoint``) or recompute a
segment of units as one, by CP-SAT, and verifies the choice in XLA's compiled bytes.
:func:`max_batch` (also ``jaxmem.plan.max_batch``) finds the largest batch within a budget;
:func:`conversion_time` prices what jaxmem's conversion adds to a step by itself.
See docs/plan.md.
"""
from jaxmem.planner.api import (
    BudgetError,
    MemoryPlan,
    UnitChoice,
    budget_spec,
    conversion_time,
    parse_budget,
    plan,
)
from jaxmem.planner.batch import BatchFit, max_batch
from jaxmem.planner.trace import tag

plan.max_batch = max_batch

__all__ = ["BatchFit", "BudgetError", "MemoryPlan", "UnitChoice", "budget_spec",
           "conversion_time", "max_batch", "parse_budget", "plan", "tag"]
