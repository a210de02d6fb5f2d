"""Primitives shared by the parts of jaxmem (internal; no public API).

Each primitive has one home here and the parts import it (imports only go downward: this
package imports jax and numpy, never a part):

- :mod:`jaxmem._prims.checks`  — argument checks (bit widths, ints, int tuples), no jax.
- :mod:`jaxmem._prims.bitpack` — dense ``b``-bit packing of integer codes into ``uint8``.
- :mod:`jaxmem._prims.codes`   — compare-and-sum bin codes ``c = sum_i [x >= s_i]``.
- :mod:`jaxmem._prims.mask`    — exact piecewise-linear activations with a 1-bit mask
  residual (relu, relu6, hard_tanh, leaky_relu and the generic :func:`~mask.mask_op`).
- :mod:`jaxmem._prims.tree`    — depth-first walk of branch/shortcut node trees.
- :mod:`jaxmem._prims.recipes` — values a backward rule may recompute from residuals
  that their producer keeps (norm outputs, and mask activations of them).

Submodules are imported explicitly (``from jaxmem._prims.bitpack import pack``); this
package imports nothing itself, so :mod:`~jaxmem._prims.checks` stays free of jax.
"""
