"""``jaxmem.transform(f, ...)``: convert what a program computes, not what it calls.

``transform(f, *, fewbit=None, attention=True, products=True, activations=True, norms=True,
dropout=True, pools=True, residual_adds=True, conv_recompute=True, biases=True,
projections=True, logits_chunk=1024)`` returns
a function ``g`` with ``g(*args, **kwargs) == f(*args, **kwargs)`` (the same pytree of
outputs) whose reverse-mode autodiff stores less: ``g`` traces ``f`` to a jaxpr (with
``jax.make_jaxpr``) and re-emits it with jaxmem's ``custom_vjp`` ops wherever the
*computation* matches (see :mod:`jaxmem.transform.interpret`).  Nothing is patched: ``g``
is an ordinary function of its arguments that works under ``jit``, ``vmap``, ``grad``,
``lax.scan`` and ``jax.checkpoint``, and the options are fixed when ``g`` is made (two
transformed functions with different options are two functions, so ``jit`` caches each).

Array leaves of the arguments (``jax.Array``, NumPy arrays and scalars, tracers) are traced;
every other leaf (Python numbers, strings, callables, ...) is passed to ``f`` as it is, and
output leaves that are not arrays are returned as ``f`` returned them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._compat import core
from jaxmem.transform.fewbit_sites import deciding
from jaxmem.transform.interpret import INNER_GRADIENT, Interpreter
from jaxmem.transform.options import Options
from jaxmem.transform.report import GradientInsideWarning, Report, collect, collecting, tracing

__all__ = ["report", "transform"]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, core.Tracer))


def _array_leaves(fn: Callable, args: tuple, kwargs: dict):
    """The array leaves of ``(args, kwargs)``, and ``call(vals)``: ``fn`` applied to the
    arguments with those leaves replaced by ``vals`` (every other leaf as given)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, x in enumerate(leaves) if _is_array(x)]

    def call(vals):
        full = list(leaves)
        for i, x in zip(dyn, vals):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **k)

    return [leaves[i] for i in dyn], call


def transform(f: Callable, *, fewbit: int | None = None, attention: bool = True,
              products: bool = True, activations: bool = True, norms: bool = True,
              dropout: bool = True, pools: bool = True,
              residual_adds: bool = True, conv_recompute: bool = True,
              biases: bool = True, projections: bool = True,
              gated_products: bool = True, scaled_products: bool = True,
              computed_weights: bool = True,
              attention_chunk: int | None = 512,
              logits_chunk: int | None = 1024,
              mlp_chunk: int | None = None) -> Callable:
    """``f`` re-emitted with memory-lean ops where its computation matches.

    Args:
      f: any function of pytrees of arrays (Flax ``apply``, Equinox, raw JAX).
      fewbit: ``None`` keeps smooth activations exact; ``1..4`` re-emits each smooth
        elementwise activation subgraph ``f`` with a ``fewbit``-bit code of its input and a
        piecewise-constant ``q ~ f'`` fitted for that very ``f`` (forward exact, gradient
        ``dy * q(x)``).  Piecewise-linear two-slope activations (the ReLU family) always
        get the exact 1-bit mask.
      attention: re-emit ``softmax(q k^T [* scale] [+ bias] [masked]) v`` subgraphs with
        :func:`jaxmem.selective.attention_core` (exact, keeps no ``T x S`` array).
      products: re-emit ``dot_general`` / ``conv_general_dilated`` with
        :mod:`jaxmem.selective` (the input is kept only if the weight is differentiated).
      activations: re-emit elementwise activation subgraphs.
      norms: re-emit normalisation subgraphs (layer / RMS / batch (train) / group norm,
        any spelling) with :func:`jaxmem.selective.normalize` (keeps ``x`` and its
        statistics; exact); one whose statistics are pooled over named axes
        (``lax.pmean``) with the same axis name.
      dropout: re-emit ``where(bernoulli(key, keep), x / keep, 0)`` with
        :func:`jaxmem.selective.dropout` (keeps the key, regenerates the mask; exact).
      pools: re-emit max pools (``reduce_window`` max: ``nn.max_pool``,
        ``lax.reduce_window(x, -inf, lax.max, ...)``) with :func:`jaxmem.selective.max_pool`
        (keeps the argmax position inside each window, not ``x``; exact, ties included).
      residual_adds: with ``products``, an ``a + b`` of two values that re-emitted ops can
        recompute (a ResNet block's ``bn3(c3) + shortcut``) is recomputable too: the next
        block's first product recomputes its input ``relu(a + b)`` from the norms' residuals
        for its kernel gradient instead of keeping it (exact; one more norm + activation
        pass per block in the backward). ``False`` keeps the block output instead.
      conv_recompute: with ``products`` and ``norms``, a normalisation applied to a 1x1,
        stride-1 convolution of another normalisation's output (through a ReLU-family or
        smooth activation: a ResNet bottleneck's ``bn3(conv3(relu(bn2(c2))))``) keeps that
        norm's residuals and the kernel instead of its own input and recomputes the
        convolution in its backward pass (exact; one more 1x1 convolution per such norm in
        the backward). ``False`` keeps the convolution output instead.
      biases: with ``products``, re-emit the bias add of a product (``x @ w + b``, a
        convolution's bias) with :func:`jaxmem.selective.bias_add`: the same sums, but on
        XLA:GPU the layer's output cotangent flows on only once the bias gradient exists,
        so it is not kept until the optimizer update (nothing changes on XLA:CPU).
      projections: with ``products``, ``norms`` and ``attention``, an attention whose
        queries, keys and values are dense projections of a normalisation's output
        (``LN(x) W + b``, then reshapes, splits, transposes, casts or constant scales) keeps
        that norm's residuals and the weights instead of ``q, k, v`` (three arrays of the
        layer's width less per layer) and recomputes the projections in its backward pass
        (exact: the same products of bit-identical values; one more projection per
        attention in the backward). Only where the recomputation needs no collective:
        every device holds the whole weight (no mesh with an axis of size > 1 in context, a
        :mod:`jaxmem.distributed` data parallel step, a fully sharded one without
        ``reduce_early``), or a tensor parallel step holds each device's heads' columns
        (a fused projection split three ways is kept there unless the step is made with
        ``repeat_collectives=True``: its split moves columns between devices; so is a
        fully sharded step's kept shard, then gathered once more). ``False`` keeps
        ``q, k, v``.
      gated_products: with ``products``, an elementwise product ``a * b`` (one shape) whose
        factor is the output of a re-emitted activation or normalisation -- a gated linear
        unit's ``act(x W) * (x V)`` (SwiGLU, GeGLU: Llama, Mistral, Gemma, T5 v1.1),
        ``x * sigmoid(x)`` -- keeps that producer's residuals (``x W``, already kept by the
        activation) instead of the factor, and a product reading ``a * b`` (the down
        projection) recomputes it from them instead of keeping it
        (:func:`jaxmem.selective.gated_product`; exact: the same products of bit-identical
        values; two hidden-width arrays per gated unit instead of four). ``False`` keeps the
        factors and the product.
      scaled_products: with ``products``, a product's output multiplied by an input of the
        function (a parameter, possibly broadcast or scaled by constants) -- a layer scale
        ``gamma * (x W + b)`` (BEiT, DINOv2, CaiT, ConvNeXt) -- is materialised once before
        the product (``lax.optimization_barrier`` off CPU, :mod:`jaxmem.transform.scaled`):
        on XLA:GPU the factor's gradient then reads the kept output instead of re-reducing
        the partial sums of a split-K GEMM, which XLA:GPU would otherwise keep alive until
        the backward pass (several times the output's bytes). Exact; nothing changes on XLA:CPU. ``False`` binds the product as written.
      computed_weights: with ``products``, a dense product's weight computed from the
        function's inputs by a few parameter-sized ops -- a LoRA adapter merged into its
        weight (``W + A B / r``), a cast (``W.astype(bfloat16)``), a weight norm -- is
        recomputed from those inputs in the backward pass (tied to the cotangent) where the
        input gradient needs it, instead of being kept from the forward pass: the
        parameters are kept for the whole step anyway (:mod:`jaxmem.transform.match_dot`;
        the top-level function only, not inside a ``scan`` body). The same ops on the same
        values (XLA may fuse them differently: equal up to float rounding). ``False``
        keeps the computed weight.
      attention_chunk: query rows per chunk of a re-emitted attention core: one with more
        query rows runs both passes that many rows at a time
        (:mod:`jaxmem.selective.attention_chunks`): its scores, weights and their cotangents
        are formed ``(..., H, attention_chunk, S)`` at a time instead of ``(..., H, T, S)``
        (exact; ``dk``, ``dv`` summed over the chunks, float rounding apart). ``None`` never
        chunks.
      logits_chunk: rows (tokens) per chunk of a language-model head: a product ``h W``
        whose rows are wider than ``h``'s (``V > d``), reduced within each row to per-token
        values by a softmax-like loss (optax's cross-entropies, ``log_softmax`` +
        ``take_along_axis``, one-hot sums, any spelling), is computed that many rows at a
        time under ``jax.checkpoint`` (:mod:`jaxmem.transform.match_logits`): no
        ``tokens x vocab`` array is kept or formed whole; the head's product runs again in
        the backward pass. Heads of at most ``logits_chunk`` rows are left as they are.
        ``None`` never chunks.
      mlp_chunk: rows (tokens) per chunk of a two-layer perceptron ``f(x W1 [+ b1]) W2``
        (dense products, an exact smooth activation ``f``: a transformer's MLP) with more
        rows than that: it keeps ``x`` and the weights instead of an ``R x F`` activation
        input, runs both passes ``mlp_chunk`` rows at a time and recomputes ``x W1`` in its
        backward pass (:func:`jaxmem.selective.chunked_mlp`): its ``R x F`` intermediates are formed
        ``mlp_chunk x F`` at a time (exact; the weight gradients summed over the chunks,
        float rounding apart). One product more per MLP in the backward pass where the block
        is stored; none where it is recomputed (``jax.checkpoint``). ``None`` (default)
        never chunks.

    Returns:
      ``g`` with ``g(*a, **k) == f(*a, **k)``; ``g.report(*a, **k)`` returns the
      :class:`~jaxmem.transform.report.Report` of one trace; ``g.options``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def mlp(w, x):
      ...     return jnp.sum(jax.nn.gelu(x @ w) ** 2)
      >>> g = jaxmem.transform(mlp)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> bool(jnp.allclose(jax.grad(g)(w, x), jax.grad(mlp)(w, x)))
      True
    """
    if not callable(f):
        raise TypeError(f"transform: f must be a callable, got {type(f).__name__}")
    options = Options(fewbit=fewbit, attention=attention, products=products,
                      activations=activations, norms=norms, dropout=dropout, pools=pools,
                      residual_adds=residual_adds, conv_recompute=conv_recompute,
                      biases=biases, projections=projections,
                      gated_products=gated_products, scaled_products=scaled_products,
                      computed_weights=computed_weights,
                      attention_chunk=attention_chunk, logits_chunk=logits_chunk,
                      mlp_chunk=mlp_chunk)
    interp = Interpreter(options)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        dyn_vals, call = _array_leaves(f, args, kwargs)
        out_tree: list = []

        def flat_f(*dyn_vals):
            outs, t = jax.tree_util.tree_flatten(call(dyn_vals))
            out_tree.append((t, [None if _is_array(o) else o for o in outs]))
            return [o for o in outs if _is_array(o)]

        with tracing():
            closed = jax.make_jaxpr(flat_f)(*dyn_vals)
            with deciding(interp, closed, dyn_vals):
                outs, inner_gradient = interp.run_outermost(closed, dyn_vals)
            arrays = iter(outs)
        if (inner_gradient is not None and not collecting()
                and not _maybe_differentiated(dyn_vals)):
            _warn_inner_gradient(f)
        t, static = out_tree[0]  # leaves that are not arrays are returned as f gave them
        return jax.tree_util.tree_unflatten(
            t, [next(arrays) if o is None else o for o in static])

    def _report(*args, **kwargs) -> Report:
        # only arrays are abstract (a Python bool stays a bool); a fresh function each
        # time, so no trace cache may skip the recording
        dyn_vals, call = _array_leaves(wrapped, args, kwargs)
        with collect() as rows:
            jax.eval_shape(lambda *d: call(d), *dyn_vals)
        return Report(tuple(rows))

    wrapped.report = _report
    wrapped.options = options
    wrapped.__jaxmem_transform__ = (f, options)
    return wrapped


_warned_inner_gradient: set = set()


def _maybe_differentiated(vals) -> bool:
    """Whether an argument may carry an outer differentiation (a tracer other than jit's /
    make_jaxpr's: ``grad``, ``jvp``, and, to stay quiet where unsure, ``vmap`` and others)."""
    return any(isinstance(v, core.Tracer) and type(v).__name__ != "DynamicJaxprTracer"
               for v in vals)


def _warn_inner_gradient(f: Callable) -> None:
    """:class:`GradientInsideWarning` (once per function) for an ``f`` that differentiates
    inside while the transformed function is not itself being differentiated."""
    name = getattr(f, "__qualname__", type(f).__name__)
    key = (name, id(f))   # per function object: two lambdas are two functions
    if key in _warned_inner_gradient:
        return
    import warnings

    _warned_inner_gradient.add(key)
    warnings.warn(GradientInsideWarning(f"jaxmem.transform({name}): {INNER_GRADIENT}"),
                  stacklevel=3)


def report(f: Callable, *args: Any, **kwargs: Any) -> Report:
    """What :func:`transform` converts in ``f`` for these arguments (one trace, nothing
    computed).  ``f`` may be a transformed function (its options are used) or a plain one
    (default options)."""
    if not callable(f):
        raise TypeError(f"report: f must be a callable, got {type(f).__name__}")
    g = f if hasattr(f, "__jaxmem_transform__") else transform(f)
    return g.report(*args, **kwargs)
