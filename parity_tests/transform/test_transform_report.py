"""The report comes from the jaxpr: one row per product / activation / attention /
higher-order primitive, with what it became or why not, the user's source line and the
Flax name stack."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem.transform import Report, Row, report, transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import normal


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="up")(x)
        h = nn.gelu(h)
        h = nn.Dense(16, name="down")(h)
        # exp(x) keeps one array under autodiff (itself): the smooth row left as it is
        return jnp.tanh(h) + nn.relu(x) + jnp.exp(x) * h


def test_rows_name_what_where_and_why():
    x = normal((4, 16))
    model = Block()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    rep = report(model.apply, params, x)
    assert isinstance(rep, Report) and all(isinstance(r, Row) for r in rep)
    dots = rep.by_kind("dot")
    assert [r.converted for r in dots] == [True, True]
    assert any("up" in r.name_stack for r in dots) and any("down" in r.name_stack
                                                             for r in dots)
    acts = rep.by_kind("activation")
    relu = [r for r in acts if r.converted and "mask" in r.became]
    assert relu and "1-bit mask" in relu[0].became and "test_transform_report.py" in \
        relu[0].where
    kept = rep.unconverted()
    assert kept and all(r.reason for r in kept)          # every unconverted row says why
    # exp(x), and tanh where JAX's own rule keeps only its output (jax >= 0.11): nothing to
    # save, so kept; gelu (and tanh where its rule keeps two arrays) keep x instead
    assert {r.kind for r in kept} == {"activation"}
    assert all("autodiff keeps 1 " in r.reason for r in kept), [r.reason for r in kept]
    assert any(r.matched.endswith(": exp") for r in kept)
    tanh_kept = any(r.matched.endswith(": tanh") for r in kept)
    assert len(kept) == 1 + tanh_kept
    assert [r.became for r in acts if r.converted].count("exact (input kept, f' "
                                                         "recomputed)") == 2 - tanh_kept
    text = str(rep)
    assert "kept: smooth" in text and "1-bit mask" in text and "converted" in text


def test_fewbit_report_and_module_level_report_agree():
    x = normal((4, 16))
    model = Block()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    g = transform(model.apply, fewbit=2)
    a = g.report(params, x)
    b = jaxmem.transform.report(g, params, x)
    assert [(r.kind, r.became) for r in a] == [(r.kind, r.became) for r in b]
    assert not a.unconverted()                      # gelu, tanh, exp: 2-bit codes


def test_report_records_each_trace_not_a_cached_one():
    x = normal((3, 8))
    g = transform(lambda x: jnp.sum(jax.nn.relu(x @ x.T)))
    jax.jit(g)(x)
    assert len(g.report(x)) == 2 and len(g.report(x)) == 2


def test_not_entered_primitives_are_reported():
    x = normal((5,))

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
    rows = transform(lambda x: f(x) * 2.0).report(x).by_kind("higher-order")
    assert rows and not rows[0].converted and "derivative rule" in rows[0].reason


def _gelu_loss(w, x):
    return jnp.mean(jax.nn.gelu(x @ w) ** 2)


def test_a_step_that_differentiates_inside_is_reported_and_warned():
    """``transform(train_step)`` (the step calls ``jax.grad``): its backward pass is already
    plain equations, so nothing jaxmem re-emits changes what it keeps. The report has a
    ``gradient`` row at the user's loss, calling the transformed step warns
    ``GradientInsideWarning`` once, and the result is still the untouched step's."""
    import warnings

    def train_step(w, x):
        return w - 0.1 * jax.grad(_gelu_loss)(w, x)

    w, x = normal((8, 8), scale=0.3), normal((4, 8))
    rows = report(transform(train_step), w, x).by_kind("gradient")
    assert len(rows) == 1 and not rows[0].converted
    assert "transform the loss instead" in rows[0].reason
    assert "_gelu_loss" in rows[0].where
    entries = jaxmem.report(train_step, w, x).by_kind("gradient")   # untouched step
    assert [e.status for e in entries] == ["fallback"]
    g = transform(train_step)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = jax.jit(g)(w, x)
        g(w, x)
    assert [type(s.message) for s in seen] == [jaxmem.GradientInsideWarning]
    assert "jax.grad(jaxmem.transform(loss))" in str(seen[0].message)
    np.testing.assert_allclose(got, jax.jit(train_step)(w, x), rtol=1e-6, atol=1e-7)


def test_an_inner_gradient_of_a_differentiated_loss_is_not_warned():
    """A loss with a gradient penalty (an inner ``jax.grad``) differentiated from outside, and
    a plain loss: no warning (the report still notes the inner gradient of the first)."""
    import warnings

    def penalised(w, x):
        return _gelu_loss(w, x) + jnp.sum(jax.grad(_gelu_loss, 1)(w, x) ** 2)

    w, x = normal((8, 8), scale=0.3), normal((4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.GradientInsideWarning)
        got = jax.jit(jax.grad(transform(penalised)))(w, x)
        jax.jit(jax.grad(transform(_gelu_loss)))(w, x)
        jax.jit(jax.vmap(jax.grad(transform(_gelu_loss)), (None, 0)))(w, x[None])
    np.testing.assert_allclose(got, jax.jit(jax.grad(penalised))(w, x), rtol=1e-5, atol=1e-7)
    assert not report(transform(_gelu_loss), w, x).by_kind("gradient")
