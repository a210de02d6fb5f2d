"""Losses computed in pieces, so that the step never holds a whole large intermediate.

:func:`chunked_softmax_cross_entropy`: the language-model head and its cross-entropy,
``logsumexp(h W + b) - (h W + b)[label]`` per token, computed a chunk of tokens at a time;
the ``tokens x vocab`` logits exist one chunk at a time in the forward and the backward pass.
"""
from jaxmem.losses.chunked_cross_entropy import chunked_softmax_cross_entropy

__all__ = ["chunked_softmax_cross_entropy"]
