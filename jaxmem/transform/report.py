"""What :func:`jaxmem.transform` matched in a program, from the program's own jaxpr.

Each :class:`Row` is one layer-level decision: a ``dot_general`` / convolution, an
elementwise activation subgraph, an attention subgraph, or a higher-order primitive
(entered or not), with what it became (or why it stayed as it was), the user's source
location (``file:line (function)``) and the name stack.  Rows are recorded while the
transformed function is traced: :func:`collect` turns recording on for one trace.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

__all__ = ["GradientInsideWarning", "NothingConvertedWarning", "Report", "Row", "collect",
           "record"]


class NothingConvertedWarning(UserWarning):
    """A converted model or function traced computations jaxmem knows but converted none of
    them (nothing saved); :func:`jaxmem.report` says why."""


class GradientInsideWarning(UserWarning):
    """A transformed function computes its own gradient (e.g. a whole training step): the
    conversions cannot change what its backward pass keeps; transform the loss instead."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One decision of the transformation.

    kind: ``"dot"``, ``"conv"``, ``"bias"``, ``"activation"``, ``"attention"``, ``"norm"``,
    ``"dropout"``, ``"pool"``, ``"logits"`` (a language-model head and its loss), ``"mlp"`` (a two-layer perceptron run as
    :func:`jaxmem.selective.chunked_mlp`), ``"gate"``
    (a gated linear unit's product), ``"scale"`` (a product's output scaled by a
    parameter, materialised once), ``"higher-order"``, ``"gradient"`` (the function
    differentiates inside: see :class:`GradientInsideWarning`).
    matched: what was found (primitives, shapes).  became: the op it was re-emitted with
    (``""`` when not converted).  converted: whether it was replaced.  reason: why not, or
    a note (e.g. the residual an unconverted activation keeps).  where / name_stack: the
    user's source location and Flax / ``jax.named_scope`` name stack.  path: the enclosing
    higher-order primitives (``"scan/cond[1]"``; ``""`` at top level)."""

    kind: str
    matched: str
    became: str
    converted: bool
    reason: str = ""
    where: str = ""
    name_stack: str = ""
    path: str = ""


_ROWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxmem_transform_rows",
                                                                    default=None)


_TRACING: contextvars.ContextVar[int] = contextvars.ContextVar("jaxmem_transform_tracing",
                                                               default=0)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Mark the trace of a transformed function (its rows describe what it computes)."""
    token = _TRACING.set(_TRACING.get() + 1)
    try:
        yield
    finally:
        _TRACING.reset(token)


def collecting() -> bool:
    """Whether a report (or a converted module's check) is collecting rows here."""
    return _ROWS.get() is not None


def inside() -> bool:
    """Whether a transformed function is being traced in this context."""
    return _TRACING.get() > 0


#: ``(why, rows)``: a function returning why the current trace is thrown away (or None),
#: and where the rows of such traces go (set by :func:`jaxmem.report`)
_DISCARDED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxmem_transform_discarded", default=None)


@contextlib.contextmanager
def discarded(why) -> Iterator[list]:
    """Rows recorded in a trace ``why()`` names (shape inference, ``nn.scan``'s pre-trace)
    go to the yielded list as ``(row, reason)``, not to the collection."""
    kept: list = []
    token = _DISCARDED.set((why, kept))
    try:
        yield kept
    finally:
        _DISCARDED.reset(token)


def record(row: Row) -> None:
    """Append ``row`` to the report being collected (no-op when none is)."""
    rows = _ROWS.get()
    if rows is None:
        return
    d = _DISCARDED.get()
    reason = d[0]() if d is not None else None
    if reason is not None:
        d[1].append((row, reason))
    else:
        rows.append(row)


def amend(old: Row, new: Row) -> None:
    """Put ``new`` in the place of the row ``old`` (the same object) recorded in the report
    being collected, once emission has said more about it; no-op when ``old`` is not there
    (nothing collected, or recorded muted)."""
    rows = _ROWS.get()
    d = _DISCARDED.get()
    for place in (rows, d[1] if d is not None else None):
        if place is None:
            continue
        for i, item in enumerate(place):
            if item is old:
                place[i] = new
                return
            if isinstance(item, tuple) and item and item[0] is old:
                place[i] = (new, *item[1:])
                return


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Record nothing inside the context (the matchers run to count, not to re-emit)."""
    token = _ROWS.set(None)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextlib.contextmanager
def collect() -> Iterator[list]:
    """Collect the rows recorded while tracing inside the context (an enclosing collection
    gets them too, when this one ends)."""
    rows: list = []
    outer = _ROWS.get()
    token = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)
        if outer is not None:
            outer.extend(rows)


@dataclasses.dataclass(frozen=True)
class Report:
    """The rows of one trace of a transformed function (see :func:`jaxmem.transform.report`)."""

    rows: tuple[Row, ...]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def converted(self) -> list[Row]:
        return [r for r in self.rows if r.converted]

    def unconverted(self) -> list[Row]:
        """Rows left as they were (with their reason)."""
        return [r for r in self.rows if not r.converted]

    def by_kind(self, kind: str) -> list[Row]:
        return [r for r in self.rows if r.kind == kind]

    def table(self) -> str:
        """A plain-text table, one row per decision."""
        head = ("kind", "matched", "became / reason", "where", "name stack")
        body = []
        for r in self.rows:
            what = r.became if r.converted else f"kept: {r.reason}"
            if r.converted and r.reason:
                what += f" ({r.reason})"
            path = f"[{r.path}] " if r.path else ""
            body.append((r.kind, path + r.matched, what, r.where, r.name_stack))
        widths = [max([len(h)] + [min(len(b[i]), 60) for b in body]) for i, h in
                  enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines.append("  ".join("-" * w for w in widths))
        for b in body:
            lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip())
        n = len(self.converted())
        lines.append(f"{n} of {len(self.rows)} converted")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __rich__(self):  # pragma: no cover - rich is optional
        from rich.table import Table
        t = Table("kind", "matched", "became / reason", "where", "name stack")
        for r in self.rows:
            t.add_row(r.kind, r.matched, r.became if r.converted else f"kept: {r.reason}",
                      r.where, r.name_stack)
        return t


_warned: set = set()


@contextlib.contextmanager
def warn_if_nothing_converted(label: str) -> Iterator[None]:
    """Warn :class:`jaxmem.NothingConvertedWarning` (once per ``label``) when the
    transformed code traced inside the block computed something jaxmem knows (rows were
    recorded) but converted none of it; nothing is warned when the call is not traced."""
    with collect() as rows:
        yield
    if rows and not any(r.converted for r in rows) and label not in _warned:
        import warnings

        _warned.add(label)
        kept = sorted({r.kind for r in rows})
        warnings.warn(NothingConvertedWarning(
            f"{label}: nothing was converted in this call ({len(rows)} computation(s) of "
            f"kind {', '.join(kept)} kept as written; jaxmem.report says why)"),
            stacklevel=4)
