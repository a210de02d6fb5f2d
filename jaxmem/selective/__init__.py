"""jaxmem.selective -- store for backward only what the *requested* gradients need.

From "Lowering PyTorch's Memory Consumption for Selective Differentiation" (Bhatia & Dangel),
brought to JAX. Functional core (each a ``jax.custom_vjp`` with ``symbolic_zeros=True`` that
saves residuals according to which inputs are perturbed):

* :func:`dense`, :func:`conv`, :func:`conv_transpose`, and the lax drop-ins
  :func:`dot_general`, :func:`conv_general_dilated` -- keep the input only if the weight is
  differentiated, the weight only if the input is;
* :func:`batch_norm` (train / eval), :func:`layer_norm`, :func:`group_norm`,
  :func:`rms_norm` -- keep one input-sized tensor + per-group statistics iff the input or
  scale is differentiated, nothing input-sized for a bias-only update;
* :func:`relu`, :func:`leaky_relu`, :func:`relu6`, :func:`hard_tanh` -- a 1-bit packed mask;
* :func:`smooth_activation` -- any elementwise ``f`` keeping only its input (``f'``
  recomputed; a following bilinear layer shares that input and recomputes ``f(x)``);
* :func:`gated_product` -- ``a * b`` keeping the residuals of ``a``'s producer instead of
  ``a`` (a gated linear unit's ``act(x W) * (x V)`` keeps ``x W`` and ``x V``; the down
  projection recomputes the product);
* :func:`chunked_mlp` -- a two-layer perceptron keeping its input and weights, both passes
  run a few rows at a time (:mod:`jaxmem.selective.mlp_chunks`);
* :func:`max_pool` -- the packed argmax position inside each window;
* :func:`dropout` -- only the PRNG key;
* :func:`bias_add` -- nothing kept; the bias gradient formed where the cotangent arrives
  (XLA:GPU otherwise keeps every layer's output cotangent until the optimizer update);
* :func:`attention`, :func:`attention_core` (flash-style backward, nothing ``T x S`` kept)
  and :func:`softmax` (stores its output once) -- :mod:`jaxmem.selective.attention`.

Trainable subsets: :func:`value_and_grad`, :func:`grad`, :func:`partition`,
:func:`combine`, :func:`train_step`, :func:`nnx_value_and_grad`.
Flax models and any JAX function: :func:`jaxmem.linen.convert` / :func:`jaxmem.nnx.convert`
/ :func:`jaxmem.transform` re-emit these ops where the program's jaxpr computes them; what
they leave as written is reported by :func:`jaxmem.report` with the reason. Forward-mode
``jax.jvp`` through selective primitives raises JAX's custom_vjp TypeError (reverse mode,
also grad-of-grad, works). Bit packing: :mod:`jaxmem.selective.bits`.
Every residual is tagged ``checkpoint_name(..., "jaxmem.selective.<op>.<what>")``.
"""
from jaxmem.selective._core import NAME_PREFIX
from jaxmem.selective.activation import hard_tanh, leaky_relu, relu, relu6
from jaxmem.selective.attention import attention, attention_core, softmax
from jaxmem.selective.bias import bias_add
from jaxmem.selective.bits import pack_bits, unpack_bits
from jaxmem.selective.dropout import dropout
from jaxmem.selective.gated import gated_product
from jaxmem.selective.linear import (
    bilinear,
    conv,
    conv_general_dilated,
    conv_transpose,
    dense,
    dot_general,
)
from jaxmem.selective.mlp_chunks import chunked_mlp
from jaxmem.selective.norm import batch_norm, group_norm, layer_norm, normalize, rms_norm
from jaxmem.selective.pool import max_pool
from jaxmem.selective.smooth import smooth_activation
from jaxmem.selective.subset import (
    combine,
    grad,
    nnx_value_and_grad,
    partition,
    path_str,
    train_step,
    trainable_mask,
    value_and_grad,
)

__all__ = [
    "NAME_PREFIX", "attention", "attention_core", "batch_norm", "bias_add", "bilinear", "chunked_mlp",
    "combine",
    "conv", "conv_general_dilated", "conv_transpose", "dense", "dot_general", "dropout", "gated_product", "grad",
    "group_norm", "hard_tanh", "layer_norm", "leaky_relu", "max_pool", "nnx_value_and_grad",
    "normalize", "pack_bits", "partition", "path_str", "relu", "relu6", "rms_norm",
    "smooth_activation", "softmax", "train_step", "trainable_mask", "unpack_bits",
    "value_and_grad",
]
