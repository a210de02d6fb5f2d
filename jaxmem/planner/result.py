"""What :func:`jaxmem.planner.plan` returns (:class:`MemoryPlan`, one :class:`UnitChoice`
per unit) or raises (:class:`BudgetError`)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxmem.planner.options import NESTED, Option

__all__ = ["BudgetError", "MemoryPlan", "UnitChoice"]


class BudgetError(ValueError):
    """The budget cannot be met; ``smallest_bytes`` is the least compiled total reached.
    :meth:`smallest_peak` says what is live at that plan's peak."""

    def __init__(self, msg: str, smallest_bytes: int, dominant: dict[str, int],
                 finer_units: bool = False, peak_of=None):
        super().__init__(msg)
        self.smallest_bytes = smallest_bytes
        self.dominant = dominant
        self.finer_units = finer_units   # a finer cut into units exists (plan tries it)
        self._peak_of, self._peak = peak_of, None

    def smallest_peak(self):
        """The :class:`jaxmem.measure.LivePeak` of the smallest plan reached (its
        ``value_and_grad`` compiled again with XLA's dump, once: seconds), e.g.
        ``print(err.smallest_peak().top(5))``; ``None`` where no plan was built."""
        if self._peak is None and self._peak_of is not None:
            self._peak = self._peak_of()
        return self._peak


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """One unit's option: ``store`` (keep its residuals), ``dots`` (keep matmul/conv outputs,
    recompute the rest), ``recompute`` (keep its inputs only), ``segment`` (several units
    recomputed as one chunk; with ``nested``, its units are checkpointed again inside that
    recomputation: two-level, exact), ``fewbit`` (stored with ``bits``-bit activation codes:
    approximate) or ``rows`` (a conv trunk row-tiled into ``rows`` tiles: exact; with
    ``stages``, only its first ``stages`` pooling stages are tiled, the rest run as before)
    or ``partial`` (the children in ``recomputed`` recomputed, each consecutive run as one
    chunk, the others stored; ``partial`` is the option's mask, ``Option("partial", ...)``:
    exact)."""

    label: str
    option: str
    keep_bytes: int
    work_bytes: int
    recompute_flops: float
    why: str
    bits: int | None = None
    rows: int | None = None
    nested: bool = False
    stages: int | None = None
    partial: int | None = None
    recomputed: tuple[str, ...] = ()

    @property
    def as_option(self) -> Option:
        """The typed :class:`~jaxmem.planner.options.Option` (``str`` gives ``fewbit2``;
        a nested segment ``segment2``)."""
        if self.nested:
            return Option(self.option, NESTED)
        if self.partial is not None:
            return Option(self.option, self.partial)
        return Option(self.option, self.bits if self.bits is not None else self.rows,
                      self.stages)


def _option_text(c: UnitChoice) -> str:
    """``fewbit 2b`` / ``rows 8`` / ``segment nested`` / the option name."""
    if c.nested:
        return f"{c.option} nested"
    if c.recomputed:
        return f"{c.option} ({', '.join(c.recomputed)} recomputed)"
    if c.bits is not None:
        return f"{c.option} {c.bits}b"
    if c.rows is not None:
        return f"{c.option} {c.rows}" + (
            "" if c.stages is None else f" ({c.as_option.tiled_stages})")
    return c.option


@dataclasses.dataclass
class MemoryPlan:
    """What :func:`plan` chose. ``step`` takes the loss's arguments (positional and keyword)
    and returns its values; its gradients are the untouched loss's (exact options only), and
    ``jax.value_and_grad(step)``, ``jax.grad(step)`` and :meth:`value_and_grad` compile to
    at most ``budget_bytes`` on ``target``'s plan for arguments of the example's shapes
    (``compiled_bytes`` is ``value_and_grad(step)``'s compiled total; for an OLLA-order plan
    the largest of the three; ``jax.grad(step)`` is compiled and checked too)."""

    step: Callable[..., Any]
    choices: tuple[UnitChoice, ...]
    budget_bytes: int
    default_bytes: int
    predicted_bytes: int
    compiled_bytes: int
    predicted_time: float
    selective: bool
    solver_status: str
    solver_gap: float
    iterations: int
    approximate: bool = False
    notes: tuple[str, ...] = ()
    order: Any = None
    target: str = "cpu"
    #: rows per chunk of the loss's language-model head when the plan computes it in chunks
    #: (``plan(..., logits_chunk=...)``), else ``None``
    logits_chunk: int | None = None
    #: with ``selective``: the ``residual_adds`` option of the scope the plan runs under
    #: (``False``: ResNet block outputs kept rather than recomputed from the add's inputs,
    #: which recomputed units need less of); ``None`` without one
    residual_adds: bool | None = None
    #: with ``selective``: the FLOPs the scope's conversion runs by itself (recomputations
    #: inside converted layers' backward passes, mask packing) over the untouched step's, as a
    #: fraction of a step (3 x the loss's forward FLOPs); not part of ``predicted_time``, which
    #: prices the plan's choices under that conversion. ``0.0`` without a scope
    conversion_time: float = 0.0
    #: the FLOPs of ``value_and_grad(step)``'s jaxpr over the untouched step's
    #: (:func:`jaxmem.planner.trace.flops_of`, repeated equations counted once): what the
    #: planned step runs, its recomputations and the conversion's included, each counted once
    #: (a check of ``predicted_time_total``, which prices them apart); ``None`` where not
    #: traced
    traced_time: float | None = None

    @property
    def predicted_time_total(self) -> float:
        """``predicted_time + conversion_time``: the plan's choices priced by the planner's
        model plus what the conversion runs by itself (``traced_time`` counts the planned
        step as it is traced)."""
        return self.predicted_time + self.conversion_time

    def _conversion_text(self) -> str:
        return (f" ({self.conversion_time:+.2f} conversion: x{self.predicted_time_total:.2f})"
                if self.selective else "")

    def value_and_grad(self) -> Callable[..., Any]:
        """``jax.value_and_grad(self.step)``, or, when an OLLA order was applied
        (``self.order.applied``), the ordered value-and-grad step itself (same values, for
        arguments of the example's shapes; ``jax.value_and_grad(self.step)`` runs it too)."""
        if self.order is not None and self.order.applied:
            return self.order.fn
        return jax.value_and_grad(self.step)

    def live_peak(self, *args: Any, **kwargs: Any):
        """What is live at the peak of :meth:`value_and_grad` compiled for ``self.target``
        with the loss's arguments (a :class:`jaxmem.measure.LivePeak`: the instruction, the
        bytes, the values and the JAX ops that made them), e.g. ``p.live_peak(params, x)
        .top(8)``: where the plan's bytes go."""
        from jaxmem.measure import live_peak

        return live_peak(functools.partial(self.value_and_grad(), **kwargs) if kwargs
                         else self.value_and_grad(), *args, target=self.target)

    @property
    def prediction_error(self) -> float:
        """``predicted / compiled - 1``."""
        return self.predicted_bytes / max(self.compiled_bytes, 1) - 1.0

    @property
    def why(self) -> dict[str, str]:
        return {c.label: c.why for c in self.choices}

    def to_dict(self) -> dict[str, Any]:
        keys = ("budget_bytes", "default_bytes", "predicted_bytes", "compiled_bytes",
                "predicted_time", "selective", "solver_status", "solver_gap", "iterations",
                "approximate", "target", "logits_chunk", "residual_adds", "conversion_time",
                "traced_time")
        d = {k: getattr(self, k) for k in keys}
        d["order"] = None if self.order is None else {
            "applied": self.order.applied, "why": self.order.why,
            "compiled_bytes": self.order.compiled_bytes, "chunks": self.order.chunks}
        d["prediction_error"] = self.prediction_error
        d["predicted_time_total"] = self.predicted_time_total
        d["notes"] = list(self.notes)
        d["choices"] = [dataclasses.asdict(c) for c in self.choices]
        return d

    def __rich__(self):
        from rich.table import Table
        mib = 2.0**20
        t = Table(title=(f"jaxmem plan: compiled {self.compiled_bytes / mib:.2f} MiB "
                         f"(budget {self.budget_bytes / mib:.2f}, default "
                         f"{self.default_bytes / mib:.2f}, predicted "
                         f"{self.predicted_bytes / mib:.2f}); time x{self.predicted_time:.2f}"
                         f"{self._conversion_text()}; "
                         f"{self.solver_status}"))
        for col in ("unit", "option", "kept MiB", "recompute MFLOP", "why"):
            t.add_column(col)
        for c in self.choices:
            t.add_row(c.label, _option_text(c), f"{c.keep_bytes / mib:.3f}",
                      f"{c.recompute_flops / 1e6:.1f}", c.why)
        return t

    def __str__(self) -> str:
        mib = 2.0**20
        head = (f"MemoryPlan: compiled {self.compiled_bytes / mib:.2f} MiB <= budget "
                f"{self.budget_bytes / mib:.2f} MiB (default {self.default_bytes / mib:.2f}, "
                f"predicted {self.predicted_bytes / mib:.2f}), time x{self.predicted_time:.2f}"
                f"{self._conversion_text()}")
        lines = [head]
        lines += [f"  {c.label:<24} {_option_text(c):<10} {c.why}" for c in self.choices]
        return "\n".join(lines)


