"""Random parameters of a ``jaxmem.rowconv`` stack for the tests (not a test module)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import rowconv as rc


def random_params(layers, shape, seed=0, dtype=jnp.float32, *, noise=0.2, positive_var=True):
    """Parameters distributed as ``rc.init``'s plus a N(0, ``noise``^2) perturbation, so
    biases / BN stats / scales are not trivial: kernels N(0, 1/fan_in), scales 1, biases and
    means 0; BN variances (``positive_var``) around 1, then ``|v| + 0.5`` (positive), else
    around 0 like the other leaves.

    The tree (names, shapes, dtypes) is ``rc.init``'s, traced abstractly; the values are drawn
    with NumPy and put on the device, so no program is compiled per parameter shape."""
    tree = jax.eval_shape(lambda: rc.init(layers, jax.random.PRNGKey(seed), shape, dtype))
    rng = np.random.default_rng(seed)
    ones = ("scale", "var") if positive_var else ("scale",)

    def leaf(path, s):
        name = path[-1].key
        if name == "kernel":
            base = rng.normal(size=s.shape) / math.sqrt(math.prod(s.shape[:-1]))
        else:
            base = np.full(s.shape, 1.0 if name in ones else 0.0)
        v = base + noise * rng.normal(size=s.shape)
        if positive_var and name == "var":
            v = np.abs(v) + 0.5
        return jnp.asarray(np.asarray(v, s.dtype))

    return jax.tree_util.tree_map_with_path(leaf, tree)
