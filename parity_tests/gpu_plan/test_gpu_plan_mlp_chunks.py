"""A transformer MLP recomputed under ``jax.checkpoint`` forms ``(rows, F)`` blocks instead of
``(R, F)`` arrays on the H100 plan when run as :func:`jaxmem.selective.chunked_mlp`
(``transform(..., mlp_chunk=rows)``): XLA:GPU neither hoists the chunks' recomputation out of
the scan nor keeps a whole hidden activation. ``R = 4096`` rows, ``F = 1024``: 16 MiB per
hidden array; measured whole 42.0 MiB -> chunked 12.5 MiB of temp (CPU: 50.0 -> 14.5)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _gp_util import TARGET

import jaxmem
from jaxmem.measure import compiled_memory


class _Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(1024)(nn.LayerNorm()(x)))
        return x + nn.Dense(128)(h)


@pytest.mark.parametrize("target", [TARGET, "cpu"])
def test_recomputed_mlp_forms_row_blocks(target):
    block = _Wide()
    x = jax.ShapeDtypeStruct((4, 1024, 128), jnp.float32)
    v = jax.eval_shape(block.init, jax.random.key(0), x)

    def temp(**kw):
        f = jaxmem.transform(lambda v, x: jnp.sum(block.apply(v, x) ** 2), **kw)
        return compiled_memory(jax.grad(jax.checkpoint(f)), v, x, target=target).temp_bytes

    hidden = 4 * 1024 * 1024 * 4
    whole, chunked = temp(), temp(mlp_chunk=512)
    assert whole >= 2 * hidden, whole / 2**20
    assert chunked <= whole - hidden - hidden // 2, (chunked / 2**20, whole / 2**20)
