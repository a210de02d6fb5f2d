"""The options of a Flax conversion, and the conversion options active in this thread.

:class:`Options` are what ``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` (and the
deprecated scopes) run with; ``transform_options()`` maps them onto :func:`jaxmem.transform`'s
arguments. ``using(options)`` pushes ``options`` for the duration of a ``with`` block. The
stack of pushed options is a JAX configuration state that is part of JAX's trace context
and of ``jax.jit``'s cache key (``include_in_jit_key``/``include_in_trace_context``, like
``jax.set_mesh``): a function
jitted inside a scope is traced again when it is called outside it (or inside other
options), so it never keeps a trace made under options that are no longer active. The state
is thread-local: another thread tracing at the same time sees its own (usually empty) stack
and gets plain JAX/Flax.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from jaxmem._compat import jax_config as _jax_config

__all__ = ["Options", "active", "keyed", "using"]


@dataclasses.dataclass(frozen=True)
class Options:
    """What a conversion converts.

    selective: exact selective-differentiation layers and 1-bit ReLU-family masks.
    fewbit: ``None`` (exact techniques only) or 1..4 bits per element for the stored codes of
      smooth activations (approximate gradients, opt-in).
    attention: exact memory-lean attention (no ``T x S`` residual).
    residual_adds: with ``selective``, the next product recomputes its input from an add of
      two recomputable values (a ResNet block output) instead of keeping it.
    conv_recompute: with ``selective``, a norm of a 1x1 convolution of another norm's
      output recomputes that convolution in its backward pass instead of keeping its input.
    attention_chunk: ``None`` or query rows per chunk (an int >= 1) of the exact attention:
      an attention with more query rows runs that many at a time in both passes, so its
      ``T x S`` scores, weights and their cotangents are formed ``attention_chunk x S`` at a
      time (exact; the key and value gradients summed over chunks).
    mlp_chunk: ``None`` or rows per chunk (an int >= 1) of a two-layer perceptron (a
      transformer's MLP): it keeps its input and weights, runs both passes that many rows at
      a time and recomputes the first product in its backward pass (exact).
    """

    selective: bool = True
    fewbit: int | None = None
    attention: bool = True
    residual_adds: bool = True
    conv_recompute: bool = True
    attention_chunk: int | None = 512
    mlp_chunk: int | None = None

    def __post_init__(self):
        if not isinstance(self.selective, bool):
            raise TypeError(f"selective must be True or False, got {self.selective!r}")
        for name in ("attention", "residual_adds", "conv_recompute"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        fb = self.fewbit
        if fb is not None and (isinstance(fb, bool) or not isinstance(fb, int)
                               or not 1 <= fb <= 4):
            raise ValueError(f"fewbit must be None (exact only) or an int in 1..4 (bits per "
                             f"element), got {fb!r}")
        for name, what in (("attention_chunk", "query rows"), ("mlp_chunk", "rows")):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be None or an int >= 1 ({what} per chunk), "
                                 f"got {n!r}")

    def transform_options(self) -> dict:
        """The :func:`jaxmem.transform` arguments a conversion with these options runs with
        (``selective`` maps to products, norms, dropout, pools and the exact activation
        rules)."""
        sel = self.selective
        return {"fewbit": self.fewbit, "attention": self.attention, "products": sel,
                "activations": sel or self.fewbit is not None, "norms": sel, "dropout": sel,
                "pools": sel, "residual_adds": self.residual_adds,
                "conv_recompute": self.conv_recompute, "attention_chunk": self.attention_chunk,
                "mlp_chunk": self.mlp_chunk}

    def public(self) -> dict:
        return {"selective": self.selective, "fewbit": self.fewbit,
                "attention": self.attention, "residual_adds": self.residual_adds,
                "conv_recompute": self.conv_recompute, "attention_chunk": self.attention_chunk,
                "mlp_chunk": self.mlp_chunk}


def _trace_state(name: str, default):
    """A thread-local JAX configuration state that is part of the trace context and of
    ``jax.jit``'s cache key (entering / leaving a value retraces jitted functions)."""
    return _jax_config.config_ext.Config(name, default, include_in_jit_key=True,
                                         include_in_trace_context=True)


#: the active options, outermost first (a tuple of :class:`Options`)
_STACK = _trace_state("jaxmem_scope_options", ())
#: a number per :func:`jaxmem.report` call while it traces, part of ``jax.jit``'s cache key:
#: a function the reported step jits is traced again for each report (so its calls are
#: recorded), and a trace made while reporting is not reused outside it
REPORT_TRACE = _trace_state("jaxmem_report_trace", 0)


@contextlib.contextmanager
def keyed(state, value) -> Iterator[None]:
    """Set the trace-context ``state`` (from :func:`_trace_state`) to ``value`` in this
    thread for the duration of the block."""
    prev = state.swap_local(value)
    try:
        yield
    finally:
        state.set_local(prev)


def active() -> Options | None:
    """The innermost options pushed with :func:`using` in this thread, or ``None``."""
    stack = _STACK.value
    return stack[-1] if stack else None


@contextlib.contextmanager
def using(options: Options) -> Iterator[Options]:
    """Push ``options`` for the duration of the block (this context / thread only)."""
    if not isinstance(options, Options):
        raise TypeError(f"using: expected jaxmem._glue.options.Options, got {options!r}")
    with keyed(_STACK, _STACK.value + (options,)):
        yield options
