"""``jaxmem.linen.convert``: the one way in for Flax Linen models.

``convert(model)`` returns a real Linen Module: an instance of a subclass of the model's
class (same ``__name__`` and fields, so the parameter tree and Flax's auto-names such as
``Dense_0`` do not change) whose methods run as a Flax lifted :func:`jaxmem.transform`
with the given options (variables and RNG streams in as arguments, updates out; ``init``
runs the untouched code). Nothing is patched. It is usable as a submodule and with ``init`` / ``apply`` / ``bind`` /
``tabulate`` / ``clone`` and Flax's lifted transforms (``nn.jit``, ``nn.scan``,
``nn.remat``).

Example::

    model = jaxmem.linen.convert(MyResNet(), fewbit=None)   # exact techniques only
    variables = model.init(key, x)                          # same tree as MyResNet().init
    grads = jax.grad(loss)(variables["params"])             # smaller residuals
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import flax.linen as nn

from jaxmem._glue import options as _options
from jaxmem._glue import pickling as _pickling

__all__ = ["call_converted", "convert", "is_converted", "options_of"]

_BASE_METHODS = frozenset(dir(nn.Module)) - {"__call__"}


def _method_names(cls):
    names = []
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            continue
        for name, v in vars(klass).items():
            if name in names or name == "setup" or not callable(v) or isinstance(
                    v, (type, staticmethod, classmethod)):
                continue
            if name.startswith("_") and name != "__call__":
                continue
            if name in _BASE_METHODS:
                continue
            names.append(name)
    return names


def _lifted(transform_options: dict, label: str):
    """Flax's lifting of :func:`jaxmem.transform` (like ``flax.core.lift.checkpoint``): the
    method runs as a pure function of its variable collections and RNG streams, traced to a
    jaxpr and re-emitted with jaxmem's ops; its variable updates are returned, not leaked."""
    from flax.core import lift

    from jaxmem.transform import transform
    from jaxmem.transform.report import warn_if_nothing_converted

    def make(fn):
        def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
            def pure(variable_groups, rng_groups, *args, **kwargs):
                scope = scope_fn(variable_groups, rng_groups)
                return fn(scope, *args, **kwargs), repack_fn(scope)
            with warn_if_nothing_converted(f"jaxmem.linen.convert({label})"):
                return transform(pure, **transform_options)(variable_groups, rng_groups,
                                                            *args, **kwargs)
        return lift.pack(inner, (True,), (True,), (True,), name="jaxmem", enable_kwargs=True)
    return make


@functools.cache
def _lifted_method(fn, options, label):
    """``fn`` (a Linen method, as its class holds it) run as the lifted transformation under
    ``options`` (an :class:`~jaxmem._glue.options.Options`): ``lifted(module, *args)``."""
    from flax.linen import transforms

    return transforms.decorator_lift_transform(_lifted(options.transform_options(), label),
                                               fn)


def _wrap_method(fn, opts, label):
    lifted = _lifted_method(fn, opts, label)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        if self.is_initializing():  # variables are being created: nothing to save yet
            return fn(self, *args, **kwargs)
        token = _IN_CONVERTED.set(True)  # a scope around it leaves its inner calls alone
        try:
            return lifted(self, *args, **kwargs)
        finally:
            _IN_CONVERTED.reset(token)
    return method


def _reduce_ex(self, protocol):
    """Pickle as the base class's state plus ``_converted_class(base, options)``."""
    sub = type(self)
    return _pickling.reduce(self, protocol, "jaxmem.linen._converted_class",
                            (sub._jaxmem_base, sub._jaxmem_options))


@functools.cache
def _converted_class(cls, opts):
    """The converted subclass of the Linen class ``cls`` under ``opts`` (one per pair)."""
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "_jaxmem_options": opts, "_jaxmem_base": cls,
          "__reduce_ex__": _reduce_ex}
    for name in _method_names(cls):
        ns[name] = _wrap_method(getattr(cls, name), opts, cls.__name__)
    return type(cls)(cls.__name__, (cls,), ns)


def is_converted(model) -> bool:
    """Whether ``model`` (a Linen Module) comes from :func:`convert`."""
    return getattr(type(model), "_jaxmem_options", None) is not None


def options_of(model):
    """The :class:`jaxmem._glue.options.Options` a converted model runs with (else None)."""
    return getattr(type(model), "_jaxmem_options", None)


def convert(model, *, selective: bool = True, fewbit: int | None = None,
            attention: bool = True, residual_adds: bool = True,
            conv_recompute: bool = True, attention_chunk: int | None = 512,
            mlp_chunk: int | None = None) -> nn.Module:
    """A Linen Module with the same fields and parameter tree as ``model`` whose every method
    call runs through ``jaxmem.transform`` (see ``Options.transform_options``).

    selective: exact selective-differentiation layers, 1-bit ReLU-family masks.
    fewbit: ``None`` (exact techniques only) or 1..4: few-bit residuals for smooth
      activations (approximate gradients, opt-in).
    attention: Flax's attention computed with jaxmem's exact memory-efficient attention.
    ``model`` itself is not modified. Raises ``TypeError`` for anything that is not a
    ``flax.linen.Module``.

    Args:
      model: the ``flax.linen.Module`` to convert (left unmodified).
      selective: use the exact selective-differentiation layers and 1-bit masks.
      fewbit: ``None`` for exact techniques only, or 1..4 bits per smooth activation.
      attention: compute Flax's attention with jaxmem's exact memory-efficient attention.
      residual_adds: with ``selective``, the next block's first layer recomputes a ResNet
        block output ``relu(norm(conv(h)) + shortcut)`` from the norms' residuals for its
        kernel gradient instead of keeping it (``jaxmem.transform``'s option of that name).
      conv_recompute: with ``selective``, a norm applied to a 1x1 convolution of another
        norm's output (a ResNet bottleneck's expansion) recomputes that convolution in its
        backward pass instead of keeping its input (``jaxmem.transform``'s option).
      attention_chunk: ``None`` or query rows per chunk of the exact attention: one with more
        query rows runs that many at a time in both passes (exact; ``jaxmem.transform``'s
        option).
      mlp_chunk: ``None`` or rows per chunk of a two-layer perceptron (a transformer's MLP):
        it keeps its input and weights, runs both passes that many rows at a time and
        recomputes the first product in its backward pass (exact; ``jaxmem.transform``'s
        option).

    Returns:
      A Linen Module of a subclass of ``type(model)`` with the same fields; ``init`` gives
      the same variable tree and ``apply`` the same outputs as ``model``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jaxmem
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = nn.relu(nn.Dense(4)(x))
      ...         return nn.Dense(3)(h)
      >>> model = jaxmem.linen.convert(MLP())
      >>> x = jnp.ones((2, 5))
      >>> variables = model.init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, variables["params"]["Dense_0"])
      {'bias': (4,), 'kernel': (5, 4)}
      >>> bool(jnp.allclose(model.apply(variables, x), MLP().apply(variables, x)))
      True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "jaxmem.linen.convert: model must be a flax.linen.Module, got "
            f"{type(model).__module__}.{type(model).__name__}; for flax.nnx modules use "
            "jaxmem.nnx.convert")
    opts = _options.Options(selective=selective, fewbit=fewbit, attention=attention,
                            residual_adds=residual_adds, conv_recompute=conv_recompute,
                            attention_chunk=attention_chunk, mlp_chunk=mlp_chunk)
    return _convert_with(model, opts)


def _convert_with(model, opts):
    base = getattr(type(model), "_jaxmem_base", type(model))
    sub = _converted_class(base, opts)
    import dataclasses
    attrs = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}
    released = _release_name(model)
    try:
        return sub(**attrs)
    except BaseException:
        if released is not None:
            released()
        raise


def _release_name(model):
    """When ``model`` was made inside a parent's ``@nn.compact`` method (or with an explicit
    name in ``setup``), Flax has already attached it to the parent under its name: free that
    name so the converted module takes it over (same name, so the same parameters and
    auto-names as calling ``model`` itself). Returns a function that re-attaches ``model``
    (used if building the converted module fails), or ``None`` when ``model`` is not
    attached. Raises ``ValueError`` when ``model`` was already called (its variables exist
    under that name: convert it before its first call)."""
    parent = getattr(model, "parent", None)
    name = getattr(model, "name", None)
    scope = getattr(parent, "scope", None) if isinstance(parent, nn.Module) else None
    if scope is None or name is None or parent._state.children.get(name) is not model:
        return None
    own = getattr(model, "scope", None)
    if own is not None and (own.reservations or own._variables):
        raise ValueError(
            f"jaxmem.linen.convert: the submodule {name!r} of {type(parent).__name__} was "
            "already called before it was converted; convert it where it is created, e.g. "
            f"jaxmem.linen.convert({type(model).__name__}(...))(x), and call only the "
            "converted module")
    children, reservations = parent._state.children, scope.reservations
    held = reservations.get(name)
    del children[name]
    if held is not None:
        del reservations[name]

    def restore():
        children[name] = model
        if held is not None:
            reservations[name] = held

    return restore


# ------------------------------------------------------------------ converting calls in place
def call_converted(module, method_name: str, args: tuple, kwargs: dict, opts,
                   label: str = "") -> object:
    """Run ``module.<method_name>(*args, **kwargs)`` (a bound Linen module, called from a
    method interceptor) as the lifted :func:`jaxmem.transform` under ``opts`` (an
    :class:`~jaxmem._glue.options.Options`): the same values, jaxmem's residuals."""
    fn = getattr(type(module), method_name)
    name = type(module).__name__
    return _lifted_method(fn, opts, f"{label}: {name}" if label else name)(module, *args,
                                                                          **kwargs)


#: set while a converted call runs (a converted module's, or one a scope converts): its inner
#: module calls are part of it
_IN_CONVERTED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxmem_in_converted",
                                                                    default=False)


#: the scopes active in this context, innermost last
_SCOPES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxmem_linen_scopes",
                                                               default=())


def _interceptor(opts, marker, label):
    def intercept(next_fun, args, kwargs, context):
        m, name = context.module, context.method_name
        active = _SCOPES.get()
        if (_IN_CONVERTED.get() or not active or active[-1] is not marker or name == "setup"
                or (name.startswith("_") and name != "__call__") or is_converted(m)
                or not _is_bound(m) or m.is_initializing()):
            return next_fun(*args, **kwargs)
        token = _IN_CONVERTED.set(True)
        try:
            return call_converted(m, name, args, kwargs, opts, label)
        finally:
            _IN_CONVERTED.reset(token)
    return intercept


def _is_bound(m) -> bool:
    return getattr(m, "scope", None) is not None


@contextlib.contextmanager
def scope_options(opts, label: str = "jaxmem.scope") -> Iterator[object]:
    """Within the block (this thread), each outermost Flax Linen method call traced outside
    ``init`` runs as ``jaxmem.linen.convert(module, **opts)`` would run it: the lifted
    :func:`jaxmem.transform` (Flax's own ``intercept_methods``; nothing is patched). The
    innermost active block decides. ``opts`` is part of ``jax.jit``'s cache key while the
    block runs, so a function jitted inside is traced again outside. Functions called
    outside Linen modules, and NNX modules, are left as written (``label`` names the block
    in the conversion's warnings)."""
    import flax.linen as nn

    from jaxmem._glue import options as _options

    marker = object()
    token = _SCOPES.set((*_SCOPES.get(), marker))  # the innermost scope decides
    try:
        with _options.using(opts), nn.intercept_methods(_interceptor(opts, marker, label)):
            yield opts
    finally:
        _SCOPES.reset(token)


@contextlib.contextmanager
def scope(*, selective: bool = True, fewbit: int | None = None,
          attention: bool = True) -> Iterator[object]:
    """Deprecated: use ``jaxmem.linen.convert(model, ...)`` or ``jaxmem.transform(f, ...)``.

    Flax Linen module calls traced in the ``with`` block run as ``jaxmem.linen.convert``
    with these options would run them (values and, with exact options, gradients equal the
    untouched code's). Functions called outside any Linen module, and NNX modules, are not
    converted (``jaxmem.transform`` / ``jaxmem.nnx.convert`` convert those). Nothing is
    patched: the block pushes a Flax method interceptor for this thread.

    Args:
      selective: use the exact selective-differentiation layers and 1-bit masks.
      fewbit: ``None`` for exact techniques only, or 1..4 bits per smooth activation.
      attention: exact memory-lean attention.

    Returns:
      A context manager; ``as`` binds the active options.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxmem.linen import scope
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
      >>> x = jnp.ones((2, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> loss = lambda p: jnp.sum(model.apply(p, x) ** 2)
      >>> with scope(fewbit=None) as opts:
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
    """``jaxmem.scope``, deprecated: see :func:`scope`."""
    from jaxmem import _deprecation

    _deprecation.warn("jaxmem.scope", "jaxmem.linen.convert(model, ...) (it converts Linen "
                      "calls only) or jaxmem.transform(f, ...) (any function)")
    return scope(selective=selective, fewbit=fewbit, attention=attention)
