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

import functools

import flax.linen as nn

from jaxmem._glue import options as _options
from jaxmem._glue import pickling as _pickling

__all__ = ["convert", "is_converted", "options_of"]

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


def _wrap_method(fn, transform_options, label):
    from flax.linen import transforms

    lifted = transforms.decorator_lift_transform(_lifted(transform_options, label), fn)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        if self.is_initializing():  # variables are being created: nothing to save yet
            return fn(self, *args, **kwargs)
        return lifted(self, *args, **kwargs)
    return method


def _reduce_ex(self, protocol):
    """Pickle as the base class's state plus ``_converted_class(base, options)``."""
    sub = type(self)
    return _pickling.reduce(self, protocol, "jaxmem.linen._converted_class",
                            (sub._jaxmem_base, sub._jaxmem_options))


@functools.cache
def _converted_class(cls, opts):
    """The converted subclass of the Linen class ``cls`` under ``opts`` (one per pair)."""
    topts = opts.transform_options()
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "_jaxmem_options": opts, "_jaxmem_base": cls,
          "__reduce_ex__": _reduce_ex}
    for name in _method_names(cls):
        ns[name] = _wrap_method(getattr(cls, name), topts, cls.__name__)
    return type(cls)(cls.__name__, (cls,), ns)


def is_converted(model) -> bool:
    """Whether ``model`` (a Linen Module) comes from :func:`convert`."""
    return getattr(type(model), "_jaxmem_options", None) is not None


def options_of(model):
    """The :class:`jaxmem._glue.options.Options` a converted model runs with (else None)."""
    return getattr(type(model), "_jaxmem_options", None)


def convert(model, *, selective: bool = True, fewbit: int | None = None,
            attention: bool = True) -> nn.Module:
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
    opts = _options.Options(selective=selective, fewbit=fewbit, attention=attention)
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
