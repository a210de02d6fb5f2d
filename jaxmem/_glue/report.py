"""``jaxmem.report``: what jaxmem does with each computation of a traced step, and why.

The report is read from the step's own jaxpr: :func:`report` traces ``fn`` abstractly
(``jax.make_jaxpr``: nothing is computed) and collects the rows of every
:func:`jaxmem.transform` it reaches (directly, or through ``jaxmem.linen.convert`` /
``jaxmem.nnx.convert``): one :class:`Entry` per product, normalisation, activation,
attention, dropout, pool or higher-order primitive, converted or not, with the reason and
the user's source location. When ``fn`` reaches no transformation at all, the entries say
what ``jaxmem.transform(fn)`` would convert, each as ``'fallback'`` (not converted: outside
jaxmem). Nothing is patched and no profile or trace hook is installed.

Rows recorded in a trace that Flax or JAX throws away -- ``nn.scan``'s pre-trace of its
body, ``jax.eval_shape`` (shape inference), ``lazy_init`` -- go to :attr:`Report.pretrace`
and are not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys

from jaxmem.transform.report import NothingConvertedWarning

__all__ = ["STATUSES", "Entry", "NothingConvertedWarning", "Report", "report"]

#: the allowed ``Entry.status`` values
STATUSES = ("converted", "fallback", "unsupported", "approximate-not-allowed",
            "nothing-to-save")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One computation of the traced step, as :func:`jaxmem.transform` decided it.

    path: the Flax module path of the computation ('' at the top level); kind: ``'dot'``,
    ``'conv'``, ``'norm'``, ``'activation'``, ``'attention'``, ``'dropout'``, ``'pool'``,
    ``'logits'``, ``'mlp'`` or ``'higher-order'``; target: what was matched (primitives and shapes,
    prefixed by the enclosing higher-order primitives); technique: 'selective', 'fewbit',
    'attention', 'chunked' (a language-model head or an MLP computed a chunk of rows at a
    time) or ''
    (none applied); status: one of :data:`STATUSES`; reason: what it became, or why it was
    left; where: the user's source location (``file:line (function)``).
    """

    path: str
    kind: str
    target: str
    technique: str
    status: str
    reason: str = ""
    where: str = ""


@dataclasses.dataclass
class Report:
    """Every recorded :class:`Entry` of the traced step, in trace order.

    ``pretrace`` holds ``(Entry, why)`` for computations of traces Flax or JAX throw away
    (``nn.scan``'s body pre-trace, ``jax.eval_shape``, ``lazy_init``): not
    part of the step, not counted, not in the printed table (its caption gives the number).
    """

    entries: list = dataclasses.field(default_factory=list)
    pretrace: list = dataclasses.field(default_factory=list)

    def by_kind(self, kind: str) -> list:
        """Entries of one kind (``'dot'``, ``'activation'``, ``'attention'``, ...)."""
        return [e for e in self.entries if e.kind == kind]

    def unconverted(self) -> list:
        """Entries jaxmem supports but did not convert ('fallback' and
        'approximate-not-allowed')."""
        return [e for e in self.entries if e.status in ("fallback", "approximate-not-allowed")]

    def converted(self) -> list:
        return [e for e in self.entries if e.status == "converted"]

    def to_dict(self) -> dict:
        counts = {s: 0 for s in STATUSES}
        for e in self.entries:
            counts[e.status] += 1
        return {"entries": [dataclasses.asdict(e) for e in self.entries], "counts": counts,
                "pretrace": [dict(dataclasses.asdict(e), where=w) for e, w in self.pretrace]}

    def __rich__(self):
        from rich.table import Table

        t = Table(title="jaxmem report", show_lines=False)
        for col in ("path", "kind", "target", "technique", "status", "reason"):
            t.add_column(col)
        style = {"converted": "green", "fallback": "yellow", "unsupported": "red",
                 "approximate-not-allowed": "cyan", "nothing-to-save": "dim"}
        for e in self.entries:
            t.add_row(e.path or "/", e.kind, e.target, e.technique or "-",
                      f"[{style[e.status]}]{e.status}[/]", e.reason)
        if self.pretrace:
            t.caption = (f"{len(self.pretrace)} computation(s) seen in Flax/JAX pre-traces "
                         "(shape inference, nn.scan's body check) are not part of the step: "
                         "Report.pretrace")
        return t

    def __str__(self):
        try:
            from rich.console import Console
        except ImportError:  # pragma: no cover
            return "\n".join(f"{e.path or '/'}\t{e.kind}\t{e.target}\t{e.technique}\t"
                             f"{e.status}\t{e.reason}" for e in self.entries)
        console = Console(width=160, record=True, force_terminal=False, color_system=None)
        with console.capture() as cap:
            console.print(self)
        return cap.get()

    def __len__(self):
        return len(self.entries)


_report_calls = itertools.count(1)  # one trace-context value per report call

_AXES_SCAN = os.path.join("flax", "core", "axes_scan.py")
_LAZY_INIT = os.path.join("flax", "core", "partial_eval.py")


@functools.cache
def _eval_shape_code():
    import inspect

    import jax

    return inspect.unwrap(jax.eval_shape).__code__


def _discarded_trace(frame) -> str | None:
    """Why rows recorded in ``frame`` (and the frames it was called from, up to
    :func:`report`) are not part of the traced step, or ``None`` when they are."""
    eval_shape = _eval_shape_code()
    stop = report.__code__
    f = frame
    while f is not None and f.f_code is not stop:
        code = f.f_code
        if code is eval_shape:
            return "jax.eval_shape (shape inference)"
        if code.co_name == "body_fn" and code.co_filename.endswith(_AXES_SCAN):
            if f.f_locals.get("init_mode") is True:
                return "nn.scan's pre-trace of its body (Flax's loop-invariant check)"
        elif code.co_name == "wrapper" and code.co_filename.endswith(_LAZY_INIT):
            return "lazy_init (shape inference)"
        f = f.f_back
    return None


def report(fn, *args, **kwargs) -> Report:
    """What jaxmem converts when ``fn(*args, **kwargs)`` is traced (nothing is computed).

    Args:
      fn: any function: a transformed one (:func:`jaxmem.transform`), the ``apply`` of a
        converted Flax model, a loss calling either, or untouched code.
      *args, **kwargs: its arguments (array leaves are traced abstractly).

    Returns:
      A :class:`Report`: one :class:`Entry` per computation jaxmem matched (or looked at and
      left), in trace order. When ``fn`` reaches no jaxmem transformation, every entry is
      what ``jaxmem.transform(fn)`` would do, reported ``'fallback'`` (not converted).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jaxmem
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return nn.Dense(1)(nn.relu(nn.Dense(4)(x)))
      >>> model = MLP()
      >>> x = jnp.ones((2, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> rep = jaxmem.report(jaxmem.linen.convert(model).apply, params, x)
      >>> sorted({(e.path, e.kind, e.status) for e in rep.entries if e.kind != 'bias'})
      [('', 'activation', 'converted'), ('Dense_0', 'dot', 'converted'), ('Dense_1', 'dot', 'converted')]
      >>> sorted({e.path for e in rep.by_kind('bias')})
      ['Dense_0', 'Dense_1']
      >>> sorted({e.status for e in jaxmem.report(model.apply, params, x).entries})
      ['fallback']
    """
    import jax

    from jaxmem._glue import options as _options
    from jaxmem.transform.api import _array_leaves
    from jaxmem.transform.interpret import Interpreter
    from jaxmem.transform.options import Options
    from jaxmem.transform.report import collect, discarded, tracing

    if not callable(fn):
        raise TypeError(f"jaxmem.report: fn must be callable, got {fn!r}")
    dyn, call = _array_leaves(fn, args, kwargs)
    rep = Report()
    # a number per call in jit's cache key: functions fn jits are traced again (recorded)
    with _options.keyed(_options.REPORT_TRACE, next(_report_calls)):
        with collect() as rows, discarded(lambda: _discarded_trace(sys._getframe(1))) as thrown:
            closed = jax.make_jaxpr(lambda *d: call(d))(*dyn)
        if rows or thrown:
            rep.entries.extend(entry_of_row(r) for r in rows)
            rep.pretrace.extend((entry_of_row(r), why) for r, why in thrown)
            return rep
        # fn reaches no transformation: what jaxmem.transform(fn) would do, not done (the
        # same jaxpr interpreted abstractly; fn is not traced again)
        with collect() as would, tracing():
            jax.make_jaxpr(lambda *d: Interpreter(Options()).run_outermost(closed, d)[0])(*dyn)
    rep.entries.extend(_not_reached(entry_of_row(r)) for r in would)
    return rep


def _not_reached(e: Entry) -> Entry:
    """``e`` (a decision jaxmem.transform would make) as a computation left as written."""
    if e.status != "converted":
        return e
    return dataclasses.replace(
        e, technique="", status="fallback",
        reason=f"not converted: outside jaxmem (jaxmem.transform / linen.convert / "
               f"nnx.convert would use {e.reason})")


#: reasons of rows that looked at a computation and found nothing of their kind to convert
_NOTHING_TO_SAVE = ("not differentiated", "saves nothing", "not an activation",
                    "computes no ")


def entry_of_row(row) -> Entry:
    """The :class:`Entry` of one decision of :func:`jaxmem.transform` (a
    :class:`jaxmem.transform.report.Row`): path = its Flax module path (the name stack
    without the root module), status 'converted', 'approximate-not-allowed' (a smooth
    activation kept exact without ``fewbit``), 'nothing-to-save' (integer operands, a
    reduction or elementwise chain that is no normalisation / activation, an activation whose
    input is all its autodiff keeps),
    'unsupported' (a region not entered) or 'fallback' (kept, with the reason)."""
    path = row.name_stack.split("/", 1)[1] if "/" in row.name_stack else ""
    if row.converted:
        status = "converted"
        technique = ("fewbit" if "bit code" in row.became else
                     "attention" if row.kind == "attention" else
                     "chunked" if row.kind in ("logits", "mlp") else "selective")
    else:
        technique = ""
        status = ("nothing-to-save" if any(w in row.reason for w in _NOTHING_TO_SAVE) else
                  "approximate-not-allowed" if "fewbit=" in row.reason else
                  "unsupported" if row.kind == "higher-order" else "fallback")
    target = f"[{row.path}] {row.matched}" if row.path else row.matched
    reason = row.became + (f" ({row.reason})" if row.reason else "") if row.converted \
        else row.reason
    return Entry(path, row.kind, target, technique, status, reason,
                 row.where)
