"""``jaxmem.nnx.convert``: the one way in for Flax NNX modules.

``convert(module)`` returns a module whose calls run through :func:`jaxmem.transform`: the
module is split into its graph and state (``nnx.split``), its ``__call__`` runs as a pure
function of the state that is traced to a jaxpr and re-emitted with jaxmem's ops wherever
the *computation* matches (layers, activations held as attributes, inline ``nnx.relu`` /
``nnx.gelu`` / ``nnx.max_pool``, attention, norms, dropout), and the state it updates
(batch statistics, RNG counts) is written back (``nnx.update``). Nothing is patched; the
layers, their classes and their Variables are unchanged. ``copy=True`` (default) converts a
clone and leaves ``module`` untouched; ``copy=False`` converts in place (same Variables) and
returns it.
"""
from __future__ import annotations

import functools

import jax
from flax import nnx as _nnx

from jaxmem._glue import options as _options
from jaxmem._glue import pickling as _pickling

__all__ = ["convert", "is_converted"]


_BASE_METHODS = frozenset(dir(_nnx.Module))


def _method_names(cls) -> list:
    """``__call__`` and the public methods ``cls`` defines beyond ``nnx.Module``'s."""
    return [n for n in dir(cls) if (n == "__call__" or not n.startswith("_"))
            and n not in _BASE_METHODS - {"__call__"} and callable(getattr(cls, n, None))
            and not isinstance(getattr(cls, n), type)]


def _is_nnx_object(x) -> bool:
    return isinstance(x, (_nnx.Pytree, _nnx.Variable))


def _reduce_ex(self, protocol):
    """Pickle as the base class's state plus ``_converted_class(base, options)``."""
    sub = type(self)
    return _pickling.reduce(self, protocol, "jaxmem.nnx._converted_class",
                            (sub._jaxmem_base, sub._jaxmem_options))


@functools.cache
def _converted_class(cls, opts):
    """The converted subclass of the NNX class ``cls`` under ``opts`` (one per pair)."""
    from jaxmem.transform import transform
    from jaxmem.transform.report import warn_if_nothing_converted

    topts = opts.transform_options()
    holder = []

    def transformed(name):
        def method(self, *args, **kwargs):
            # NNX objects among the arguments (an Rngs, a shared module) are split with the
            # module, so what the call sets on them (RNG counts) is written back too
            leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_nnx_object)
            # leaf index -> its place in `objects` (self is place 0)
            at = {i: n for n, i in enumerate(
                (i for i, x in enumerate(leaves) if _is_nnx_object(x)), 1)}
            objects = (self, *(leaves[i] for i in at))
            graphdef, state = _nnx.split(objects)
            plain = [x for i, x in enumerate(leaves) if i not in at]
            changed: list = []  # paths of the Variables the call sets (statistics, RNGs)

            def pure(state, plain):
                old = {p: v.get_value() for p, v in _nnx.to_flat_state(state)}
                merged = _nnx.merge(graphdef, state)  # shares the Variables of `state`
                it = iter(plain)
                full = [merged[at[i]] if i in at else next(it) for i in range(len(leaves))]
                a, k = jax.tree_util.tree_unflatten(tree, full)
                y = getattr(super(holder[0], merged[0]), name)(*a, **k)
                new = [(p, v) for p, v in _nnx.to_flat_state(_nnx.state(merged))
                       if p not in old or v.get_value() is not old[p]]
                changed.append(tuple(p for p, _ in new))
                return y, [v for _, v in new]

            with warn_if_nothing_converted(f"jaxmem.nnx.convert({cls.__name__})"):
                y, values = transform(pure, **topts)(state, plain)
            if values:  # write back only what the call set (a Param read is no mutation)
                _nnx.update(objects, _nnx.from_flat_state(list(zip(changed[0], values))))
            return y

        method.__name__ = name
        return method

    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "_jaxmem_options": opts, "_jaxmem_base": cls,
          "__reduce_ex__": _reduce_ex}
    for name in _method_names(cls):
        ns[name] = transformed(name)
    sub = type(cls)(cls.__name__, (cls,), ns)
    holder.append(sub)
    return sub


def is_converted(module) -> bool:
    """Whether ``module`` (an ``nnx.Module``) comes from :func:`convert`."""
    return getattr(type(module), "_jaxmem_options", None) is not None


def convert(module, *, selective: bool = True, fewbit: int | None = None,
            attention: bool = True, residual_adds: bool = True,
            conv_recompute: bool = True, attention_chunk: int | None = 512,
            mlp_chunk: int | None = None, copy: bool = True):
    """Convert an ``nnx.Module`` (see the module docstring); returns the converted module.

    Calls run through :func:`jaxmem.transform` with ``products``, ``norms``, ``dropout``
    (and the exact ReLU-family masks) = ``selective``, ``fewbit`` and ``attention`` as given.
    ``copy=True``: a converted clone (``module`` untouched); ``copy=False``: in place, same
    Variables.

    Args:
      module: the ``flax.nnx.Module`` to convert.
      selective: use the exact selective-differentiation layers and 1-bit masks.
      fewbit: ``None`` for exact techniques only, or 1..4 bits per smooth activation.
      attention: compute attention with jaxmem's exact memory-efficient attention.
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
      copy: ``True`` converts a clone; ``False`` converts ``module`` in place.

    Returns:
      The converted module (a clone, or ``module`` itself with ``copy=False``); its calls
      give the same outputs as ``module``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxmem
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.lin = nnx.Linear(5, 3, rngs=rngs)
      ...     def __call__(self, x):
      ...         return nnx.relu(self.lin(x))
      >>> net = Net(nnx.Rngs(0))
      >>> fast = jaxmem.nnx.convert(net)
      >>> jaxmem.nnx.is_converted(fast), jaxmem.nnx.is_converted(net)
      (True, False)
      >>> x = jnp.ones((2, 5))
      >>> fast(x).shape, bool(jnp.allclose(fast(x), net(x)))
      ((2, 3), True)
    """
    if not isinstance(module, _nnx.Module):
        raise TypeError(
            "jaxmem.nnx.convert: module must be a flax.nnx.Module, got "
            f"{type(module).__module__}.{type(module).__name__}; for flax.linen modules use "
            "jaxmem.linen.convert")
    if not isinstance(copy, bool):
        raise TypeError(f"jaxmem.nnx.convert: copy must be True or False, got {copy!r}")
    opts = _options.Options(selective=selective, fewbit=fewbit, attention=attention,
                            residual_adds=residual_adds, conv_recompute=conv_recompute,
                            attention_chunk=attention_chunk, mlp_chunk=mlp_chunk)
    m = _nnx.clone(module) if copy else module
    if not any("__call__" in vars(k) for k in type(m).__mro__):  # nothing to call
        return m
    base = getattr(type(m), "_jaxmem_base", type(m))
    m.__class__ = _converted_class(base, opts)
    return m
