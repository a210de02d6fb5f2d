"""The NumPy evaluator the matchers check regions with equals JAX's own evaluation in float64,
equation by equation (JAX's semantics where NumPy's differ: integer division toward zero,
float-to-integer truncation, ``select_n``, ``broadcast_in_dim``); what it does not evaluate
raises ``Unsupported``. Normalisations are verified without binding a JAX primitive, and
match the same when every equation falls back to JAX."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem.transform import match_norm, numpy_eval, transform
from jaxmem.transform.numpy_eval import Unsupported, as_float64, eval_eqn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, key, normal

_RNG = np.random.default_rng(7)
F = _RNG.standard_normal((3, 4)) * 2.0        # float64 operands, some negative
G = _RNG.standard_normal((3, 4)) * 2.0 + 0.1
P = np.abs(F) + 0.5                           # positive (log, sqrt, pow)
I = np.array([[-7, 7, -8, 9], [5, -5, 3, -3], [0, 1, -1, 10]], np.int32)
J = np.array([[2, -2, 3, -3], [4, 4, -4, 2], [3, 3, 3, -7]], np.int32)
B = F > 0

#: name -> (function, operands): together every primitive the evaluator has a rule for
CASES = {
    "unary": (lambda a: [-a, jnp.exp(a), jnp.exp2(a), jnp.expm1(a), jnp.tanh(a),
                         jax.nn.sigmoid(a), jnp.abs(a), jnp.sign(a), jnp.square(a),
                         a ** 3, jnp.sin(a), jnp.cos(a), jnp.tan(a), jnp.arctan(a),
                         jnp.sinh(a), jnp.cosh(a), jnp.arcsinh(a), jnp.floor(a),
                         jnp.ceil(a), jnp.isfinite(a), jnp.cbrt(a)], (F,)),
    "positive": (lambda a: [jnp.log(a), jnp.log1p(a), jnp.sqrt(a), lax.rsqrt(a), a ** -2,
                            jnp.arccosh(a + 1.0), jnp.arcsin(a / 10), jnp.arccos(a / 10),
                            jnp.arctanh(a / 10), a ** G], (P,)),
    "binary": (lambda a, b: [a + b, a - b, a * b, a / b, jnp.maximum(a, b),
                             jnp.minimum(a, b), jnp.arctan2(a, b), lax.rem(a, b), a > b,
                             a >= b, a < b, a <= b, a == b, a != b, jnp.nextafter(a, b),
                             lax.clamp(-0.5, a, 0.5)], (F, G)),
    "integers": (lambda i, j: [lax.div(i, j), lax.rem(i, j), i & j, i | j, i ^ j, ~i,
                               i ** 2, i.astype(jnp.float64) / 3, (i * 0.7).astype(jnp.int32),
                               i.astype(bool)], (I, J)),
    "booleans": (lambda a, b: [a & (b > 0), a | (b > 0), a ^ (b > 0), ~a,
                               lax.select_n(a, b, -b), lax.select_n(a.astype(jnp.int32), b, -b),
                               jnp.where(a, b, 0.0)], (B, G)),
    "shapes": (lambda a: [jnp.sum(a, 1), jnp.max(a, 0), jnp.min(a), a.reshape(4, 3),
                          a[None].squeeze(0), jnp.expand_dims(a, 1), a.T,
                          jnp.broadcast_to(a[:, None, :], (3, 2, 4)), a[1:3, ::2],
                          jnp.concatenate([a, a], 0), jnp.stack([a, a], 1),
                          jnp.mean(a, -1, keepdims=True)], (F,)),
    "calls": (lambda a: [jax.nn.relu(a), jax.jit(lambda u: u * 2 + 1)(a), jax.nn.relu6(a),
                         jax.nn.softplus(a), jax.nn.silu(a)], (F,)),
}


def _numpy(jaxpr, args):
    env = dict(zip(jaxpr.jaxpr.invars, [as_float64(a) for a in args]))
    env.update(zip(jaxpr.jaxpr.constvars, [as_float64(c) for c in jaxpr.consts]))
    for eqn in jaxpr.jaxpr.eqns:
        ins = [as_float64(v.val) if hasattr(v, "val") else env[v] for v in eqn.invars]
        env.update(zip(eqn.outvars, eval_eqn(eqn, ins)))
    return [as_float64(v.val) if hasattr(v, "val") else env[v] for v in jaxpr.jaxpr.outvars]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rule_equals_jax_in_float64(name):
    fn, args = CASES[name]
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(fn)(*args)
        want = [np.asarray(w) for w in jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)]
    got = _numpy(jaxpr, args)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (name, k)
        assert g.dtype.kind == w.dtype.kind, (name, k, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-300, err_msg=f"{name} #{k}")


def test_float_inputs_are_widened_and_the_rest_kept():
    assert as_float64(np.ones(2, jnp.bfloat16)).dtype == np.float64
    assert as_float64(np.ones(2, np.float16)).dtype == np.float64
    assert as_float64(np.ones(2, np.int8)).dtype == np.int8
    with pytest.raises(Unsupported, match="complex"):
        as_float64(np.ones(2, np.complex64))


@pytest.mark.parametrize("fn", [jax.scipy.special.erf, lambda a: a.astype(jnp.complex64),
                                lambda a: jnp.cumsum(a, 0), lambda a: a @ a.T],
                         ids=["erf", "complex", "cumsum", "dot"])
def test_what_has_no_rule_raises_unsupported(fn):
    jaxpr = jax.make_jaxpr(fn)(F.astype(np.float32))
    with pytest.raises(Unsupported):
        _numpy(jaxpr, [F])


def _norm_models():
    x = normal((4, 6, 16), scale=2.0) + 0.5
    out = []
    for mod in (nn.LayerNorm(), nn.RMSNorm(), nn.GroupNorm(num_groups=4),
                nn.BatchNorm(use_running_average=False)):
        variables = jax.jit(mod.init)(key(), x)

        def f(p, x, mod=mod, variables=variables):
            v = dict(variables, params=p)
            y = mod.apply(v, x, mutable=["batch_stats"])[0] if "batch_stats" in v else \
                mod.apply(v, x)
            return jnp.sum(jnp.sin(y) * x)

        out.append((f, variables["params"], x))
    return out


def test_norms_are_verified_in_numpy_and_the_same_with_jax(monkeypatch):
    models = _norm_models()

    def report(f, p, x):
        return [(r.converted, r.matched) for r in transform(f).report(p, x).by_kind("norm")]

    def no_jax(*_):
        raise AssertionError("a norm region was evaluated with JAX")

    monkeypatch.setattr(match_norm, "on_host", no_jax)
    in_numpy = [report(*m) for m in models]
    assert [[c for c, _ in rows] for rows in in_numpy] == [[True]] * len(models)
    monkeypatch.undo()

    def unsupported(*_, **__):
        raise Unsupported("every equation")

    monkeypatch.setattr(match_norm, "eval_eqn", unsupported)
    assert [report(*m) for m in models] == in_numpy           # the JAX fallback agrees
    f, p, x = models[0]
    close(jax.jit(jax.grad(transform(f)))(p, x), jax.jit(jax.grad(f))(p, x))


def test_a_region_traced_at_one_shape_broadcasts_to_the_evaluated_one():
    jaxpr = jax.make_jaxpr(lambda a: jnp.broadcast_to(a, (2, 3)))(np.float32(1.0))
    (eqn,) = jaxpr.jaxpr.eqns
    (out,) = numpy_eval.eval_eqn(eqn, [np.float64(2.0)], root_shape=(2, 3), x_shape=(5, 3))
    assert out.shape == (5, 3) and np.all(out == 2.0)
