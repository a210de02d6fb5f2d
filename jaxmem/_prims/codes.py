"""Compare-and-sum bin codes: ``c = sum_i [float32(x) >= s_i]`` (of ``|x|`` if symmetric).

For ascending borders ``s_0 <= ... <= s_{k-1}`` the code is the index of the bin of ``x``:
``c = 0`` below ``s_0``, ``c = i`` on ``[s_{i-1}, s_i)``, ``c = k`` from ``s_{k-1}`` on; a
``uint8`` in ``0 .. k``.  ``NaN`` compares false everywhere (code 0), ``+inf`` gets the top
code and ``-inf`` code 0 (``|±inf|`` the top code when symmetric).

The code is a sum of elementwise compares, one per border, so XLA fuses it into its consumer
(the packing reduction of :mod:`jaxmem._prims.bitpack`) without float temporaries.
``jnp.searchsorted`` is not used: in XLA:CPU it kept float32 temporaries of the input alive.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bin_codes", "check_borders"]


def check_borders(borders) -> np.ndarray:
    """``borders`` as a float32 vector, finite and ascending, at most 255 long (uint8 codes),
    else ``ValueError``."""
    with np.errstate(over="ignore"):
        b = np.asarray(borders, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(b)) or np.any(np.diff(b) < 0):
        raise ValueError(f"borders must be finite (in float32) and sorted ascending, got "
                         f"{np.asarray(borders).tolist()!r}")
    if b.size > 255:
        raise ValueError(f"at most 255 borders fit a uint8 code, got {b.size}")
    return b


def bin_codes(x: jax.Array, borders, *, symmetric: bool = False) -> jax.Array:
    """Bin index ``sum_i [float32(x) >= borders_i]`` of every element of ``x``, ``uint8``.

    ``x`` must be floating (float32, bfloat16, float16, float64); ``borders`` finite in
    float32 and ascending (see :func:`check_borders`).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array (float32, bfloat16, float16), got {x.dtype}")
    b = check_borders(borders)
    xf = x.astype(jnp.float32)
    if symmetric:
        xf = jnp.abs(xf)
    c = jnp.zeros(x.shape, jnp.uint8)
    for v in b:
        c = c + (xf >= v).astype(jnp.uint8)
    return c
