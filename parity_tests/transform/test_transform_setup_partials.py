"""Activations chosen in ``setup()`` from a dict of ``functools.partial``s built at import
time (how model zoos bind them) are converted and reported by what they compute."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxmem

#: built at import time, before jaxmem converts anything
ACTS = {"gelu_new": functools.partial(jax.nn.gelu, approximate=True),
        "silu": jax.nn.silu, "relu": nn.relu}


class Block(nn.Module):
    act: str

    def setup(self):
        self.up = nn.Dense(32)
        self.down = nn.Dense(8)
        self.act_fn = ACTS[self.act]

    def __call__(self, x):
        return x + self.down(self.act_fn(self.up(x)))


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_setup_partials_converted_exactly_and_reported():
    x = _x(0, (4, 8))
    for name in ACTS:
        model = Block(name)
        params = model.init(jax.random.key(1), x)

        def loss(p, model=model):
            return jnp.sum(jnp.sin(model.apply(p, x)))

        got = jax.jit(jax.grad(jaxmem.transform(loss)))(params)
        want = jax.jit(jax.grad(loss))(params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     got, want)
        rep = jaxmem.report(jaxmem.transform(loss), params)
        acts = [e for e in rep.by_kind("activation") if e.status != "nothing-to-save"]
        assert [e.status for e in acts] == ["converted"], (name, str(rep))  # not the sin
        assert "test_transform_setup_partials.py" in acts[0].where
        assert [e.path for e in rep.by_kind("dot")] == ["up", "down"], str(rep)
        # the untouched loss: the same decisions, reported as not made
        assert [e.status for e in jaxmem.report(loss, params).by_kind("activation")
                if e.status != "nothing-to-save"] == ["fallback"]


def test_setup_partials_get_codes_under_fewbit():
    x = _x(2, (4, 8))
    model = Block("silu")
    params = model.init(jax.random.key(3), x)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)))
    conv = jaxmem.linen.convert(model, selective=False, fewbit=2)
    rep = jaxmem.report(lambda p: jnp.sum(jnp.sin(conv.apply(p, x))), params)
    acts = [e for e in rep.by_kind("activation") if e.status != "nothing-to-save"]
    assert [(e.status, e.technique) for e in acts] == [("converted", "fewbit")], str(rep)
    g = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(conv.apply(p, x)))))(params)
    g0 = jax.jit(jax.grad(loss))(params)
    assert not np.allclose(g["params"]["up"]["kernel"], g0["params"]["up"]["kernel"])
