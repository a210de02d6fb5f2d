"""A ``jit`` with its own shardings or donation, called inside the transformed function, is
inlined: its body is converted, its shardings stay as sharding constraints on the body's
inputs and outputs, and values and gradients equal the untouched function's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _util import close
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem


def _mesh():
    devs = jax.devices("cpu")
    n = 2 if len(devs) >= 2 else 1
    return Mesh(np.array(devs[:n]), ("data",)), n


def _loss(mesh):
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def block(w, x):
        return jax.nn.gelu(x @ w) * 1.5

    inner = jax.jit(block, in_shardings=(rep, rows), out_shardings=rows, donate_argnums=1)

    def loss(w, x):
        return jnp.sum(jnp.square(inner(w, jnp.tanh(x))))

    return loss


def test_sharded_jit_inlined_converted_and_exact():
    mesh, n = _mesh()
    kw, kx = jax.random.split(jax.random.key(3))
    w = jax.random.normal(kw, (16, 32)) / 4
    x = jax.random.normal(kx, (8 * n, 16)) + 0.2
    f = _loss(mesh)
    g = jaxmem.transform(f)
    close(jax.jit(jax.value_and_grad(g, (0, 1)))(w, x),
          jax.jit(jax.value_and_grad(f, (0, 1)))(w, x), atol=1e-6)

    rep = g.report(w, x)
    assert not [r for r in rep.by_kind("higher-order") if not r.converted], rep.table()
    gelu = [r for r in rep.by_kind("activation") if r.converted]
    assert gelu and any("block" in r.where for r in gelu), rep.table()
    # the shardings are kept: the lowered step constrains the block's input and output
    text = jax.jit(jax.grad(g)).lower(w, x).as_text()
    # (Shardy's sdy.sharding_constraint, or GSPMD's @Sharding custom call)
    assert text.count("sharding_constraint") + text.count("@Sharding") >= 2, text[:3000]


def test_transform_of_a_donating_jit_converts_its_body():
    """``jaxmem.transform(jax.jit(loss, donate_argnums=1))``: the loss's GELU is converted."""
    def loss(w, x):
        return jnp.sum(jax.nn.gelu(x @ w) ** 2)

    kw, kx = jax.random.split(jax.random.key(5))
    w, x = jax.random.normal(kw, (8, 16)) / 3, jax.random.normal(kx, (4, 8))
    want = jax.grad(loss)(w, x)
    g = jaxmem.transform(jax.jit(loss, donate_argnums=1))
    got = jax.jit(jax.grad(g))(w, x)  # the nested jit donates nothing: x stays valid
    close(got, want, atol=1e-6)
    assert not x.is_deleted()
    rep = g.report(w, x)
    assert [r for r in rep.converted() if r.kind == "activation"], rep.table()
    assert not [r for r in rep.by_kind("higher-order") if not r.converted], rep.table()
