"""Recipes across a residual add, on the H100 plan, every parameter trained.

An identity block ``relu(bn(conv(relu(bn(conv(x))))) + x)``: its output is what the next
block's first convolution reads for its kernel gradient. Recorded as an elementwise function
of the arrays the norms keep (``jaxmem._prims.recipes.combine``, down the chain of blocks to
the stem's norm), that convolution recomputes it in the backward pass instead of keeping it:
one f32 array less per block, so a block keeps its two norm inputs and two 1-bit masks
(8.25 B per element, plus its parameters' gradients) where it kept 12.25."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gp_util import plan, rand
from jax import lax

import jaxmem.selective as S
from jaxmem._prims import recipes
from jaxmem.measure import slope

SHAPE = (8, 32, 32, 16)
C = SHAPE[-1]
E = int(np.prod(SHAPE))
#: one block's gradient outputs (two 3x3 kernels, two scales and biases), B per element
PARAMS = 2 * (3 * 3 * C * C + 2 * C) * 4 / E


def _unit(x, w, s, b):
    return S.batch_norm(S.conv(x, w), s, b, train=True)[0]


def _params(blocks):
    return {"stem": (rand(1, (3, 3, 3, C), 0.3), jnp.ones((C,)), jnp.zeros((C,))),
            "blocks": [[(rand(10 + 2 * i + j, (3, 3, C, C), 0.2), jnp.ones((C,)),
                         jnp.zeros((C,))) for j in range(2)] for i in range(blocks)]}


def _loss(record: bool):
    def loss(ps, inp):
        x = S.relu(_unit(inp, *ps["stem"]))
        for p in ps["blocks"]:
            y = _unit(S.relu(_unit(x, *p[0])), *p[1])
            z = y + x
            if record:  # as jaxmem.transform records an add of two recorded values
                recipes.combine(z, lax.add, y, x)
            x = S.relu(z)
        return jnp.sum(x * x)
    return loss


@pytest.fixture(scope="module")
def block_slopes():
    """temp + output bytes per element per added block, with and without the recipe."""
    inp = rand(0, SHAPE[:-1] + (3,))
    out = {}
    for record in (False, True):
        def measure(d, record=record):
            c = plan(jax.grad(_loss(record)), _params(d), inp)
            return c.temp_bytes + c.output_bytes
        out[record] = slope(measure, 2) / E
    return out


def test_block_output_is_not_kept(block_slopes):
    assert block_slopes[False] - block_slopes[True] >= 3.5, block_slopes


def test_block_keeps_its_norm_inputs_and_masks(block_slopes):
    assert block_slopes[True] <= 2 * 4 + 2 / 8 + PARAMS + 0.1, block_slopes
