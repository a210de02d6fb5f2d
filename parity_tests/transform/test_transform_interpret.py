"""jaxmem.transform re-emits any JAX program exactly: values and gradients equal the
untouched function's, under jit / vmap / grad / scan / cond / while / checkpoint, for
pytrees, keyword and static arguments, in float32, bfloat16 and float16."""
from __future__ import annotations

import sys

import flax
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxmem
from jaxmem.transform import Options, report, transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal
from _util import mlp_loss as _mlp
from _util import mlp_params as _params


def test_forward_and_grad_equal_the_original():
    p, x = _params(), normal((5, 8))
    g = transform(_mlp)
    close(g(p, x), _mlp(p, x), rtol=1e-6)  # eager too
    close(*jax.jit(lambda *a: (jax.grad(g, argnums=(0, 1))(*a),
                               jax.grad(_mlp, argnums=(0, 1))(*a)))(p, x))


def test_keyword_and_static_arguments_pass_through():
    p, x = _params(), normal((3, 8))
    g = transform(_mlp)
    close(*jax.jit(lambda p, x: (g(p, x, scale=2.5), _mlp(p, x, scale=2.5)))(p, x), rtol=1e-6)

    def f(x, mode):  # a Python string is static: f branches on it
        return jnp.sum(jnp.sin(x)) if mode == "sin" else jnp.sum(jnp.cos(x))

    close(transform(f)(x, "cos"), f(x, "cos"), rtol=1e-6)


def test_pytree_outputs():
    x = normal((4, 3))

    def f(x):
        return {"a": jax.nn.relu(x), "b": (jnp.exp(x), x @ x.T)}

    close(transform(f)(x), f(x), rtol=1e-6)


def test_vmap_outside_and_inside():
    p, xs = _params(), normal((3, 5, 8))
    g = transform(_mlp)
    close(*jax.jit(lambda *a: (jax.vmap(g, (None, 0))(*a), jax.vmap(_mlp, (None, 0))(*a)))(
        p, xs),
          rtol=1e-6)

    def outer(p, xs):
        return jnp.sum(jax.vmap(lambda x: _mlp(p, x))(xs))

    close(*jax.jit(lambda *a: (jax.grad(transform(outer))(*a), jax.grad(outer)(*a)))(p, xs))


def test_nothing_is_patched():
    before = (jax.nn.gelu, jax.nn.relu, jax.nn.softmax, lax.dot_general, jnp.einsum,
              flax.linen.Dense.__call__, flax.linen.dot_product_attention)
    x = normal((2, 8))
    jax.jit(jax.grad(transform(lambda x: jnp.sum(jax.nn.gelu(x) + jax.nn.relu(x)), fewbit=2)))(x)
    after = (jax.nn.gelu, jax.nn.relu, jax.nn.softmax, lax.dot_general, jnp.einsum,
             flax.linen.Dense.__call__, flax.linen.dot_product_attention)
    assert all(a is b for a, b in zip(before, after))
    for mod in (jax, jax.nn, lax, jnp, flax.linen):
        assert not [n for n in vars(mod) if "jaxmem" in n.lower()], mod.__name__


def test_module_is_the_function():
    x = normal((3, 4))
    f = jnp.sin
    close(jaxmem.transform(f)(x), f(x))
    assert jaxmem.transform.report is report
    assert [r.kind for r in jaxmem.transform(lambda x: x @ x.T).report(x)] == ["dot"]
    import jaxmem.transform as mod
    close(mod(f)(x), f(x))
    assert transform(f).options == Options()


@pytest.mark.parametrize("bad", [0, 5, 2.0, True, "3"])
def test_fewbit_outside_1_to_4_is_refused(bad):
    with pytest.raises(ValueError, match="fewbit must be None or an int in 1..4"):
        transform(jnp.sin, fewbit=bad)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="f must be a callable"):
        transform(3)
    with pytest.raises(TypeError, match="attention must be True or False"):
        transform(jnp.sin, attention=1)


def test_options_switch_matchers_off():
    p, x = _params(), normal((2, 8))
    rows = transform(_mlp, products=False, activations=False).report(p, x)
    assert not rows.converted()
    close(*jax.jit(lambda *a: (transform(_mlp, products=False)(*a), _mlp(*a)))(p, x), rtol=1e-6)
