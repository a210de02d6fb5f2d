"""``jaxmem.transform(..., mlp_chunk=rows)`` and the Flax conversions' ``mlp_chunk``: a
transformer MLP ``f(x W1 + b1) W2`` is re-emitted as :func:`jaxmem.selective.chunked_mlp`
(report row ``mlp``) with the untouched gradients, also behind a layer boundary tag; what it
must not take (a ReLU MLP, a hidden activation read elsewhere, too few rows) stays; the
option is part of what ``jit`` caches on; bad values are refused. Bytes:
``parity_tests/gpu_plan/test_gpu_plan_mlp_chunks.py`` (H100 plan and CPU)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _util import close, normal

import jaxmem
from jaxmem.models import gpt


class _Block(nn.Module):
    act: object = nn.gelu
    bias: bool = True
    leak: bool = False

    @nn.compact
    def __call__(self, x):
        h = self.act(nn.Dense(64, use_bias=self.bias)(nn.LayerNorm()(x)))
        y = x + nn.Dense(16, use_bias=self.bias)(h)
        return y + jnp.mean(h) if self.leak else y


def _setup(block, lead=(4, 50)):
    x = normal((*lead, 16))
    v = block.init(jax.random.key(0), x)
    return (lambda v, x: jnp.sum(jnp.tanh(block.apply(v, x)) * x)), v, x


def _kinds(fn, *args):
    return [r.kind for r in fn.report(*args).rows if r.converted]


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matched_and_exact(bias):
    loss, v, x = _setup(_Block(bias=bias))
    t = jaxmem.transform(loss, mlp_chunk=48)   # 200 rows: four chunks and a remainder of 8
    assert _kinds(t, v, x).count("mlp") == 1
    assert "mlp" not in _kinds(jaxmem.transform(loss), v, x)
    (l0, g0), (l1, g1) = [jax.jit(jax.value_and_grad(f))(v, x) for f in (loss, t)]
    close(l1, l0, rtol=1e-6)
    close(g1, g0)


@pytest.mark.parametrize("block, why", [
    (_Block(act=nn.relu), "relu"),          # a 1-bit mask keeps less than the chunked input
    (_Block(leak=True), "hidden read"),     # the hidden activation is read outside the MLP
])
def test_not_matched(block, why):
    loss, v, x = _setup(block)
    t = jaxmem.transform(loss, mlp_chunk=48)
    assert "mlp" not in _kinds(t, v, x), why
    close(jax.jit(jax.grad(t))(v, x), jax.jit(jax.grad(loss))(v, x))


def test_too_few_rows_left_whole():
    loss, v, x = _setup(_Block(), lead=(2, 10))
    assert "mlp" not in _kinds(jaxmem.transform(loss, mlp_chunk=48), v, x)


def test_gpt_blocks_under_convert_and_jit_key():
    m = gpt(n_layer=2, d_model=64, n_head=4, ctx=32)
    tok = jax.random.randint(jax.random.key(3), (4, 32), 0, 256)
    v = m.init(jax.random.key(1), tok)

    def loss_of(model):
        return lambda v, tok: -jnp.mean(jax.nn.log_softmax(model.apply(v, tok))[..., 0])

    conv = jaxmem.linen.convert(m, mlp_chunk=32)
    g0 = jax.jit(jax.grad(loss_of(m)))(v, tok)
    close(jax.jit(jax.grad(loss_of(conv)))(v, tok), g0)
    rows = jaxmem.report(loss_of(conv), v, tok).by_kind("mlp")
    assert len(rows) == 2 and all("32 of 128 rows" in e.reason and e.technique == "chunked"
                                  for e in rows)
    plain = jaxmem.linen.convert(m, attention_chunk=None)
    chunked = jaxmem.linen.convert(m, attention_chunk=None, mlp_chunk=32)
    ja = jax.jit(jax.grad(loss_of(plain))).lower(v, tok).as_text()
    jb = jax.jit(jax.grad(loss_of(chunked))).lower(v, tok).as_text()
    assert "while" not in ja and "while" in jb   # the MLPs' backward chunks run as a scan


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64"])
def test_bad_mlp_chunk(bad):
    with pytest.raises(ValueError, match="mlp_chunk must be None or an int >= 1"):
        jaxmem.transform(lambda x: x, mlp_chunk=bad)
    with pytest.raises(ValueError, match="mlp_chunk must be None or an int >= 1"):
        jaxmem.linen.convert(_Block(), mlp_chunk=bad)
    with pytest.raises(ValueError, match="mlp_chunk must be None or an int >= 1"):
        jaxmem.plan(lambda p: jnp.sum(p), jnp.ones(3), budget=1.0, mlp_chunk=bad)


def test_nnx_convert_mlp_chunk_exact():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x)))

    x = normal((3, 40, 16))
    m = Mlp(nnx.Rngs(0))

    def loss(mod, x):
        return jnp.sum(jnp.sin(mod(x)))

    conv = jaxmem.nnx.convert(m, mlp_chunk=16)
    g0 = nnx.grad(loss)(m, x)
    g1 = nnx.grad(loss)(conv, x)
    close(nnx.state(g1, nnx.Param), nnx.state(g0, nnx.Param))
    assert [e.kind for e in jaxmem.report(lambda x: loss(conv, x), x).by_kind("mlp")] == ["mlp"]
