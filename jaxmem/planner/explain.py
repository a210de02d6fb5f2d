"""What the search found, in words: one :class:`UnitChoice` per chosen candidate, and the
:class:`BudgetError` of a refused budget (the least total reached and what dominates it)."""
from __future__ import annotations

from collections.abc import Sequence

from jaxmem.planner.model import ByteModel, Choice
from jaxmem.planner.options import Candidate, partial_children
from jaxmem.planner.result import BudgetError, UnitChoice

__all__ = ["refusal", "unit_choices"]

_MIB = 2.0**20


def _why(cand: Candidate, saved: int, extra: float) -> str:
    """One line: why this option, and what it costs."""
    kind, param = cand.option.kind, cand.option.param
    if kind == "store":
        return "fits: keeping its residuals costs no recompute"
    if kind == "fewbit":
        return f"{param}-bit activation codes drop {saved / _MIB:.3f} MiB (approximate gradient)"
    if kind == "offload":
        return (f"matmul outputs ({saved / _MIB:.3f} MiB) kept in host memory, copied back "
                f"for the backward pass (elementwise work between them recomputed)")
    if kind == "rows":
        what = "row-tiled" if cand.option.stages is None else \
            f"its trunk's {cand.option.tiled_stages} row-tiled"
        return (f"{what} into {param} tiles: recompute {extra / 1e6:.1f} MFLOP to drop "
                f"{saved / _MIB:.3f} MiB (exact)")
    if kind == "partial":
        return (f"recompute {extra / 1e6:.1f} MFLOP ({', '.join(_children(cand, False))} "
                f"again; {', '.join(_children(cand, True))} stored) to drop "
                f"{saved / _MIB:.3f} MiB")
    if cand.option.nested:
        inner = f"its {len(cand.cover)} units" if len(cand.cover) > 1 else "its children"
        return (f"recompute {extra / 1e6:.1f} MFLOP, nested (as one chunk, then {inner} "
                f"each again inside its backward, where only their inputs are kept) to drop "
                f"{saved / _MIB:.3f} MiB")
    return f"recompute {extra / 1e6:.1f} MFLOP to drop {saved / _MIB:.3f} MiB"


def _children(cand: Candidate, stored: bool) -> tuple[str, ...]:
    """A ``partial`` candidate's stored (or recomputed) children, by label."""
    flags = partial_children(cand.option.param)
    return tuple(lbl for lbl, s in zip(cand.children, flags) if s == stored)


def unit_choices(model: ByteModel, choice: Choice, labels: Sequence[str],
                 fence: float) -> tuple[UnitChoice, ...]:
    """The choice by first unit; ``recompute_flops`` is the cost without the ``fence`` (one
    per ``jax.checkpoint`` call of the candidate)."""
    out = []
    for i in model.in_order(choice):
        cand = model.candidates[i]
        c = cand.cover
        label = labels[c[0]] if len(c) == 1 else f"{labels[c[0]]}..{labels[c[-1]]}"
        extra = cand.cost - fence * cand.checkpoints
        kind, param = cand.option.kind, cand.option.param
        out.append(UnitChoice(label, kind, int(cand.keep_bytes), int(cand.work_bytes),
                              float(extra), _why(cand, model.saving(i), extra),
                              bits=param if kind == "fewbit" else None,
                              rows=param if kind == "rows" else None,
                              nested=cand.option.nested, stages=cand.option.stages,
                              partial=param if kind == "partial" else None,
                              recomputed=_children(cand, False) if kind == "partial" else ()))
    return tuple(out)


def refusal(budget: int, smallest: int, cm0, labels: Sequence[str], stored: Sequence[int],
            n_compiled: int, finer_units: bool, peak_of=None) -> BudgetError:
    """The error of a refused ``budget``: ``smallest`` is the least total reached, ``cm0``
    the untouched step's compiled memory (arguments and outputs bound every plan);
    ``peak_of()`` reads the live peak of the plan that reached ``smallest``."""
    floor = cm0.argument_bytes + cm0.output_bytes - cm0.alias_bytes
    n = len(labels)
    dominant = {"arguments (parameters, batch, state)": cm0.argument_bytes,
                "outputs (loss, gradients)": cm0.output_bytes,
                "temporaries of that plan": max(0, smallest - floor)}
    if n:
        big = max(range(n), key=lambda i: stored[i])
        dominant[f"largest unit working set ({labels[big]}; part of the temporaries)"] = \
            stored[big]
    parts = ", ".join(f"{k} {v / _MIB:.2f} MiB" for k, v in
                      sorted(dominant.items(), key=lambda kv: -kv[1]))
    below = budget < floor
    lead = (f"the step's arguments (parameters, batch, state) take "
            f"{cm0.argument_bytes / _MIB:.2f} MiB and its outputs (loss, gradients) "
            f"{cm0.output_bytes / _MIB:.2f} MiB before any activation is kept; " if below else "")
    if not n:
        lead += ("no layer boundary was found in the loss (no Flax Linen method call and no "
                 "jaxmem.planner.tag(x, name)), so nothing can be recomputed: tag the outputs "
                 "of its layers with jaxmem.planner.tag; ")
    return BudgetError(
        f"plan: budget {budget / _MIB:.2f} MiB cannot be met; {lead}the smallest compiled "
        f"total reached is {smallest / _MIB:.2f} MiB (a budget plan meets; default "
        f"{cm0.total_bytes / _MIB:.2f} MiB; {n} units, {n_compiled} plans compiled); dominated "
        f"by {parts}" + (" (arguments and outputs)" if below else "")
        + ("; err.smallest_peak() says what is live at that plan's peak" if peak_of else ""),
        smallest, dominant, finer_units=finer_units and not below, peak_of=peak_of)
