"""Options of :func:`jaxmem.transform` (validated once, hashable)."""
from __future__ import annotations

import dataclasses

__all__ = ["SWITCHES", "Options"]

#: the conversions :class:`Options` turns on or off (``True`` / ``False`` fields)
SWITCHES = ("attention", "products", "activations", "norms", "dropout", "pools",
            "residual_adds", "conv_recompute", "biases", "projections", "gated_products",
            "scaled_products", "computed_weights")


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`jaxmem.transform` converts.

    fewbit: ``None`` (smooth activations stay exact) or ``1..4`` (bits of their code).
    attention: re-emit attention subgraphs with the exact memory-lean attention.
    products: re-emit ``dot_general`` / convolutions with the selective bilinear ops.
    activations: re-emit elementwise activation subgraphs (masks; codes with ``fewbit``).
    norms: re-emit normalisation subgraphs (layer / RMS / batch / group norm) with the
      selective normalisation.
    dropout: re-emit dropout (``where(bernoulli(key), x / keep, 0)``) with the selective
      dropout (the mask regenerated from the key).
    pools: re-emit max pools (``reduce_window`` max) with the selective max pool (argmax
      codes kept instead of the input).
    residual_adds: with ``products``, ``a + b`` of two values that selective ops can
      recompute (a ResNet block's ``bn3(c3) + shortcut``) is recomputable too, so the next
      product recomputes its input instead of keeping it.
    conv_recompute: with ``products`` and ``norms``, a normalisation of a 1x1, stride-1
      convolution of another normalisation's (activated) output keeps that norm's residuals
      and the kernel instead of its own input, and recomputes the convolution in its backward
      pass (a ResNet bottleneck's 4x-wide expansion).
    biases: with ``products``, re-emit the bias adds of products with
      :func:`jaxmem.selective.bias_add` (the bias gradient formed where the cotangent
      arrives: XLA:GPU keeps no output cotangent until the optimizer update).
    projections: with ``products``, ``norms`` and ``attention``, an attention whose queries,
      keys and values are dense projections of a normalisation's output (``LN(x) W + b``,
      reshaped, split, transposed, scaled by constants) keeps that norm's residuals and the
      weights instead of ``q, k, v`` and recomputes the projections in its backward pass
      (only where that needs no collective: whole weights, or a tensor parallel step's
      column split, not after a split of a fused projection there -- unless the step is
      made with ``repeat_collectives=True``).
    gated_products: with ``products``, an elementwise product ``a * b`` whose factor is the
      output of a re-emitted activation or norm (a gated linear unit's ``act(x W) * (x V)``,
      ``x * sigmoid(x)``) keeps that producer's residuals instead of the factor, and the
      product after it recomputes ``a * b`` from them (:func:`jaxmem.selective.gated_product`).
    scaled_products: with ``products``, a product's output scaled by a parameter (a layer
      scale ``gamma * (x W + b)``) is materialised once before the ``mul``
      (``optimization_barrier`` off CPU): XLA:GPU then keeps that output for the factor's
      gradient instead of the partial sums of a split-K GEMM (:mod:`~jaxmem.transform.scaled`).
    computed_weights: with ``products``, a dense product's weight computed from the
      function's inputs by a few parameter-sized ops (a merged LoRA weight ``W + A B``, a
      cast ``W.astype(bfloat16)``) keeps those inputs instead and is recomputed in the
      backward pass (:mod:`~jaxmem.transform.match_dot`).
    attention_chunk: ``None`` or query rows per chunk (an int >= 1) of a re-emitted attention
      core with more query rows than that: both passes run that many rows at a time
      (:mod:`jaxmem.selective.attention_chunks`).
    mlp_chunk: ``None`` or rows per chunk (an int >= 1) of a two-layer perceptron
      ``f(x W1 + b1) W2`` with more rows than that: it keeps ``x`` and the weights, runs both
      passes that many rows at a time and recomputes ``x W1`` in its backward pass
      (:mod:`~jaxmem.transform.match_mlp`).
    logits_chunk: ``None`` or rows per chunk (an int >= 1) of a language-model head: a
      product ``h W`` with more columns than ``h`` has, reduced within each row to per-token
      values by a softmax-like loss, computed that many rows at a time
      (:mod:`~jaxmem.transform.match_logits`).
    """

    fewbit: int | None = None
    attention: bool = True
    products: bool = True
    activations: bool = True
    norms: bool = True
    dropout: bool = True
    pools: bool = True
    residual_adds: bool = True
    conv_recompute: bool = True
    biases: bool = True
    projections: bool = True
    gated_products: bool = True
    scaled_products: bool = True
    computed_weights: bool = True
    attention_chunk: int | None = 512
    logits_chunk: int | None = 1024
    mlp_chunk: int | None = None

    def __post_init__(self):
        fb = self.fewbit
        if fb is not None and (isinstance(fb, bool) or not isinstance(fb, int)
                               or not 1 <= fb <= 4):
            raise ValueError(f"transform: fewbit must be None or an int in 1..4, got {fb!r}")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"transform: {name} must be True or False, got "
                                f"{getattr(self, name)!r}")
        for name in ("attention_chunk", "logits_chunk", "mlp_chunk"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"transform: {name} must be None or an int >= 1 (rows per "
                                 f"chunk), got {n!r}")
