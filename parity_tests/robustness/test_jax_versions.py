"""What differs between the JAX versions jaxmem supports is read in one place
(:mod:`jaxmem._compat`); these tests pin those readings on the installed version."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import transform
from jaxmem._compat import scan_counts


def _scan_eqn(fn, *args):
    eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "scan"]
    assert len(eqns) == 1
    return eqns[0]


def test_scan_counts_are_the_consts_and_carries_of_the_equation():
    w, v = jnp.arange(3.0), jnp.arange(2.0)

    def f(c1, c2, xs, ys):
        def body(c, x):
            return (c[0] * x[0] * w[0] * v[1], c[1] + x[1][0]), (c[0] * 2, c[1] + 1.0)
        return jax.lax.scan(body, (c1, c2), (xs, ys))

    e = _scan_eqn(f, 1.0, 2.0, jnp.ones(3), jnp.ones((3, 2)))
    nc, ncar = scan_counts(e.params)
    assert ncar == 2
    assert nc + ncar + 2 == len(e.invars)      # the two scanned inputs follow
    assert len(e.outvars) == ncar + 2
    # the counts split the operands where the body expects them: carries are scalars here
    assert [v.aval.shape for v in e.invars[nc:nc + ncar]] == [(), ()]


def test_transformed_scan_equals_the_program_on_this_version():
    """The transformation re-binds a scan from those counts: values and gradients agree."""
    w = jax.random.normal(jax.random.key(0), (4, 4))
    xs = jax.random.normal(jax.random.key(1), (5, 3, 4))

    def f(w, xs):
        def body(c, x):
            h = jax.nn.gelu(x @ w + c)
            return jnp.tanh(h), jnp.sum(h * h)
        c, ys = jax.lax.scan(body, jnp.zeros((3, 4)), xs)
        return jnp.sum(c) + jnp.sum(ys)

    got = jax.value_and_grad(transform(f), (0, 1))(w, xs)
    want = jax.value_and_grad(f, (0, 1))(w, xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
