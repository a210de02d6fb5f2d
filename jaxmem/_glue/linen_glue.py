"""The Linen method interceptor every scope pushes (see :mod:`jaxmem._glue.patch`).

For each intercepted Linen method call it
* notes the module path (for the report and for functions called inside),
* swaps module fields that hold a convertible function (``act: Callable = nn.relu``,
  ``functools.partial(nn.gelu, approximate=False)``) for the converted one during the call
  (the module itself is restored afterwards; nothing of the caller is mutated),
* for ``__call__`` outside ``init``: runs the first registered handler whose part is enabled
  (attention, then selective, then fewbit), else the module's own code: a Flax module without
  a handler is reported ``'container'`` when calls inside it are recorded (``nn.Sequential``),
  else ``'unsupported'``; calls made while a module initializes are not part of the step
  (:func:`jaxmem._glue.report.pretrace`);
* a method that re-enters the same method of the same module (a subclass's ``__call__``
  calling ``super().__call__``, e.g. ``nn.SelfAttention``) runs as it is: the outer call
  already chose what to do with the module and recorded it, once.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jaxmem._glue import options as _options
from jaxmem._glue import patch as _patch
from jaxmem._glue import report as _report

__all__ = ["interceptor"]

_SKIP_FIELDS = ("parent", "name")
#: ``(id(module), method name)`` of the intercepted calls being run, innermost last
_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxmem_linen_active",
                                                               default=())


def _path(m) -> str:
    try:
        return "/".join(str(p) for p in m.scope.path) if m.scope is not None else ""
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - odd scopes
        return ""


def _field_swaps(m):
    out = []
    for f in dataclasses.fields(m):
        if f.name in _SKIP_FIELDS:
            continue
        v = getattr(m, f.name, None)
        if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
            # e.g. nn.Sequential([nn.Dense(4), nn.relu, ...]): functions held in a sequence
            reps = [_patch.replacement_for(x) if _is_function(x) else None for x in v]
            if any(r is not None for r in reps):
                out.append((f.name, v, type(v)(x if r is None else r for x, r in zip(v, reps))))
            continue
        if not _is_function(v):
            continue
        rep = _patch.replacement_for(v)
        if rep is not None:
            out.append((f.name, v, rep))
    return out


def _is_function(v) -> bool:
    """A callable field value that is neither a class nor a (sub)module."""
    import flax.linen as nn

    return v is not None and callable(v) and not isinstance(v, (type, nn.Module))


@contextlib.contextmanager
def _swapped(m, swaps):
    for name, _, rep in swaps:
        object.__setattr__(m, name, rep)
    try:
        yield
    finally:
        for name, old, _ in reversed(swaps):
            object.__setattr__(m, name, old)


def _enabled(opts, part):
    if opts is None:
        return False
    return {"attention": opts.attention, "selective": opts.selective,
            "fewbit": opts.fewbit is not None}[part]


def _has_enabled_handler(m):
    cls = type(m).__name__
    for part, match, meth, _ in _patch._MODULE_RULES:
        if meth == "__call__" and match(m):
            return _enabled(_options.lookup(cls, (part, f"{part}:modules")), part)
    return False


def interceptor(next_fun, args, kwargs, context):
    m = context.module
    me = (id(m), context.method_name)
    active = _ACTIVE.get()
    if active and active[-1] == me:  # super().<method> of the call being run
        return next_fun(*args, **kwargs)
    token = _ACTIVE.set(active + (me,))
    try:
        return _intercept(m, next_fun, args, kwargs, context)
    finally:
        _ACTIVE.reset(token)


def _intercept(m, next_fun, args, kwargs, context):
    path = _path(m)
    with _report.at_path(path):
        if not _options.stack() and not _report.collecting():
            return next_fun(*args, **kwargs)
        handled = context.method_name == "__call__" and _has_enabled_handler(m)
        # a module with its own handler knows its fields (e.g. attention_fn)
        swaps = _field_swaps(m) if _options.stack() and not handled else []
        with _swapped(m, swaps):
            method = context.method_name
            cls = type(m).__name__
            initializing = m.is_initializing()
            for part, match, meth, handler in _patch._MODULE_RULES:
                if meth != method or not match(m):
                    continue
                opts = _options.lookup(cls, (part, f"{part}:modules"))
                target = cls if method == "__call__" else f"{cls}.{method}"
                if opts is None:
                    if not initializing:
                        _report.record(kind="module", target=target, technique=part,
                                       status="fallback", reason="outside jaxmem.scope")
                    return next_fun(*args, **kwargs)
                if not _enabled(opts, part):
                    if not initializing:
                        status = ("approximate-not-allowed" if part == "fewbit"
                                  else "fallback")
                        why = "fewbit=None" if part == "fewbit" else f"{part}=False"
                        _report.record(kind="module", target=target, technique=part,
                                       status=status, reason=why)
                    return next_fun(*args, **kwargs)
                if initializing:
                    return next_fun(*args, **kwargs)
                return handler(m, next_fun, args, kwargs)
            if (method == "__call__" and type(m).__module__.startswith("flax.")
                    and not initializing):
                # 'container' when calls inside it are recorded (nn.Sequential, wrappers)
                return _report.record_module_call(cls, lambda: next_fun(*args, **kwargs))
            if initializing and _report.collecting():
                with _report.pretrace("Linen init"):
                    return next_fun(*args, **kwargs)
            return next_fun(*args, **kwargs)
