"""Deprecated few-bit context managers (until jaxmem 0.3.0).

``patch_activations``, ``patch_softmax`` and ``patch_attention`` used to patch ``jax.nn`` /
``flax.linen`` / ``flax.nnx`` attributes while code traced inside them. Nothing is patched
any more: each is now the deprecated Linen scope with the matching options (Linen module
calls traced inside run as ``jaxmem.linen.convert(model, selective=False, fewbit=...,
attention=...)`` runs them). Code outside Linen modules is converted by
``jaxmem.transform(f, fewbit=bits)``. ``activation_fn`` is
:func:`jaxmem.fewbit.activation`.
"""
from __future__ import annotations

from jaxmem import _deprecation
from jaxmem._prims.checks import check_bits

__all__: list[str] = []


def _linen_scope(fewbit, attention, label):
    from jaxmem._glue import options as _options
    from jaxmem.linen import scope_options

    opts = _options.Options(selective=False, fewbit=fewbit, attention=attention)
    return scope_options(opts, label=label)


def _patch_activations(bits: int = 3, activations=None, modules=None):
    """Deprecated: ``jaxmem.linen.convert(model, selective=False, fewbit=bits,
    attention=False)`` or ``jaxmem.transform(f, fewbit=bits)``.

    Linen calls traced inside keep ``bits``-bit codes of every smooth activation.
    ``activations`` / ``modules`` (which names to convert) are no longer supported: a
    narrower set would need a patch; passing them raises ``TypeError``."""
    bits = check_bits(bits)
    if activations is not None or modules is not None:
        raise TypeError(
            "patch_activations: activations= / modules= are no longer supported (nothing is "
            "patched); every smooth activation of a converted Linen call gets the code. "
            "Convert only part of a model with jaxmem.transform on that part")
    return _linen_scope(bits, False, "jaxmem.fewbit.patch_activations")


def _patch_softmax(modules=None):
    """Deprecated: ``jaxmem.linen.convert(model, selective=False, attention=True)``: Linen
    calls traced inside compute softmax-weighted attention exactly without a ``T x S``
    residual. ``modules`` is no longer supported (``TypeError``)."""
    if modules is not None:
        raise TypeError("patch_softmax: modules= is no longer supported (nothing is patched)")
    return _linen_scope(None, True, "jaxmem.fewbit.patch_softmax")


def _patch_attention():
    """Deprecated: ``jaxmem.linen.convert(model, selective=False, attention=True)``."""
    return _linen_scope(None, True, "jaxmem.fewbit.patch_attention")


_SCOPE = "jaxmem.linen.convert(model, selective=False, fewbit={}, attention={})"
#: deprecated spellings: old name -> ("module:attribute", the spelling to use)
_DEPRECATED = {
    **{n: (f"jaxmem.fewbit.linen:_{n}", _SCOPE.format(f, a))
       for n, f, a in (("patch_activations", "bits", False), ("patch_softmax", "None", True),
                       ("patch_attention", "None", True))},
    "activation_fn": ("jaxmem.fewbit.ops:activation", "jaxmem.fewbit.activation(name, bits)"),
}
__getattr__ = _deprecation.deprecated_attributes("jaxmem.fewbit.linen", _DEPRECATED)
