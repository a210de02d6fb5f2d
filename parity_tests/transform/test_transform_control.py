"""jaxmem.transform enters scan / cond / switch / while / checkpoint bodies and is exact
inside the caller's scan and checkpoint, in float32, bfloat16, float16 and float64."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal
from _util import mlp_loss as _mlp
from _util import mlp_params as _params


def _control_flow(w, x):
    def body(c, xi):
        h = jax.nn.relu(c @ w) + xi
        return h, jnp.tanh(h).sum()

    c, ys = lax.scan(body, x[0], x)
    c = jax.checkpoint(lambda c: jax.nn.gelu(c @ w))(c)
    c = lax.cond(c[0] > 0, lambda c: jax.nn.relu(c) * 2.0, lambda c: jnp.sin(c @ w), c)
    c = lax.switch(1, [jnp.sin, lambda c: jax.nn.leaky_relu(c @ w), jnp.cos], c)
    return jnp.sum(c ** 2) + ys.sum()


def test_scan_cond_switch_checkpoint_are_entered_and_exact():
    w, x = normal((6, 6), scale=0.5), normal((4, 6))
    g = transform(_control_flow)
    # values and gradients of both sides: one compiled program
    (vg, gg), (vf, gf) = jax.jit(lambda *a: tuple(
        (fn(*a), jax.grad(fn, (0, 1))(*a)) for fn in (g, _control_flow)))(w, x)
    close(vg, vf, rtol=1e-6)
    close(gg, gf)
    rows = g.report(w, x)
    entered = {r.matched for r in rows.by_kind("higher-order") if r.converted}
    assert {"scan", "remat2", "cond"} <= entered
    paths = {r.path for r in rows.by_kind("dot")}
    assert {"scan", "remat2", "cond[0]", "cond[1]"} <= paths


def test_while_loop_is_entered():
    w, x = normal((5, 5), scale=0.5), normal((5,))

    def f(w, x):
        return lax.while_loop(lambda s: s[1] < 3, lambda s: (jax.nn.relu(s[0] @ w), s[1] + 1),
                              (x, 0))[0]

    g = transform(f)
    close(*jax.jit(lambda *a: (g(*a), f(*a)))(w, x), rtol=1e-6)
    assert any(r.path == "while" and r.converted for r in g.report(w, x).by_kind("dot"))


def test_inside_scan_and_checkpoint_of_the_caller():
    p, xs = _params(), normal((3, 2, 8))
    g = transform(_mlp)

    def total(fn, p, xs):
        return lax.scan(lambda c, x: (c + jax.checkpoint(fn)(p, x), None), 0.0, xs)[0]

    close(*jax.jit(lambda p: (jax.grad(lambda p: total(g, p, xs))(p),
                              jax.grad(lambda p: total(_mlp, p, xs))(p)))(p))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_matches_the_original(dtype):
    p, x = _params(dtype), normal((5, 8), dtype)
    g = transform(_mlp)
    got, want = jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(_mlp)(*a)))(p, x)
    assert jax.tree_util.tree_map(lambda a: a.dtype, got) == jax.tree_util.tree_map(
        lambda a: a.dtype, want)
    close(got, want, rtol=2e-2, atol=2e-2)


def test_float64_is_exact():
    with jax.enable_x64(True):
        p, x = _params(jnp.float64), normal((5, 8), jnp.float64)
        close(*jax.jit(lambda *a: (jax.grad(transform(_mlp))(*a), jax.grad(_mlp)(*a)))(p, x),
              rtol=1e-12, atol=1e-13)


