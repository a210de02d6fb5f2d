"""One mechanism for patching module attributes (``jax.nn.relu``, ``flax.linen.gelu``,
``flax.nnx.max_pool``, ``jax.nn.softmax``, ``flax.linen.dot_product_attention``, ...) and
for intercepting Flax Linen module calls.

While any scope is active in any thread, every registered attribute is a *dispatcher*: it
reads the active options of the calling context (:mod:`jaxmem._glue.options`) and calls the
replacement chosen by the registered rules, else the original. Dispatchers are installed on
the first entry and removed on the last exit, under a lock. Linen module calls are intercepted
with ``flax.linen.intercept_methods`` (a per-thread stack) while a scope is active in the
thread.

Rules (:func:`register`) are registered per function name by each part's glue module, each
with its part: when several parts have a rule for one name, the order is attention (exact),
then selective (exact), then fewbit (approximate, only when ``fewbit`` is set). The same
rules convert functions held in module fields (``act: Callable = nn.relu``,
``functools.partial(nn.gelu, approximate=False)``): :func:`replacement_for`.

Only look-ups made while tracing inside a scope are affected; a name imported into another
namespace before (``from jax.nn import relu``) is not (hold it in a field, or call it through
the module).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable, Iterator

from jaxmem._glue import options as _options
from jaxmem._glue import report as _report
from jaxmem.transform.scan_policy import has_remat, scan_policy

__all__ = ["PARTS", "dispatcher_targets", "observing", "register", "register_module",
           "replacement_for", "scan_policy", "scope"]

#: parts in the order they are tried on one layer / function
PARTS = ("attention", "selective", "fewbit")


@dataclasses.dataclass(frozen=True)
class _Rule:
    part: str
    make: Callable  # (options, orig) -> callable | (None, status, reason)


_RULES: dict[str, list[_Rule]] = {}
_TARGETS: dict[tuple[str, str], str] = {}  # (module name, attr) -> rule name
_ORIGINALS: dict[int, str] = {}  # id(original function) -> rule name
_ORIG_OBJ: dict[str, Callable] = {}  # rule name -> original (for fields)
_SELF_RECORDING: set = set()  # rule names whose replacements record themselves
_MODULE_RULES: list[tuple[str, Callable, str, Callable]] = []  # (part, match, method, handler)
_lock = threading.RLock()
_installed_count = 0
_saved: list[tuple[object, str, object]] = []
_busy: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxmem_busy", default=False)
_loaded = False


def register(name: str, part: str, targets, make: Callable, *, records: bool = False) -> None:
    """Register a rule for the function ``name`` of ``part``.

    targets: dotted ``'module.attr'`` names to patch (missing modules/attributes are
    skipped); make(options, orig): the replacement (a callable) or ``(None, status,
    reason)`` when this part does not convert it under ``options``; records: the
    replacement records its own report entry (converted or why not).
    """
    if part not in PARTS:
        raise ValueError(f"register: part must be one of {PARTS}, got {part!r}")
    with _lock:
        if records:
            _SELF_RECORDING.add(name)
        else:
            _SELF_RECORDING.discard(name)
        rules = _RULES.setdefault(name, [])
        rules[:] = [r for r in rules if r.part != part] + [_Rule(part, make)]
        rules.sort(key=lambda r: PARTS.index(r.part))
        for t in targets:
            modname, attr = t.rsplit(".", 1)
            _TARGETS[(modname, attr)] = name
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
            fn = getattr(mod, attr, None)
            if fn is not None and not getattr(fn, "_jaxmem_dispatcher", False):
                _ORIGINALS[id(fn)] = name
                _ORIG_OBJ.setdefault(name, fn)
                if _installed_count:  # a scope is active: install this one too
                    _install_one(mod, modname, attr, name)


def register_module(part: str, match: Callable, handler: Callable, *,
                    method: str = "__call__") -> None:
    """Register a Linen module handler: ``match(module) -> bool``; ``handler(module,
    next_fun, args, kwargs)`` computes the call of ``method`` (and records what it did)."""
    if part not in PARTS:
        raise ValueError(f"register_module: part must be one of {PARTS}, got {part!r}")
    with _lock:
        _MODULE_RULES.append((part, match, method, handler))
        _MODULE_RULES.sort(key=lambda r: PARTS.index(r[0]))


def _ensure_rules():
    """Import the glue modules that register the rules (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for modname in ("jaxmem.selective.patch", "jaxmem.fewbit.linen", "jaxmem._glue.attention",
                    "jaxmem.selective.linen"):
        importlib.import_module(modname)
    _register_scan()


# ----------------------------------------------------------------------------- choice
def _parts_of(name):
    return tuple(r.part for r in _RULES.get(name, ()))


def choose(name: str, opts, orig: Callable):
    """``(fn | None, technique, status, reason)`` for ``name`` under ``opts``."""
    if opts is None:
        return None, "", "fallback", "outside jaxmem.scope"
    last = (None, "", "fallback", "disabled by the scope's options")
    for rule in _RULES.get(name, ()):
        enabled = (opts.attention if rule.part == "attention" else
                   opts.selective if rule.part == "selective" else True)
        if not enabled:
            last = (None, rule.part, "fallback", f"{rule.part}=False")
            continue
        out = _cached_make(rule, opts, orig)
        if callable(out):
            return out, rule.part, "converted", ""
        _, status, reason = out
        last = (None, rule.part, status, reason)
    return last


_make_cache: dict = {}


def _cached_make(rule, opts, orig):
    key = (id(rule), opts, id(orig))
    out = _make_cache.get(key)
    if out is None:
        out = rule.make(opts, orig)
        _make_cache[key] = out
    return out


def _call_busy(fn, args, kwargs):
    token = _busy.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _busy.reset(token)


def _make_dispatcher(qualname: str, name: str, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def dispatcher(*args, **kwargs):
        if _busy.get():
            return orig(*args, **kwargs)
        opts = _options.lookup(name, _parts_of(name) + (qualname,))
        if opts is None and not _report.collecting():
            return orig(*args, **kwargs)
        fn, technique, status, reason = choose(name, opts, orig)
        if fn is None or name not in _SELF_RECORDING:
            _report.record(kind="function", target=qualname, technique=technique,
                           status=status, reason=reason)
        if fn is None:
            return orig(*args, **kwargs)
        return _call_busy(fn, args, kwargs)

    dispatcher._jaxmem_dispatcher = True
    dispatcher._jaxmem_original = orig
    return dispatcher


def replacement_for(fn, options=None):
    """The converted version of a function held in a module field (``nn.relu``,
    ``jax.nn.gelu``, ``functools.partial(nn.gelu, approximate=False)``) under ``options``
    (default: the active ones), or ``None`` when jaxmem has none for it."""
    _ensure_rules()
    if isinstance(fn, functools.partial):
        inner = replacement_for(fn.func, options)
        if inner is None:
            return None
        return functools.partial(inner, *fn.args, **fn.keywords)
    try:
        orig = getattr(fn, "_jaxmem_original", fn)
    except Exception:  # noqa: BLE001 - exotic callables whose __getattr__ raises anything
        return None
    name = _ORIGINALS.get(id(orig))
    if name is None:
        return None
    opts = options if options is not None else _options.lookup(name, _parts_of(name))
    out, technique, status, reason = choose(name, opts, orig)
    if out is None or name not in _SELF_RECORDING:
        _report.record(kind="function", target=f"field {getattr(orig, '__name__', name)}",
                       technique=technique, status=status, reason=reason)
    if out is None:
        return None

    @functools.wraps(orig)
    def converted(*args, **kwargs):
        return _call_busy(out, args, kwargs)

    converted._jaxmem_original = orig
    return converted


# ------------------------------------------------------------------ scan over layers
def _unguarded(f):
    """``f`` with the dispatcher's re-entry guard lifted while it is traced, so the layers and
    functions inside a scan body are converted as they are outside it."""

    @functools.wraps(f)
    def body(*args, **kwargs):
        token = _busy.set(False)
        try:
            return f(*args, **kwargs)
        finally:
            _busy.reset(token)

    return body


def _scan_body(f):
    """The body ``lax.scan`` traces in place of ``f``.

    ``f`` is traced exactly once, inside the scan's own trace (a Flax scan body advances
    Flax's per-call state, e.g. dropout keys, every time it is called: it must not be called
    an extra time), to a jaxpr. If that jaxpr has effects (``jax.debug.callback``,
    ``jax.debug.print``, io callbacks, ordered effects) it runs as written: recomputing the
    body in the backward pass would run them a second time. If it already holds a ``jax.checkpoint``
    (``nn.remat``, ``nnx.remat``, a user's checkpoint) it runs as written -- an enclosing
    policy would store what the user's remat recomputes; otherwise it runs under
    ``jax.checkpoint(policy=scan_policy)``. The report gets one entry saying which.
    """
    import jax
    from jax.extend.core import jaxpr_as_fun

    @functools.wraps(f)
    def body(*args):
        closed, out_shape = jax.make_jaxpr(_unguarded(f), return_shape=True)(*args)
        out_tree = jax.tree.structure(out_shape)

        def run(*a):
            return jax.tree.unflatten(out_tree, jaxpr_as_fun(closed)(*jax.tree.leaves(a)))

        if closed.effects:
            _report.record(kind="function", target="jax.lax.scan", technique="selective",
                           status="fallback",
                           reason="body has side effects (" + _effect_names(closed.effects)
                                  + "): kept as written, so they run as often as in "
                                    "plain JAX (nothing recomputed)")
            return run(*args)
        if has_remat(closed.jaxpr):
            _report.record(kind="function", target="jax.lax.scan", technique="selective",
                           status="nothing-to-save",
                           reason="body already under jax.checkpoint: kept as written")
            return run(*args)
        _report.record(kind="function", target="jax.lax.scan", technique="selective",
                       status="converted",
                       reason="body under jax.checkpoint(policy=scan_policy): elementwise "
                              "values and expanding matmuls recomputed, not stacked")
        return jax.checkpoint(run, policy=scan_policy, prevent_cse=False)(*args)

    return body


def _effect_names(effects) -> str:
    names = sorted({type(e).__name__ for e in effects})
    return ", ".join(names) or "effects"


def _scan_rule(opts, orig):
    def scan(f, init, xs=None, *args, **kwargs):
        if not callable(f):  # let lax.scan raise its own error
            return orig(f, init, xs, *args, **kwargs)
        return orig(_scan_body(f), init, xs, *args, **kwargs)
    return scan


def _register_scan():
    register("scan", "selective", ["jax.lax.scan"], _scan_rule, records=True)


# ------------------------------------------------------------------------ installation
def _install_one(mod, modname, attr, name):
    cur = getattr(mod, attr, None)
    if cur is None or getattr(cur, "_jaxmem_dispatcher", False):
        return
    _saved.append((mod, attr, cur))
    setattr(mod, attr, _make_dispatcher(f"{modname}.{attr}", name, cur))


def _acquire():
    global _installed_count
    _ensure_rules()
    with _lock:
        if _installed_count == 0:
            _saved.clear()
            for (modname, attr), name in list(_TARGETS.items()):
                try:
                    mod = importlib.import_module(modname)
                except ImportError:
                    continue
                _install_one(mod, modname, attr, name)
        _installed_count += 1


def _release():
    global _installed_count
    with _lock:
        _installed_count -= 1
        if _installed_count == 0:
            for mod, attr, old in reversed(_saved):
                setattr(mod, attr, old)
            _saved.clear()


def dispatcher_targets() -> list[str]:
    """``'module.attr'`` of every attribute a scope turns into a dispatcher."""
    _ensure_rules()
    return sorted(f"{m}.{a}" for m, a in _TARGETS)


_local = threading.local()


@contextlib.contextmanager
def _linen_interception() -> Iterator[None]:
    """Push the Linen interceptor once per thread (Flax's interceptor stack is per thread)."""
    depth = getattr(_local, "depth", 0)
    if depth:
        _local.depth = depth + 1
        try:
            yield
        finally:
            _local.depth -= 1
        return
    import flax.linen as nn

    from jaxmem._glue import linen_glue
    _local.depth = 1
    try:
        with nn.intercept_methods(linen_glue.interceptor):
            yield
    finally:
        _local.depth = 0


@contextlib.contextmanager
def _installed(linen: bool = True) -> Iterator[None]:
    _acquire()
    try:
        if linen:
            with _linen_interception():
                yield
        else:
            yield
    finally:
        _release()


@contextlib.contextmanager
def scope_options(opts, label: str = "jaxmem.scope", linen: bool = True) -> Iterator[None]:
    """Activate ``opts`` (an :class:`Options`) for this context: dispatchers installed,
    Linen calls intercepted, records counted for the nothing-converted warning."""
    with _installed(linen), _options.using(opts), _report.frame(label):
        yield


@contextlib.contextmanager
def scope(*, selective: bool = True, fewbit: int | None = None,
          attention: bool = True) -> Iterator[_options.Options]:
    """Convert everything traced inside (see :func:`jaxmem.scope`).

    Flax Linen module calls and patchable inline functions (``nn.relu``, ...) traced in the
    ``with`` block run with jaxmem's techniques; values and (with exact options) gradients
    equal the untouched code's.

    Args:
      selective: use the exact selective-differentiation layers and 1-bit masks.
      fewbit: ``None`` for exact techniques only, or 1..4 bits per smooth activation.
      attention: compute Flax's attention with jaxmem's exact memory-efficient attention.

    Returns:
      A context manager; ``as`` binds the active :class:`Options`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jaxmem
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
      >>> x = jnp.ones((2, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> loss = lambda p: jnp.sum(model.apply(p, x) ** 2)
      >>> with jaxmem.scope(fewbit=None) as opts:
      ...     g = jax.grad(loss)(params)
      >>> opts.selective, opts.fewbit
      (True, None)
      >>> same = jax.tree.map(jnp.allclose, g, jax.grad(loss)(params))
      >>> all(bool(s) for s in jax.tree.leaves(same))
      True
    """
    opts = _options.Options(selective=selective, fewbit=fewbit, attention=attention)
    with scope_options(opts):
        yield opts


def deprecated_scope(*, selective: bool = True, fewbit: int | None = None,
                     attention: bool = True):
    """Deprecated: ``jaxmem.scope`` patches functions while code traces inside it; use
    ``jaxmem.transform(f, fewbit=...)`` (any JAX function, converted by what it computes) or
    ``jaxmem.linen.convert`` / ``jaxmem.nnx.convert``. Same arguments as :func:`scope`."""
    from jaxmem import _deprecation

    _deprecation.warn("jaxmem.scope", "jaxmem.transform(f, fewbit=...) or "
                      "jaxmem.linen.convert / jaxmem.nnx.convert")
    return scope(selective=selective, fewbit=fewbit, attention=attention)


@contextlib.contextmanager
def observing() -> Iterator[None]:
    """Install dispatchers and the Linen interceptor without activating any options (what
    :func:`jaxmem.report` uses to see calls made outside every scope)."""
    with _installed(True):
        yield
