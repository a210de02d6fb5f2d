"""Flax glue: switch a model's activations to few-bit without editing the model.

The one way in is ``jaxmem.scope(fewbit=bits)`` / ``jaxmem.linen.convert(model,
fewbit=bits)``; this module registers the few-bit rules on :mod:`jaxmem._glue.patch`.
Deprecated: ``patch_activations``, ``patch_softmax``, ``patch_attention`` (use
:func:`jaxmem.scope`) and ``activation_fn`` (use :func:`jaxmem.fewbit.activation`).

Models usually call activations inline (``nn.gelu(x)``, ``jax.nn.silu(x)``,
``nnx.gelu(x)``); those are attribute look-ups on the modules ``jax.nn``, ``flax.linen``
and ``flax.nnx`` at *trace* time.  :func:`jaxmem.scope` is a scoped, restorable context
manager that swaps those attributes for few-bit versions while it is active::

    with jaxmem.scope(fewbit=3):
        step = jax.jit(train_step).lower(state, batch).compile()   # trace inside
    step(state, batch)                                            # few-bit residuals

Caveats (read them):

* It must wrap **tracing** (``jax.jit(...)`` first call / ``.lower``, ``jax.grad`` calls,
  ``model.init``/``apply`` under autodiff).  A function that was already traced and cached
  by ``jit`` before entering the context keeps its exact activations; one traced inside
  keeps few-bit ones after the context exits (the compiled code does not change).
* Only calls that look the function up through the module (``nn.gelu``, ``jax.nn.gelu``,
  ``nnx.gelu``) are redirected; ``from jax.nn import gelu`` bound before entering, or
  ``jnp.tanh``, are not.
* Thread-safe: while it is active the attributes are dispatchers that read the options of
  the calling context, so another thread tracing at the same time gets plain JAX.
* Defaults are preserved: ``jax.nn.gelu``'s default ``approximate=True`` (tanh form) stays
  the default of the patched ``nn.gelu``.  Activation parameters the shipped tables were not
  fitted for (``elu(alpha=2)``, ``leaky_relu`` slopes, ``celu(alpha)``) use
  :func:`make_activation` (fitted once, cached) or the exact 1-bit mask.

For models that take the activation as a field, pass ``functools.partial(fewbit.gelu,
bits=3)`` (or ``fewbit.activation("gelu", 3)``) instead.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp

from jaxmem import _deprecation
from jaxmem._prims.checks import check_bits

from . import ops
from .factory import make_activation

__all__ = ["PATCHABLE", "PATCH_MODULES"]

#: modules whose attributes are patched (those that exist and are importable)
PATCH_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
                 "flax.nnx.nn.activations")

_ORIG = {n: getattr(jax.nn, n) for n in [
    "gelu", "silu", "swish", "sigmoid", "tanh", "selu", "softplus", "elu", "celu", "mish",
    "soft_sign", "log_sigmoid", "hard_swish", "hard_silu", "relu", "relu6", "hard_tanh",
    "leaky_relu"]}


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _replacement(attr: str, bits: int) -> Callable:
    orig = _ORIG[attr]

    if attr == "gelu":
        def f(x, approximate: bool = True):
            if not _floating(x):
                return orig(x, approximate)
            return ops.gelu(x, bits=bits, approximate=bool(approximate))
    elif attr in ("elu", "celu"):
        def f(x, alpha=1.0):
            if not _floating(x) or not isinstance(alpha, (int, float)):
                return orig(x, alpha)
            if float(alpha) == 1.0:
                return ops.activation(attr, bits)(x)
            return make_activation(_fixed(orig, "alpha", float(alpha)), bits,
                                   name=f"{attr}_alpha{alpha}")(x)
    elif attr == "leaky_relu":
        def f(x, negative_slope=1e-2):
            if not _floating(x) or not isinstance(negative_slope, (int, float)):
                return orig(x, negative_slope)
            return ops.leaky_relu(x, float(negative_slope))
    else:
        table = {"swish": "silu", "soft_sign": "softsign", "hard_silu": "hard_swish"}.get(attr,
                                                                                          attr)

        def f(x):
            if not _floating(x):
                return orig(x)
            return ops.activation(table, bits)(x)

    f.__name__ = f"fewbit_{attr}"
    f.__doc__ = f"few-bit ({bits}-bit backward) replacement of jax.nn.{attr}"
    f.__wrapped__ = orig
    return f


@functools.cache
def _fixed(orig: Callable, kw: str, value: float) -> Callable:
    """Hashable, cached ``orig(x, kw=value)`` so make_activation fits each variant once."""
    return functools.partial(orig, **{kw: value})


#: attribute names that can be patched
PATCHABLE = tuple(_ORIG)


def _make_rule(attr):
    def make(opts, orig):
        if opts.fewbit is None:
            return (None, "approximate-not-allowed",
                    "few-bit gradients are approximate: pass fewbit=1..4 to allow them")
        return _replacement(attr, opts.fewbit)
    return make


def _register():
    from jaxmem._glue import patch as _gpatch
    for attr in PATCHABLE:
        _gpatch.register(attr, "fewbit", [f"{m}.{attr}" for m in PATCH_MODULES],
                         _make_rule(attr))


_register()


@contextlib.contextmanager
def _patch_activations(bits: int = 3, activations: Iterable[str] | None = None,
                      modules: Iterable[str] = PATCH_MODULES) -> Iterator[dict]:
    """Deprecated: use ``jaxmem.scope(selective=False, fewbit=bits, attention=False)``.

    Few-bit ``jax.nn`` / ``flax.linen`` / ``flax.nnx`` activations inside the block.

    The activations half of ``jaxmem.scope(selective=False, fewbit=bits, attention=False)``,
    restricted to ``activations`` (so it composes with enclosing scopes, which decide
    everything else).

    Args:
      bits: bits per element of the stored codes (1..4; the ReLU family is always exact).
      activations: attribute names to convert (default: all of :data:`PATCHABLE`, e.g.
        ``["gelu"]`` for GELU only).
      modules: dotted module names whose attributes are converted.

    Yields:
      dict ``"module.attr" -> function`` of what is converted. While any scope is active
      the attributes are dispatchers; everything is restored when the last scope exits,
      also on exceptions.
    """
    from jaxmem._glue import options as _options
    from jaxmem._glue import patch as _gpatch

    bits = check_bits(bits)
    names = tuple(PATCHABLE if activations is None else activations)
    unknown = [n for n in names if n not in _ORIG]
    if unknown:
        raise ValueError(f"cannot patch activations {unknown}; patchable: {list(PATCHABLE)}")
    modules = tuple(modules)
    if set(modules) == set(PATCH_MODULES):
        only = frozenset(names)
    else:
        only = frozenset(f"{m}.{n}" for m in modules for n in names)
    opts = _options.Options(selective=False, fewbit=bits, attention=False, only=only)
    with _gpatch.scope_options(opts, label="jaxmem.fewbit.patch_activations", linen=False):
        yield _module_attributes(modules, names)


def _module_attributes(modules: Iterable[str], names: Iterable[str]) -> dict[str, Callable]:
    """``{"module.attr": current value}`` for each importable module of ``modules`` and each
    attribute of ``names`` it has (what a patch scope yields: the dispatchers in place)."""
    names = tuple(names)
    found = {}
    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for attr in names:
            cur = getattr(mod, attr, None)
            if cur is not None:
                found[f"{modname}.{attr}"] = cur
    return found


@contextlib.contextmanager
def _patch_softmax(modules: Sequence[str] | None = None) -> Iterator[dict]:
    """Deprecated: use ``jaxmem.scope(selective=False, attention=True)``.

    Use :func:`jaxmem.selective.softmax` (exact; backward stores only the output) for
    ``softmax`` looked up in ``jax.nn`` / ``flax.linen`` / ``flax.nnx`` inside the block: the
    softmax part of ``jaxmem.scope(attention=True)``, restricted to it (so it composes with
    enclosing scopes).

    Same rules as ``patch_activations``: wrap the *tracing*; only look-ups
    through the module (``nn.softmax(x)``) are redirected; everything is restored on exit.
    ``modules``: default, those of ``jaxmem._glue.attention.SOFTMAX_MODULES``. Yields
    ``{"module.softmax": function}``.
    """
    from jaxmem._glue import options as _options
    from jaxmem._glue import patch as _gpatch
    from jaxmem._glue.attention import SOFTMAX_MODULES

    modules = SOFTMAX_MODULES if modules is None else tuple(modules)
    only = (frozenset({"softmax"}) if set(modules) == set(SOFTMAX_MODULES)
            else frozenset(f"{m}.softmax" for m in modules))
    opts = _options.Options(selective=False, fewbit=None, attention=True, only=only)
    with _gpatch.scope_options(opts, label="jaxmem.fewbit.patch_softmax", linen=False):
        yield _module_attributes(modules, ("softmax",))


@contextlib.contextmanager
def _patch_attention() -> Iterator[None]:
    """Deprecated: use ``jaxmem.scope(selective=False, attention=True)``.

    Run :class:`jaxmem.models.SelfAttention` (GPT, ViT of the model zoo) with
    :func:`jaxmem.selective.attention` while tracing inside the context: the zoo part of
    ``jaxmem.scope(attention=True)``, restricted to it (so it composes with enclosing
    scopes).

    Each ``SelfAttention.__call__`` (outside ``init``) is computed from the module's own
    ``c_attn`` / ``c_proj`` parameters with the same arithmetic (``flax.linen.Dense``'s
    promote-dot-bias, the same split, scale and causal mask), so the forward is the model's
    and the gradient is exact; only the attention matrix is not stored. Parameters and their
    tree are untouched. Wrap the tracing.
    """
    from jaxmem._glue import options as _options
    from jaxmem._glue import patch as _gpatch

    opts = _options.Options(selective=False, fewbit=None, attention=True,
                            only=frozenset({"SelfAttention"}))
    with _gpatch.scope_options(opts, label="jaxmem.fewbit.patch_attention"):
        yield


_SCOPE = "jaxmem.scope(selective=False, fewbit={}, attention={})"
#: deprecated spellings: old name -> ("module:attribute", the spelling to use)
_DEPRECATED = {
    **{n: (f"jaxmem.fewbit.linen:_{n}", _SCOPE.format(f, a))
       for n, f, a in (("patch_activations", "bits", False), ("patch_softmax", "None", True),
                       ("patch_attention", "None", True))},
    "activation_fn": ("jaxmem.fewbit.ops:activation", "jaxmem.fewbit.activation(name, bits)"),
}
__getattr__ = _deprecation.deprecated_attributes("jaxmem.fewbit.linen", _DEPRECATED)
