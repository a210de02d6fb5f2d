"""The LM head's softmax cross-entropy, a chunk of tokens at a time.

For features ``h`` (``N x d`` once the leading axes are flattened), a projection ``W``
(``d x V``), an optional bias ``b`` and integer labels ``y``, the per-token loss is

    l_i = logsumexp_v(z_i) - z_{i, y_i},   z_i = h_i W + b,

as ``optax.softmax_cross_entropy_with_integer_labels(h @ W + b, y)`` computes it. Written
that way, a training step holds ``N x V`` arrays at once (the logits or the softmax kept for
the backward pass, and their cotangent: two at the peak of a GPT-2-style head on XLA:GPU's
plan and on XLA:CPU's). Here the tokens are split into chunks of ``chunk_size``; each chunk's
logits are formed, reduced to its ``chunk_size`` losses (optax's function on the chunk) and
dropped, under ``jax.checkpoint`` inside ``lax.scan``: the backward pass forms them again,
chunk by chunk (``dl/dz_i = softmax(z_i) - onehot(y_i)``, times the loss's cotangent), and
accumulates ``dW``, ``db`` over chunks. Every token's loss
and every gradient is the same sum as the unchunked head's, in another summation order over
chunks for ``dW`` and ``db`` (float32: within ``1e-5`` relative); the head's matmul runs
twice (forward, and again in the backward pass): ``2 N d V`` FLOPs more per step.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from jaxmem.losses.row_chunks import map_row_chunks

__all__ = ["chunked_softmax_cross_entropy"]


def _token_losses(h, w, b, y):
    """optax's ``logsumexp(z) - z[y]`` per row of one chunk's logits ``z = h w (+ b)``."""
    z = jnp.matmul(h, w)
    return optax.softmax_cross_entropy_with_integer_labels(z if b is None else z + b, y)


def _chunk_losses(rows, shared):
    """One chunk's losses (:func:`map_row_chunks`'s ``fn``)."""
    (h, y), (w, b) = rows, shared
    return (_token_losses(h, w, b, y),)


def _check(features, weight, labels, bias, chunk_size):
    who = "chunked_softmax_cross_entropy"
    for name, a in (("features", features), ("weight", weight), ("labels", labels)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{who}: `{name}` must be an array, got {type(a).__name__}")
    if features.ndim < 1 or not jnp.issubdtype(features.dtype, jnp.floating):
        raise TypeError(f"{who}: `features` must be a floating array (..., d), got "
                        f"{features.dtype} of shape {tuple(features.shape)}")
    if weight.ndim != 2 or not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"{who}: `weight` must be a floating (d, vocab) array, got "
                        f"{weight.dtype} of shape {tuple(weight.shape)}")
    if weight.shape[0] != features.shape[-1]:
        raise ValueError(f"{who}: `weight` {tuple(weight.shape)} must be (d, vocab) with d = "
                         f"features.shape[-1] = {features.shape[-1]} (a tied embedding "
                         f"(vocab, d) is passed as `embedding.T`)")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{who}: `labels` must be integers, got {labels.dtype}")
    if tuple(labels.shape) != tuple(features.shape[:-1]):
        raise ValueError(f"{who}: `labels` must have shape features.shape[:-1] = "
                         f"{tuple(features.shape[:-1])}, got {tuple(labels.shape)}")
    if bias is not None and (not hasattr(bias, "shape")
                             or tuple(bias.shape) != (weight.shape[1],)):
        raise ValueError(f"{who}: `bias` must have shape (vocab,) = ({weight.shape[1]},), got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
            or chunk_size < 1:
        raise ValueError(f"{who}: `chunk_size` must be an int >= 1 (tokens per chunk), got "
                         f"{chunk_size!r}")


def chunked_softmax_cross_entropy(features, weight, labels, *, bias=None,
                                  chunk_size: int = 1024):
    """Per-token softmax cross-entropy of ``features @ weight (+ bias)`` against ``labels``,
    computed ``chunk_size`` tokens at a time (module docstring: the math).

    Equals ``optax.softmax_cross_entropy_with_integer_labels(features @ weight + bias,
    labels)`` in value and in its gradients w.r.t. ``features``, ``weight`` and ``bias``,
    without a ``tokens x vocab`` array alive in the step: at most one chunk's logits and
    their cotangent (``chunk_size x vocab``) exist at a time.

    Args:
      features: floating ``(..., d)``: the hidden states the head reads (after the final
        norm).
      weight: floating ``(d, vocab)``: the head's kernel (``nn.Dense``); for a head tied to a
        ``(vocab, d)`` embedding (``nn.Embed.attend``) pass ``embedding.T``.
      labels: integer ``features.shape[:-1]``: the target class of each token.
      bias: optional ``(vocab,)``.
      chunk_size: tokens per chunk (an int >= 1; the last chunk takes the remainder). Each
        chunk keeps ``chunk_size x vocab`` logits alive while it runs; smaller chunks run
        more, smaller matmuls.

    Returns:
      The per-token losses, shape ``features.shape[:-1]``, in the logits' dtype (take
      ``.mean()`` for the usual loss). Under ``jit``, ``grad``, ``vmap``, ``lax.scan`` and
      ``jax.checkpoint`` it is the function above; bf16/f16 inputs compute as optax does
      in that dtype.

    Raises:
      TypeError / ValueError: non-floating features or weight, non-integer labels, shapes
        that do not fit ``(..., d)``, ``(d, vocab)``, ``(...)``, ``(vocab,)``, or a
        ``chunk_size`` that is not an int >= 1.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxmem.losses import chunked_softmax_cross_entropy
      >>> h = jax.random.normal(jax.random.key(0), (2, 10, 8))
      >>> w = jax.random.normal(jax.random.key(1), (8, 32))
      >>> y = jax.random.randint(jax.random.key(2), (2, 10), 0, 32)
      >>> l = chunked_softmax_cross_entropy(h, w, y, chunk_size=4)
      >>> l.shape
      (2, 10)
      >>> ref = optax.softmax_cross_entropy_with_integer_labels(h @ w, y)
      >>> bool(jnp.allclose(l, ref, rtol=1e-5, atol=1e-5))
      True
    """
    _check(features, weight, labels, bias, chunk_size)
    lead = tuple(features.shape[:-1])
    d = features.shape[-1]
    n = int(np.prod(lead, dtype=np.int64))
    h = features.reshape(n, d)
    y = labels.reshape(n)
    out_dtype = jnp.result_type(features.dtype, weight.dtype,
                                *(() if bias is None else (bias.dtype,)))
    if n == 0:
        return jnp.zeros(lead, out_dtype)
    (losses,) = map_row_chunks(_chunk_losses, (h, y), (weight, bias), chunk_size)
    return losses.astype(out_dtype).reshape(lead)
