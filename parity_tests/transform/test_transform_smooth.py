"""Exact smooth activations without ``fewbit``: ``jaxmem.selective.smooth_activation`` keeps
only the input ``x`` and recomputes JAX's own ``vjp`` of ``f`` at ``x`` in the backward;
under ``jaxmem.transform`` a following product keeps that same ``x`` and recomputes ``f(x)``.
Gradients equal JAX's (float32 and float64; under ``jit``, ``vmap``, ``grad`` of ``grad``,
``lax.scan``, ``jax.checkpoint``; bf16 inputs), autodiff keeps one array per activation,
and XLA's plan (CPU and the H100 plan) keeps less per layer than without the rule."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem.measure import compiled_memory, gpu_plan_available, residual_bytes, slope
from jaxmem.selective.smooth import smooth_activation
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import both, close, normal

ACTS = {
    "gelu erf": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu tanh": jax.nn.gelu,
    "gelu erf (hand written)": lambda x: x * 0.5 * (1.0 + lax.erf(x / np.sqrt(2.0))),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "tanh": jnp.tanh,
}


# --------------------------------------------------------------------------- the op
@pytest.mark.parametrize("tie_whole", [False, True])
@pytest.mark.parametrize("name", list(ACTS))
def test_op_value_and_gradient_are_jax_own(name, tie_whole):
    f = ACTS[name]
    x, g = normal((64, 32), scale=3.0), normal((64, 32))
    op = lambda x: smooth_activation(f, x, tie_whole=tie_whole)
    assert np.array_equal(jax.jit(op)(x), jax.jit(f)(x))     # two programs: bit for bit

    def grads(fn, x):
        d1 = jax.grad(lambda y: jnp.sum(fn(y) * g))
        # second order: the backward (JAX's vjp of f) is differentiable itself
        return d1(x), jax.grad(lambda x: jnp.sum(d1(x)))(x)

    (got, got2), (want, want2) = both(grads, op, f, x)       # one program, both sides
    close(got, want, rtol=1e-6, atol=1e-7)
    close(got2, want2, rtol=1e-6, atol=1e-6)


def test_op_tie_whole_checked():
    with pytest.raises(TypeError, match="tie_whole must be a bool"):
        smooth_activation(jax.nn.gelu, normal((4,)), tie_whole=1)


@pytest.mark.parametrize("name", ["gelu erf", "gelu tanh", "silu"])
def test_op_gradient_in_float64(name):
    f = ACTS[name]
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng().normal(size=(128,)) * 4.0, jnp.float64)
        g = jnp.asarray(np.random.default_rng().normal(size=(128,)), jnp.float64)
        # compiled, both sides in one program (op by op, every float64 op would compile on
        # its own)
        got, want = both(lambda fn, x: jax.grad(lambda x: jnp.sum(fn(x) * g))(x),
                          lambda x: smooth_activation(f, x), f, x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-13, atol=1e-15)


def test_op_keeps_only_its_input_and_nothing_when_not_differentiated():
    f = ACTS["gelu erf"]
    x, w = normal((16, 32)), normal((32, 8))
    keep = lambda fn: residual_bytes(lambda x: jnp.sum(jnp.sin(fn(x) @ w)), x)
    big = [e for e in keep(lambda x: smooth_activation(f, x)).entries if e.shape == (16, 32)]
    assert len(big) == 1 and "smooth" in big[0].source
    assert len([e for e in keep(f).entries if e.shape == (16, 32)]) >= 3
    # only w differentiated: the op keeps nothing (the plain product keeps f(x) for dw)
    res = residual_bytes(lambda w: jnp.sum(jnp.sin(smooth_activation(f, x) @ w)), w)
    assert not [e for e in res.entries if "selective.smooth" in e.source]


# ------------------------------------------------------------- under jaxmem.transform
def _loss(act):
    def loss(p, x):
        h = act(x @ p["w1"] + p["b1"])
        return jnp.mean(jnp.sin(h @ p["w2"]) ** 2)
    return loss


def _params(dtype=jnp.float32):
    return {"w1": normal((16, 64), dtype, 0.4), "b1": normal((64,), dtype, 0.1),
            "w2": normal((64, 8), dtype, 0.2)}


def test_transform_matches_and_product_recomputes():
    f = _loss(ACTS["gelu erf"])
    p, x = _params(), normal((32, 16), scale=2.0)
    g = transform(f)
    row, = [r for r in g.report(p, x).by_kind("activation") if r.converted]
    assert row.became == "exact (input kept, f' recomputed)"
    assert "recomputed by the product" in row.reason
    close(*both(lambda fn, p, x: jax.value_and_grad(fn)(p, x), g, f, p, x))
    # autodiff keeps one (32, 64) array for the GELU and the down-projection together
    big = lambda fn: [e for e in residual_bytes(fn, p, x).entries if e.shape == (32, 64)]
    assert len(big(g)) == 1 and len(big(f)) >= 3


@pytest.mark.parametrize("name", ["gelu erf", "gelu tanh", "silu"])
def test_transform_under_vmap_and_second_order(name):
    f = _loss(ACTS[name])
    p, xs = _params(), normal((3, 5, 16), scale=2.0)
    g = transform(f)

    def uses(fn, p, xs):  # per-example gradients, grad of grad
        return (jax.vmap(jax.grad(fn), (None, 0))(p, xs),
                jax.grad(lambda p, x: jnp.sum(jax.grad(fn, 1)(p, x) ** 2))(p, xs[0]))

    (per_g, gg_g), (per_f, gg_f) = both(uses, g, f, p, xs)   # one program, both sides
    close(per_g, per_f)
    close(gg_g, gg_f, rtol=1e-5, atol=1e-6)


def test_transform_inside_scan_and_checkpoint():
    act = ACTS["gelu erf"]
    ws, x = normal((3, 32, 32), scale=0.3), normal((8, 32), scale=2.0)

    def scanned(ws, x):
        h, _ = lax.scan(lambda h, w: (act(h @ w), None), x, ws)
        return jnp.mean(h ** 2)

    def remat(ws, x):
        layer = jax.checkpoint(lambda h, w: act(h @ w) @ w)
        return jnp.mean(layer(x, ws[0]) ** 2)

    for f in (scanned, remat):
        g = transform(f)
        assert any(r.converted and r.became.startswith("exact")
                   for r in g.report(ws, x).by_kind("activation"))
        close(*both(lambda fn, ws, x: jax.grad(fn, (0, 1))(ws, x), g, f, ws, x))
    # the stacked scan residuals: one (8, 32) array per layer, not the GELU's three
    big = lambda fn: [e for e in residual_bytes(fn, ws, x).entries if e.shape == (3, 8, 32)]
    assert len(big(transform(scanned))) < len(big(scanned))


def test_transform_bf16_inputs():
    f = _loss(ACTS["gelu erf"])
    p, x = _params(jnp.bfloat16), normal((32, 16), jnp.bfloat16, 2.0)
    g = transform(f)
    got, want = both(lambda fn, p, x: jax.grad(fn)(p, x), g, f, p, x)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(got))
    close(got, want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------- XLA's plan
B, H = 1024, 128  # small weights: the bytes per added layer are the activations


def _per_layer(target, variant):
    """Compiled temp bytes per added layer of ``x -> gelu(x @ w)`` (weights and input
    differentiated), in units of one ``B x H`` float32 array."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(H, H)) / np.sqrt(H), jnp.float32) for _ in range(4)]
    x = jnp.asarray(rng.normal(size=(B, H)), jnp.float32)
    act = ACTS["gelu erf"]

    def measure(d):
        def loss(ws, x):
            h = x
            for w in ws:
                h = act(h @ w)
            return jnp.mean(h ** 2)
        return compiled_memory(jax.grad(variant(loss), (0, 1)), ws[:d], x,
                               target=target).temp_bytes

    return slope(measure, 2) / (B * H * 4)


TARGETS = ["cpu", pytest.param("h100", marks=pytest.mark.skipif(
    not gpu_plan_available(), reason="the H100 plan needs the CUDA PJRT plugin"))]


@pytest.mark.parametrize("target", TARGETS)
def test_compiled_plan_keeps_the_input_only(target):
    exact = _per_layer(target, transform)
    # the same step with the activation left to JAX's autodiff (products still selective)
    without = _per_layer(target, lambda f: transform(f, activations=False))
    assert exact <= 1.25, exact
    assert without >= exact + 0.75, (without, exact)


# ------------------------------------------- fewbit: a product reading f(x) keeps it anyway
def _mlp(act, extra=None):
    def loss(p, x):
        h = act(x @ p["w1"] + p["b1"])
        y = h @ p["w2"]
        if extra is not None:
            y = y + extra(h)
        return jnp.mean(y ** 2)
    return loss


def _stack(act, depth):
    """``depth`` layers ``h = act(h @ w1 + b1) @ w3``: as many activations read by products."""
    def loss(p, x):
        h = x
        for _ in range(depth):
            h = act(h @ p["w1"] + p["b1"]) @ p["w3"]
        return jnp.mean(h ** 2)
    return loss


def _stack_params():
    return dict(_params(), w3=normal((64, 16), scale=0.2))


def _as_accurate_as_jax(got, f, *args):
    """``got`` (f32 value and gradients of a transformed ``f``) is as close to ``f``'s float64
    value and gradients as JAX's own f32 ones are (within 4x, per leaf, plus 1e-6 of the
    leaf's scale): a 12-layer stack's f32 gradients differ from run to run by rounding alone
    (up to ~4e-3 relative on entries that cancel), so the reference is the float64 truth."""
    plain = jax.jit(jax.value_and_grad(f))(*args)
    with jax.enable_x64():
        a64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, np.float64)), args)
        ref = jax.jit(jax.value_and_grad(f))(*a64)
    for g, j, r in zip(*(jax.tree_util.tree_leaves(t) for t in (got, plain, ref))):
        g, j, r = (np.asarray(v, np.float64) for v in (g, j, r))
        e_got, e_jax = np.max(np.abs(g - r)), np.max(np.abs(j - r))
        assert e_got <= 4 * e_jax + 1e-6 * max(1.0, np.max(np.abs(r))), (e_got, e_jax)


@pytest.mark.parametrize("name", ["gelu erf", "gelu tanh", "silu", "tanh"])
def test_fewbit_keeps_the_exact_op_where_many_products_read_outputs(name):
    """Under ``fewbit`` a smooth activation read by a selective product stays exact when the
    program has many such sites: the product would keep ``f(x)`` beside a few-bit code,
    while the exact op keeps ``x`` alone (the product recomputes ``f(x)`` from it). Same
    residuals as without ``fewbit``, no code, and the gradient is the exact one (also for
    ``tanh``, which the exact path leaves to JAX without ``fewbit``)."""
    f = _stack(ACTS[name], 12)
    p, x = _stack_params(), normal((32, 16), scale=2.0)
    g3 = transform(f, fewbit=3)
    rows = [r for r in g3.report(p, x).by_kind("activation") if r.converted]
    assert len(rows) == 12
    assert all(r.became == "exact (input kept, f' recomputed)" for r in rows)
    assert all("fewbit=3 not applied" in r.reason and "product" in r.reason for r in rows)
    got = jax.jit(jax.value_and_grad(g3))(p, x)
    _as_accurate_as_jax(got, f, p, x)
    if name != "tanh":  # the same step as without fewbit
        want = jax.jit(jax.value_and_grad(transform(f)))(p, x)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                        jax.tree_util.tree_leaves(want)))
    # autodiff keeps x once per layer, shared by the activation and the product; no code
    res = residual_bytes(g3, p, x)
    assert len([e for e in res.entries if e.shape == (32, 64)]) == 12
    assert not [e for e in res.entries if e.dtype == jnp.uint8]
    assert res.activation_bytes <= residual_bytes(transform(f), p, x).activation_bytes


@pytest.mark.xla_cpu
@pytest.mark.parametrize("depth", [1, 24])
def test_fewbit_after_products_picks_the_smaller_plan(depth, monkeypatch):
    """The whole program decides (``jaxmem.transform.fewbit_sites``): one activation read
    by a product keeps its 3-bit code (the exact op's backward would hold a recomputed
    ``f(x)`` at the peak: more than one code), 24 keep the exact op (24 codes outweigh that
    buffer). On XLA:CPU each choice compiles to fewer bytes than the other, forced (32 x 64
    activations: 52.5 vs 57.9 KB at depth 1, 283.4 vs 299.0 KB at depth 24). XLA:GPU's H100
    plan keeps this small stack smaller coded at every depth (xla_cpu: XLA:CPU's plan)."""
    from jaxmem.transform import fewbit_sites
    f = _stack(ACTS["gelu erf"], depth)
    p, x = _stack_params(), normal((32, 16), scale=2.0)

    def total():
        return compiled_memory(jax.grad(transform(f, fewbit=3)), p, x).total_bytes

    rows = [r for r in transform(f, fewbit=3).report(p, x).by_kind("activation")
            if r.converted]
    coded = all(r.became == "3-bit code (fitted table)" for r in rows)
    assert len(rows) == depth and coded == (depth == 1)
    chosen = total()
    monkeypatch.setattr(fewbit_sites, "WORKING_SET", 0.0 if coded else 1e9)   # the other
    assert chosen < total()


@pytest.mark.parametrize("variant,why", [
    ("no product", "output scaled and summed"),
    ("products=False", "the product is JAX's own and keeps f(x) in any case"),
    ("f(x) kept elsewhere", "a product of two activations keeps f(x) too"),
])
def test_fewbit_codes_stay_where_nothing_else_is_saved(variant, why):
    del why
    act = ACTS["gelu erf"]
    p, x = _params(), normal((32, 16), scale=2.0)
    opts = {}
    if variant == "no product":
        f = lambda p, x: jnp.sum(act(x @ p["w1"] + p["b1"]) * 0.5)
    elif variant == "products=False":
        f, opts = _mlp(act), {"products": False}
    else:
        f = _mlp(act, extra=lambda h: jnp.sum(h * jnp.cos(h), -1, keepdims=True))
    g3 = transform(f, fewbit=3, **opts)
    rows = [r for r in g3.report(p, x).by_kind("activation") if r.converted]
    assert [r.became for r in rows] == ["3-bit code (fitted table)"], rows
    assert [e for e in residual_bytes(g3, p, x).entries if e.dtype == jnp.uint8]


def _mlp_stack(variant, target, depth):
    """Compiled temp bytes of ``jax.grad`` of ``depth`` blocks ``h + gelu(h @ w1) @ w2``."""
    rng = np.random.default_rng(0)
    ws = [(jnp.asarray(rng.normal(size=(H, 4 * H)) / np.sqrt(H), jnp.float32),
           jnp.asarray(rng.normal(size=(4 * H, H)) / np.sqrt(4 * H), jnp.float32))
          for _ in range(depth)]
    x = jnp.asarray(rng.normal(size=(B // 2, H)), jnp.float32)
    act = ACTS["gelu erf"]

    def loss(ws, x):
        h = x
        for w1, w2 in ws:
            h = h + act(h @ w1) @ w2
        return jnp.mean(h ** 2)

    return compiled_memory(jax.grad(variant(loss), (0, 1)), ws, x, target=target).temp_bytes


@pytest.mark.parametrize("target", TARGETS)
def test_compiled_fewbit_step_is_the_exact_step_where_products_read_the_activation(target):
    """Every GELU of the stack feeds a product, and there are enough of them (nine) for the
    exact op to win (``fewbit_sites``): ``fewbit=3`` compiles to the very step ``transform``
    gives (with few-bit codes, the products kept ``gelu(x)`` in f32 beside them: a
    different plan, with approximate gradients). A first block (its input the argument),
    interior ones and a last one, each block identical to the others."""
    exact = _mlp_stack(transform, target, 9)
    assert _mlp_stack(lambda f: transform(f, fewbit=3), target, 9) == exact
