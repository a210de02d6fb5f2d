"""``jaxmem.planner``: fit a training step's gradient into a memory budget.

:func:`plan` traces the loss with its Flax Linen layers tagged, cuts it into units, chooses
per unit whether to keep its residuals or recompute them (``jax.checkpoint``) by CP-SAT, and
verifies the choice in XLA's compiled bytes. See docs/plan.md.
"""
from jaxmem.planner.api import BudgetError, MemoryPlan, UnitChoice, parse_budget, plan
from jaxmem.planner.trace import tag

__all__ = ["BudgetError", "MemoryPlan", "UnitChoice", "parse_budget", "plan", "tag"]
