"""What jaxmem did with every Flax module call and patchable function in a traced step.

Handlers call :func:`record` for each call they see (converted or not, and why).
:func:`jaxmem.report` traces a function abstractly (``jax.make_jaxpr``: no compute) while
collecting those records into a :class:`Report`. Each scope also counts what it converted,
so a scope that converts nothing in a traced call warns once
(:class:`NothingConvertedWarning`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator

__all__ = ["STATUSES", "Entry", "NothingConvertedWarning", "Report", "collecting", "record",
           "report"]

#: the allowed ``Entry.status`` values
STATUSES = ("converted", "fallback", "unsupported", "approximate-not-allowed",
            "nothing-to-save")
_KINDS = ("module", "function")


class NothingConvertedWarning(UserWarning):
    """A jaxmem convert/scope traced calls but converted none of them (nothing saved)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One module or function call seen while tracing.

    path: the Flax module path of the call ('' at the top level); kind: 'module' or
    'function'; target: the class or function (e.g. 'Dense', 'flax.linen.relu');
    technique: 'selective', 'fewbit', 'attention' or '' (none applies); status: one of
    :data:`STATUSES`; reason: why it was not converted (or what was used).
    """

    path: str
    kind: str
    target: str
    technique: str
    status: str
    reason: str = ""


@dataclasses.dataclass
class Report:
    """Every recorded :class:`Entry`, in trace order."""

    entries: list = dataclasses.field(default_factory=list)

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
        return {"entries": [dataclasses.asdict(e) for e in self.entries], "counts": counts}

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


_COLLECT: contextvars.ContextVar = contextvars.ContextVar("jaxmem_report", default=None)
_FRAMES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxmem_frames", default=())
_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("jaxmem_path", default="")
_warned: set = set()


def collecting() -> bool:
    return _COLLECT.get() is not None


def current_path() -> str:
    return _PATH.get()


@contextlib.contextmanager
def at_path(path: str) -> Iterator[None]:
    token = _PATH.set(path)
    try:
        yield
    finally:
        _PATH.reset(token)


def record(*, kind: str, target: str, technique: str, status: str, reason: str = "",
           path: str | None = None) -> None:
    """Note one call: appended to the report being collected (if any) and counted by the
    innermost active scope (for :class:`NothingConvertedWarning`)."""
    if status not in STATUSES:
        raise ValueError(f"record: status must be one of {STATUSES}, got {status!r}")
    if kind not in _KINDS:
        raise ValueError(f"record: kind must be one of {_KINDS}, got {kind!r}")
    frames = _FRAMES.get()
    if frames and status != "nothing-to-save":
        f = frames[-1]
        f["seen"] += 1
        if status == "converted":
            f["converted"] += 1
    rep = _COLLECT.get()
    if rep is not None:
        rep.entries.append(Entry(current_path() if path is None else path, kind, target,
                                 technique, status, reason))


@contextlib.contextmanager
def frame(label: str) -> Iterator[dict]:
    """Count the records of a scope; on exit warn once per ``label`` if calls were seen and
    none was converted."""
    f = {"seen": 0, "converted": 0}
    token = _FRAMES.set(_FRAMES.get() + (f,))
    try:
        yield f
    finally:
        _FRAMES.reset(token)
        if f["seen"] and not f["converted"]:
            parent = _FRAMES.get()
            if parent:  # let the enclosing scope decide
                parent[-1]["seen"] += f["seen"]
            elif label not in _warned:
                _warned.add(label)
                warnings.warn(
                    f"{label} traced {f['seen']} Flax module/function call(s) but converted "
                    "none (no memory saved); see jaxmem.report(fn, *args) for why.",
                    NothingConvertedWarning, stacklevel=3)
        elif f["converted"]:
            parent = _FRAMES.get()
            if parent:
                parent[-1]["seen"] += f["seen"]
                parent[-1]["converted"] += f["converted"]


def report(fn, *args, **kwargs) -> Report:
    """Trace ``fn(*args, **kwargs)`` abstractly (``jax.make_jaxpr``; nothing is computed)
    and return every Flax Linen module call and patchable inline function call seen, with
    what jaxmem did (see :class:`Entry`). Calls made outside any jaxmem scope / converted
    model are listed as 'fallback' with reason 'outside jaxmem.scope'.

    Args:
      fn: the function to trace (e.g. a loss or a converted model's ``apply``).
      *args: its positional arguments; arrays become abstract inputs, others stay static.
      **kwargs: its keyword arguments, treated like ``args``.

    Returns:
      A :class:`Report`: one :class:`Entry` per call seen (``print`` shows a table).

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
      >>> sorted({(e.target, e.status) for e in rep.entries})
      [('Dense', 'converted'), ('flax.linen.relu', 'converted')]
      >>> sorted({e.status for e in jaxmem.report(model.apply, params, x).entries})
      ['fallback']
    """
    import jax

    from jaxmem._glue import patch as _patch

    if not callable(fn):
        raise TypeError(f"jaxmem.report: fn must be callable, got {fn!r}")
    import numpy as np

    leaves, tree = jax.tree.flatten((args, kwargs))
    is_arr = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]

    def traced(*arrays):
        it = iter(arrays)
        full = [next(it) if a else x for x, a in zip(leaves, is_arr)]
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)

    rep = Report()
    token = _COLLECT.set(rep)
    try:
        with _patch.observing():
            jax.make_jaxpr(traced)(*[x for x, a in zip(leaves, is_arr) if a])
    finally:
        _COLLECT.reset(token)
    return rep
