"""Losses computed in pieces, so that the step never holds a whole large intermediate.

:func:`chunked_softmax_cross_entropy`: the language-model head and its cross-entropy,
``logsumexp(h W + b) - (h W + b)[label]`` per token, computed a chunk of tokens at a time;
the ``tokens x vocab`` logits exist one chunk at a time in the forward and the backward pass.
:func:`jaxmem.losses.row_chunks.map_row_chunks` is the chunking itself (any row-wise function
of ``N`` rows, a chunk at a time under ``jax.checkpoint``), which ``jaxmem.transform`` also
uses for the heads it finds in a loss as written (``logits_chunk``).
"""
from jaxmem.losses.chunked_cross_entropy import chunked_softmax_cross_entropy

__all__ = ["chunked_softmax_cross_entropy"]
