"""What jaxmem did with every Flax module call and patchable function in a traced step.

Handlers call :func:`record` for each call they see (converted or not, and why).
:func:`jaxmem.report` traces a function abstractly (``jax.make_jaxpr``: no compute) while
collecting those records into a :class:`Report`. Each scope also counts what it converted,
so a scope that converts nothing in a traced call warns once
(:class:`NothingConvertedWarning`).

Only calls of the traced step are listed. Calls Flax or JAX make in a trace whose result is
thrown away -- ``nn.scan``'s pre-trace of its body (Flax checks the loop invariants),
``jax.eval_shape`` (shape inference, ``nnx.fori_loop``'s pre-trace), ``lazy_init``, a Linen
module's ``init`` -- go to :attr:`Report.pretrace` and are not counted. A Flax module with no
conversion whose call contains recorded calls (``nn.Sequential``, wrappers) is a
``'container'``, not ``'unsupported'``. While :func:`report` traces, it also notes every
function of user code that runs, and lists a global name in it that is bound to the
original of a function jaxmem patches (``from jax.lax import scan``, ``from flax.linen
import relu`` executed before any conversion) as 'fallback' with the reason "not reached:
imported by name before conversion"; ``jax.lax.fori_loop`` (a loop jaxmem does not convert,
imported by name or not) is listed as 'unsupported' at each call.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import dis
import functools
import inspect
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["STATUSES", "Entry", "NothingConvertedWarning", "Report", "collecting", "record",
           "report"]

#: the allowed ``Entry.status`` values
STATUSES = ("converted", "fallback", "unsupported", "approximate-not-allowed",
            "nothing-to-save", "container")
#: statuses that say nothing about a call's own saving (not counted as "seen, not converted")
_NEUTRAL = ("nothing-to-save", "container")
_KINDS = ("module", "function")


class NothingConvertedWarning(UserWarning):
    """A jaxmem convert/scope traced calls but converted none of them (nothing saved)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One module or function call seen while tracing.

    path: the Flax module path of the call ('' at the top level); kind: 'module' or
    'function' (a call seen by a scope), or the kind of a computation
    :func:`jaxmem.transform` matched (``'dot'``, ``'conv'``, ``'norm'``, ``'activation'``,
    ``'attention'``, ``'dropout'``, ``'pool'``, ``'higher-order'``: converted models run
    through it), target: the class or function (e.g. 'Dense', 'flax.linen.relu');
    technique: 'selective', 'fewbit', 'attention' or '' (none applies); status: one of
    :data:`STATUSES` ('container': a Flax module with no conversion of its own whose inner
    calls are listed as their own entries); reason: why it was not converted (or what was
    used); where: the source location of a matched computation.
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

    ``pretrace`` holds ``(Entry, where)`` for calls made in traces Flax or JAX throw away
    (``nn.scan``'s body pre-trace, ``jax.eval_shape``, ``lazy_init``, Linen ``init``): not
    part of the step, not counted, not in the printed table (its caption gives the number).
    """

    entries: list = dataclasses.field(default_factory=list)
    pretrace: list = dataclasses.field(default_factory=list)

    def by_kind(self, kind: str) -> list:
        """Entries of one kind (``'module'``, ``'dot'``, ``'activation'``, ...)."""
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
                 "approximate-not-allowed": "cyan", "nothing-to-save": "dim",
                 "container": "blue"}
        for e in self.entries:
            t.add_row(e.path or "/", e.kind, e.target, e.technique or "-",
                      f"[{style[e.status]}]{e.status}[/]", e.reason)
        if self.pretrace:
            t.caption = (f"{len(self.pretrace)} call(s) seen in Flax/JAX pre-traces (shape "
                         "inference, nn.scan's body check, init) are not part of the step: "
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


_COLLECT: contextvars.ContextVar = contextvars.ContextVar("jaxmem_report", default=None)
_report_calls = itertools.count(1)  # one trace-context value per report call
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


_PRETRACE: contextvars.ContextVar = contextvars.ContextVar("jaxmem_pretrace", default=None)
_CHILDREN: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxmem_children", default=())


@contextlib.contextmanager
def pretrace(where: str) -> Iterator[None]:
    """Calls recorded inside are not part of the step (``where`` says why), e.g. a Linen
    module's ``init``."""
    token = _PRETRACE.set(where)
    try:
        yield
    finally:
        _PRETRACE.reset(token)


@functools.lru_cache(maxsize=1)
def _pretrace_codes() -> dict:
    """Code objects of the functions whose trace is discarded -> why."""
    import jax

    return {inspect.unwrap(jax.eval_shape).__code__: "jax.eval_shape (shape inference)"}


def _pretrace_reason(frame) -> str | None:
    """Why calls made in ``frame`` (and the frames it was called from, up to
    :func:`report`) are not part of the traced step, or ``None`` when they are."""
    codes = _pretrace_codes()
    stop = report.__code__
    f = frame
    while f is not None and f.f_code is not stop:
        code = f.f_code
        why = codes.get(code)
        if why is not None:
            return why
        name = code.co_name
        if name == "body_fn" and code.co_filename.endswith(_AXES_SCAN):
            if f.f_locals.get("init_mode") is True:
                return "nn.scan's pre-trace of its body (Flax's loop-invariant check)"
        elif name == "wrapper" and code.co_filename.endswith(_LAZY_INIT):
            return "lazy_init (shape inference)"
        f = f.f_back
    return _PRETRACE.get()


_AXES_SCAN = os.path.join("flax", "core", "axes_scan.py")
_LAZY_INIT = os.path.join("flax", "core", "partial_eval.py")


def _add(entry: Entry, rep: Report, frame, at: int | None = None) -> bool:
    """Append ``entry`` to ``rep`` (at index ``at`` if given), or to ``rep.pretrace`` when
    made in a discarded trace; ``True`` when it belongs to the step."""
    why = _pretrace_reason(frame)
    if why is not None:
        rep.pretrace.append((entry, why))
        return False
    if at is None:
        rep.entries.append(entry)
    else:
        rep.entries.insert(at, entry)
    return True


def record(*, kind: str, target: str, technique: str, status: str, reason: str = "",
           path: str | None = None, _at: int | None = None) -> None:
    """Note one call: appended to the report being collected (if any) and counted by the
    innermost active scope (for :class:`NothingConvertedWarning`). A call made in a trace
    Flax or JAX discards (see :attr:`Report.pretrace`) is kept apart and not counted."""
    if status not in STATUSES:
        raise ValueError(f"record: status must be one of {STATUSES}, got {status!r}")
    if kind not in _KINDS:
        raise ValueError(f"record: kind must be one of {_KINDS}, got {kind!r}")
    from jaxmem.transform.report import inside

    if inside():  # jaxmem.transform traces this call: its own rows say what it computes
        return
    rep = _COLLECT.get()
    if rep is not None:
        entry = Entry(current_path() if path is None else path, kind, target, technique,
                      status, reason)
        if not _add(entry, rep, sys._getframe(1), _at):
            return
    children = _CHILDREN.get()
    if children:
        children[-1]["seen"] += 1
        children[-1]["converted"] += status == "converted"
    frames = _FRAMES.get()
    if frames and status not in _NEUTRAL:
        f = frames[-1]
        f["seen"] += 1
        if status == "converted":
            f["converted"] += 1


def record_module_call(target: str, run: Callable[[], Any]) -> Any:
    """Run ``run()`` (the call of a Flax module jaxmem has no conversion for) and record it:
    ``'container'`` when calls were recorded inside it (its children, listed as their own
    entries: ``nn.Sequential``, wrappers), else ``'unsupported'``."""
    counter = {"seen": 0, "converted": 0}
    rep = _COLLECT.get()
    at = len(rep.entries) if rep is not None else None
    path = current_path()
    token = _CHILDREN.set(_CHILDREN.get() + (counter,))
    try:
        out = run()
    finally:
        _CHILDREN.reset(token)
    if counter["seen"]:
        record(kind="module", target=target, technique="", status="container", path=path,
               reason=f"container: {counter['seen']} inner call(s) listed, "
                      f"{counter['converted']} converted; its own code runs as written",
               _at=at)
    else:
        record(kind="module", target=target, technique="", status="unsupported", path=path,
               reason="jaxmem has no conversion for this layer", _at=at)
    return out


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
    and return what jaxmem did (see :class:`Entry`): one entry per computation
    :func:`jaxmem.transform` matched in converted code (``linen.convert`` / ``nnx.convert``
    models, transformed functions), and, for code traced outside them, every Flax Linen
    module call and patchable inline function call seen (listed as 'fallback', reason
    'outside jaxmem.scope', unless the deprecated ``jaxmem.scope`` converted it).

    Args:
      fn: the function to trace (e.g. a loss or a converted model's ``apply``).
      *args: its positional arguments; arrays become abstract inputs, others stay static.
      **kwargs: its keyword arguments, treated like ``args``.

    Returns:
      A :class:`Report`: one :class:`Entry` per call of the step (``print`` shows a table);
      calls made in traces Flax or JAX discard are in ``Report.pretrace``; names of user code
      bound to an unpatched original (imported by name before conversion) are 'fallback'
      entries "not reached: ...".

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
      >>> sorted({(e.path, e.kind, e.status) for e in rep.entries})
      [('', 'activation', 'converted'), ('Dense_0', 'dot', 'converted'), ('Dense_1', 'dot', 'converted')]
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

    from jaxmem._glue import options as _options
    from jaxmem.transform.report import collect as _collect_rows
    from jaxmem.transform.report import discarded as _discarded

    rep = Report()
    token = _COLLECT.set(rep)
    try:
        with _options.keyed(_options.REPORT_TRACE, next(_report_calls)), _patch.observing(), \
                _collect_rows() as rows, \
                _discarded(lambda: _pretrace_reason(sys._getframe(1))) as thrown:
            with _watching_calls(rep) as ran:
                jax.make_jaxpr(traced)(*[x for x, a in zip(leaves, is_arr) if a])
            _add_imported_by_name(rep, ran, _patch)
    finally:
        _COLLECT.reset(token)
    rep.entries.extend(entry_of_row(r) for r in rows)
    rep.pretrace.extend((entry_of_row(r), why) for r, why in thrown)
    return rep


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
                     "attention" if row.kind == "attention" else "selective")
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


# ------------------------------------------------------------- calls jaxmem does not reach
_API_BOUNDARY = os.path.join("jax", "_src", "traceback_util.py")
_FORI_REASON = ("not converted: jax.lax.fori_loop lowers to a scan (static bounds) or a while "
                "loop inside JAX, which jaxmem does not see (its body's layers are converted, "
                "the loop itself gets no scan policy); write the loop with jax.lax.scan")


@contextlib.contextmanager
def _watching_calls(rep: Report) -> Iterator[dict]:
    """While active (this thread): note each code object that runs (``code -> (globals,
    path, index in rep.entries)``, first run) and record each ``jax.lax.fori_loop`` call made
    by user code or Flax (``nnx.fori_loop``), not those JAX makes inside its own functions.

    Watches with ``sys.setprofile``, calling a Python profile function already set. When
    the profile hook is held by a C profiler that cannot be called from Python (``cProfile``,
    ``profile`` run through it), that profiler is left in place and the calls are watched
    with ``sys.settrace`` instead (calling a Python trace function already set, e.g.
    coverage's, and returning its local tracer). Both hooks are restored on exit. If neither
    hook can be used, nothing is watched (the "not reached" and ``fori_loop`` entries are
    missing) and a ``RuntimeWarning`` says so. Code traced by :func:`jaxmem.transform`
    (converted models) is not watched: the transformation converts what it computes."""
    import jax

    fori = inspect.unwrap(jax.lax.fori_loop).__code__
    ran: dict = {}

    from jaxmem.transform.report import inside

    def note(frame):
        if inside():  # jaxmem.transform sees this code's computation, whatever its names
            return
        code = frame.f_code
        if code is fori:
            up = frame.f_back
            while up is not None and up.f_code.co_filename.endswith(_API_BOUNDARY):
                up = up.f_back  # JAX's traceback-filtering wrapper
            caller = up.f_code.co_filename if up is not None else ""
            if _is_user_code(caller) or os.sep + "flax" + os.sep in caller:  # not JAX's own
                _add(Entry(current_path(), "function", "jax.lax.fori_loop", "", "unsupported",
                           _FORI_REASON), rep, frame)
        elif code not in ran:
            ran[code] = (frame.f_globals, current_path(), len(rep.entries))

    prev_profile, prev_trace = sys.getprofile(), sys.gettrace()
    if prev_profile is None or _is_python_hook(prev_profile):
        def profile_hook(frame, event, arg):
            if prev_profile is not None:
                prev_profile(frame, event, arg)
            if event == "call":
                note(frame)

        sys.setprofile(profile_hook)
        try:
            yield ran
        finally:
            sys.setprofile(prev_profile)
        return
    if prev_trace is not None and not callable(prev_trace):
        warnings.warn("jaxmem.report: the profile and trace hooks are both held by C-level "
                      "tools; names imported before conversion and jax.lax.fori_loop calls "
                      "are not listed in this report", RuntimeWarning, stacklevel=4)
        yield ran
        return

    def trace_hook(frame, event, arg):
        local = prev_trace(frame, event, arg) if prev_trace is not None else None
        if event == "call":
            note(frame)
        return local

    sys.settrace(trace_hook)
    try:
        yield ran
    finally:
        sys.settrace(prev_trace)


def _is_python_hook(fn) -> bool:
    """Whether ``fn`` (what ``sys.getprofile()`` returned) can be called as
    ``fn(frame, event, arg)``: a Python profile function, not a C profiler's object."""
    import cProfile

    return callable(fn) and not isinstance(fn, cProfile.Profile)


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple:
    """Folders whose code is not user code (JAX, Flax, optax, numpy, the standard library,
    jaxmem's own parts; jaxmem's example models in ``jaxmem/bench`` and ``jaxmem/models``
    count as user code)."""
    import importlib

    dirs = [os.path.dirname(os.__file__)]
    for name in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            dirs.append(os.path.dirname(importlib.import_module(name).__file__))
        except ImportError:  # pragma: no cover - optional package missing
            pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jaxmem
    for entry in os.listdir(root):
        if entry not in ("bench", "models"):
            dirs.append(os.path.join(root, entry))
    return tuple(d + os.sep if os.path.isdir(d) else d for d in dirs)


def _is_user_code(filename: str) -> bool:
    return not os.path.abspath(filename).startswith(_library_dirs())


def _add_imported_by_name(rep: Report, ran: dict, patch_mod) -> None:
    """Entries for global names of user code that ran which are bound to the original of a
    patched function (imported by name before any conversion: never dispatched)."""
    originals: dict = {}
    for mod, attr, old in patch_mod._saved:
        originals.setdefault(id(old), (old, f"{mod.__name__}.{attr}"))
    found = []
    for code, (glob, path, at) in ran.items():
        if not _is_user_code(code.co_filename):
            continue
        names = {i.argval for i in dis.get_instructions(code)
                 if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        for name in sorted(names):
            v = glob.get(name)
            hit = originals.get(id(v)) if v is not None else None
            if hit is None or hit[0] is not v:
                continue
            rule = patch_mod._ORIGINALS.get(id(v), "")
            parts = patch_mod._parts_of(rule)
            where = f"{glob.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
            found.append((at, Entry(
                path, "function", hit[1], parts[0] if parts else "", "fallback",
                f"not reached: imported by name before conversion (`{name}` in {where} is "
                f"the original {hit[1]}); call it through its module or hold it in a field")))
    for at, entry in sorted(found, key=lambda t: -t[0]):
        rep.entries.insert(at, entry)
