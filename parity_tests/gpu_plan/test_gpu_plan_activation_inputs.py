"""An exact activation's kept input is one stored array on the H100 plan, not a product's
split-K partial sums; a merged GEMM's slice is still read in place.

XLA:GPU computes a product with a small output and a contraction at least as long as its
output row (here 256 x 512 from K = 512) as split-K partial sums and fuses their reduction
into every reader of the output. The exact op (:func:`jaxmem.selective.smooth_activation`)
keeps its input ``x``; read in its backward through a scalar tie
(:func:`jaxmem._prims.ties.tie_elementwise`, a fusion the reduction joins), the partial sums
were kept instead of ``x`` (6.05 MiB against 3.05 on the MLP below). ``jaxmem.transform``
has the op read such an input tied whole (``tie_whole``; ``match_elementwise._split_k_output``),
but not an up projection's output (``K < N``) nor a slice of products that share an operand
(a gated unit's gate and up projections, which XLA:GPU merges into one GEMM: tied whole, the
slice would be copied out)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gp_util import plan, rand

import jaxmem.transform.match_elementwise as me
from jaxmem.transform import transform

B, D = 256, 512


def mlp(ws, x):
    """Six products alternating ReLU / GELU (``benchmarks/transform/bench_blocks.py``)."""
    for i, w in enumerate(ws):
        x = x @ w
        x = jax.nn.relu(x) if i % 2 == 0 else jax.nn.gelu(x)
    return jnp.mean(x ** 2)


def swiglu(ws, x):
    for w, v, o in ws:
        x = x + (jax.nn.silu(x @ w) * (x @ v)) @ o
    return jnp.mean(x ** 2)


def up_projected(ws, x):
    for w, o in ws:
        x = x + jax.nn.gelu(x @ w) @ o  # the GELU reads a d -> 4d product (K < N)
    return jnp.mean(x ** 2)


def _mlp_args():
    ws = [rand(i, (D if i else 256, D), 1 / np.sqrt(D)) for i in range(6)]
    return ws, rand(9, (B, 256))


def _scalar_ties_only(monkeypatch):
    monkeypatch.setattr(me, "_split_k_output", lambda *a, **k: False)
    me.exact_activation.cache_clear()


def test_kept_input_is_one_array_not_partial_sums(monkeypatch):
    ws, x = _mlp_args()
    on = plan(jax.grad(transform(mlp)), ws, x).temp_bytes
    _scalar_ties_only(monkeypatch)
    off = plan(jax.grad(transform(mlp)), ws, x).temp_bytes
    out = B * D * 4
    # three GELU inputs, each kept as 4 partial sums instead of one array
    assert off - on >= 4 * out, (off / 2**20, on / 2**20)
    assert on <= plan(jax.grad(mlp), ws, x).temp_bytes / 2


def test_gradients_and_cpu_plan_unchanged(monkeypatch):
    from jaxmem.measure import compiled_memory

    ws, x = _mlp_args()
    g0 = jax.grad(mlp)(ws, x)
    g1 = jax.jit(jax.grad(transform(mlp)))(ws, x)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    on = compiled_memory(jax.grad(transform(mlp)), ws, x, target="cpu").temp_bytes
    _scalar_ties_only(monkeypatch)
    off = compiled_memory(jax.grad(transform(mlp)), ws, x, target="cpu").temp_bytes
    assert on == off  # both ties are the same arithmetic on XLA:CPU


@pytest.mark.parametrize("fn, want", [(mlp, {True}), (swiglu, {False}),
                                      (up_projected, {False})])
def test_which_inputs_are_tied_whole(monkeypatch, fn, want):
    seen = []
    real = me._split_k_output

    def spy(graph, r, depth=0):
        out = real(graph, r, depth)
        if depth == 0:
            seen.append(out)
        return out

    monkeypatch.setattr(me, "_split_k_output", spy)
    if fn is mlp:
        args = _mlp_args()
    elif fn is swiglu:
        args = ([(rand(3 * i, (64, 128), 0.1), rand(3 * i + 1, (64, 128), 0.1),
                  rand(3 * i + 2, (128, 64), 0.1)) for i in range(2)], rand(7, (32, 64)))
    else:
        args = ([(rand(2 * i, (64, 256), 0.1), rand(2 * i + 1, (256, 64), 0.1))
                 for i in range(2)], rand(7, (32, 64)))
    jax.grad(transform(fn))(*args)
    assert set(seen) == want, seen
