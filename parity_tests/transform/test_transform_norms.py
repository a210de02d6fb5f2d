"""Normalisations, however spelled (Flax's LayerNorm / RMSNorm / BatchNorm / GroupNorm, a
two-pass variance, T5's RMS norm with ``/ sqrt``), become ``jaxmem.selective``'s
normalisation: outputs, gradients and (batch norm) running statistics equal the original's,
the report names the kind, axes and eps, and autodiff keeps less.  What only looks like a
normalisation (a mean held by ``stop_gradient``, a sum-normalisation) stays as it was, with
a reason."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, key, normal


def _perturbed(tree):
    """Flax's init (ones / zeros) with fresh noise, so scale and bias matter."""
    return jax.tree_util.tree_map(lambda a: a + normal(a.shape, scale=0.3), tree)


def _two_pass_ln(w, b, x, eps=1e-12):  # Hugging Face / PyTorch spelling
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def _t5(w, b, x):  # FlaxT5LayerNorm: no mean, ``/ sqrt``, weight first (no bias)
    del b
    var = jnp.power(x.astype(jnp.float32), 2).mean(-1, keepdims=True)
    return w * (x / jnp.sqrt(var + 1e-6))


FLAX = {
    "flax LayerNorm": (nn.LayerNorm(), "layer norm"),
    "flax RMSNorm": (nn.RMSNorm(epsilon=1e-5), "RMS norm"),
    "flax GroupNorm": (nn.GroupNorm(num_groups=4), "group norm (4 groups)"),
}


@pytest.mark.parametrize("name", sorted(FLAX))
def test_flax_norms_are_exact_and_keep_less(name):
    mod, kind = FLAX[name]
    x = normal((4, 6, 16), scale=2.0) + 0.5
    params = _perturbed(jax.jit(mod.init)(key(), x))

    def f(p, x):
        return jnp.sum(jnp.sin(mod.apply(p, x)) * x)

    g = transform(f)
    # one compiled program per side: value and gradients
    both = lambda fn: jax.jit(lambda p, x: (fn(p, x), jax.grad(fn, (0, 1))(p, x)))(params, x)
    (vg, gg), (vf, gf) = both(g), both(f)
    close(vg, vf)
    close(gg, gf, rtol=1e-5, atol=1e-5)
    rows = g.report(params, x).by_kind("norm")
    assert [r.converted for r in rows] == [True]
    assert rows[0].matched.startswith(kind) and "scale" in rows[0].matched
    # where the user applies the layer, not where Flax implements it
    assert "test_transform_norms.py" in rows[0].where and "normalization.py" not in rows[0].where
    assert rows[0].name_stack == type(mod).__name__
    kept = residual_bytes(g, params, x, argnums=(0, 1)).activation_bytes
    assert kept < residual_bytes(f, params, x, argnums=(0, 1)).activation_bytes


@pytest.mark.parametrize("spelling", [_two_pass_ln, _t5], ids=["two-pass", "t5"])
def test_hand_written_norms(spelling):
    x = normal((8, 32), scale=1.5) + 0.3
    w, b = normal((32,), scale=0.5) + 1.0, normal((32,), scale=0.5)

    def f(w, b, x):
        return jnp.sum(jnp.tanh(spelling(w, b, x)) ** 2)

    g = transform(f)
    close(*jax.jit(lambda *a: (jax.grad(g, (0, 1, 2))(*a), jax.grad(f, (0, 1, 2))(*a)))(
        w, b, x))
    rows = g.report(w, b, x).by_kind("norm")
    assert [r.converted for r in rows] == [True]
    want = "layer norm" if spelling is _two_pass_ln else "RMS norm"
    assert rows[0].matched.startswith(want)
    eps = "1e-12" if spelling is _two_pass_ln else "1e-06"
    assert f"eps {eps}" in rows[0].matched


def test_batch_norm_train_running_statistics_and_gradients():
    bn = nn.BatchNorm(use_running_average=False, momentum=0.9)
    x = normal((8, 5, 12), scale=2.0) + 1.0
    variables = jax.jit(bn.init)(key(), x)
    params = _perturbed(variables["params"])
    stats = _perturbed(variables["batch_stats"])

    def f(p, x):
        y, new = bn.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.sum(jnp.cos(y) * x), new

    g = transform(f)
    both = lambda fn: jax.jit(lambda p, x: (fn(p, x), jax.grad(lambda p, x: fn(p, x)[0],
                                                                 (0, 1))(p, x)))(params, x)
    ((lg, ng), gg), ((lf, nf), gf) = both(g), both(f)
    close(lg, lf)
    close(ng, nf)                      # the running mean / variance read from the match
    close(gg, gf)
    rows = g.report(params, x).by_kind("norm")
    assert [r.converted for r in rows] == [True]
    assert rows[0].matched.startswith("batch norm") and "mu, var" in rows[0].matched


def test_norms_under_jit_and_scan():
    ln = nn.LayerNorm()
    x = normal((3, 4, 16))
    p = _perturbed(ln.init(key(), x[0]))

    def f(p, xs):
        def step(c, x):
            y = ln.apply(p, x + c)
            return y, jnp.sum(y ** 3)
        c, ys = jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)
        return jnp.sum(ys) + jnp.sum(c)

    g = transform(f)
    close(*jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(f)(*a)))(p, x))
    rows = g.report(p, x).by_kind("norm")
    assert [(r.converted, r.path) for r in rows] == [(True, "scan")]


def test_look_alikes_are_left_with_a_reason():
    x = normal((8, 16), scale=2.0) + 1.0

    def held(x):  # the mean held constant: another derivative than a layer norm
        mu = jax.lax.stop_gradient(jnp.mean(x, -1, keepdims=True))
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return jnp.sum(jnp.sin((x - mu) * jax.lax.rsqrt(var + 1e-5)))

    def share(x):  # x / sum(x): a reduction that is no normalisation
        return jnp.sum(jnp.sin(x / jnp.sum(x ** 2, -1, keepdims=True)))

    for f in (held, share):
        g = transform(f)
        close(*jax.jit(lambda x, g=g, f=f: (jax.grad(g)(x), jax.grad(f)(x)))(x))
        rows = g.report(x).by_kind("norm")
        assert rows and not any(r.converted for r in rows)
        assert all(r.reason for r in rows)


def test_norms_option_off():
    ln = nn.LayerNorm()
    x = normal((4, 16))
    p = ln.init(key(), x)
    f = lambda p, x: jnp.sum(ln.apply(p, x) ** 2)
    assert not transform(f, norms=False).report(p, x).by_kind("norm")
    with pytest.raises(TypeError, match="norms"):
        transform(f, norms=1)
