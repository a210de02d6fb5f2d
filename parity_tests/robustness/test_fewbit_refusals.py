"""Bad input to jaxmem.fewbit is refused clearly; edge cases (sizes 0 and 1, non-finite
values, traced slopes) work."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import fewbit
from jaxmem.measure import residual_bytes


@pytest.mark.parametrize("borders,levels,match", [
    ([np.nan], [0.0, 1.0], "borders must be finite"),
    ([np.inf], [0.0, 1.0], "borders must be finite"),
    ([0.0], [np.nan, 1.0], "levels must be finite"),
    ([0.0], [-np.inf, 1.0], "levels must be finite"),
    ([0.0], [1e39, 1.0], "levels must be finite"),  # overflows float32
    ([0.0, 1.0], [0.0, 1.0], "1-bit table needs 1 borders and 2 levels"),
    ([0.0], [0.0, 1.0, 2.0], "levels has 3 entries"),
    ([[0.0]], [0.0, 1.0], "one-dimensional"),
])
def test_fewbit_op_refuses_bad_tables(borders, levels, match):
    with pytest.raises(ValueError, match=match):
        fewbit.fewbit_op(jnp.tanh, borders, levels, 1)


def test_fewbit_op_refuses_unsorted_borders_and_names_them():
    with pytest.raises(ValueError, match=r"sorted ascending.*borders\[1\] = 2\.0 > borders\[2\]"):
        fewbit.fewbit_op(jnp.tanh, [0.0, 2.0, 1.0], [0, 1, 2, 3], 2)
    with pytest.raises(TypeError, match="fn must be a callable"):
        fewbit.fewbit_op("tanh", [0.0], [0.0, 1.0], 1)
    # equal borders (an empty bin) are allowed
    op = fewbit.fewbit_op(jnp.tanh, [0.0, 0.0, 1.0], [0, 1, 2, 3], 2)
    g = jax.grad(lambda x: op(x).sum())(jnp.array([-1.0, 0.0, 0.5, 2.0]))
    np.testing.assert_array_equal(np.asarray(g), [0.0, 2.0, 2.0, 3.0])


def test_mask_op_refuses_non_finite_levels():
    with pytest.raises(ValueError, match="low must be finite"):
        fewbit.mask_op(jax.nn.relu, lambda x: x > 0, np.nan, 1.0)


def test_make_activation_sqrt_names_the_non_finite_range():
    with pytest.raises(ValueError, match=r"derivative of sqrt is NaN or inf on \[-10, 0\].*"
                                         r"interval=\(A, B\).*e\.g\. interval=\("):
        fewbit.make_activation(jnp.sqrt, 2, grid=256)
    # sqrt is elementwise: the check says so (its NaN derivatives are not off-diagonal terms)
    fewbit.check_elementwise(jnp.sqrt)
    op = fewbit.make_activation(jnp.sqrt, 2, interval=(0.01, 10.0), grid=256)
    x = jnp.array([0.5, 2.0, 9.0])
    np.testing.assert_array_equal(np.asarray(op(x)), np.asarray(jnp.sqrt(x)))
    g = jax.grad(lambda x: op(x).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), op.fit.levels.astype(np.float32)[
        op.fit.code(np.asarray(x))])


def test_check_elementwise_domain_with_no_finite_point_is_clear():
    with pytest.raises(ValueError, match=r"NaN/inf at 7 of 7 probe points.*pass interval="):
        fewbit.check_elementwise(jnp.sqrt, interval=(-5.0, -1.0))


def test_check_elementwise_accepts_custom_vjp_ops_and_refuses_mixing():
    fewbit.check_elementwise(fewbit.gelu)  # custom_vjp: checked in reverse mode
    for fn in (jnp.cumsum, lambda x: x[::-1], lambda x: x / jnp.sum(x)):
        with pytest.raises(ValueError, match="not elementwise"):
            fewbit.check_elementwise(fn)


def test_make_activation_under_jit():
    fn = lambda x: jax.nn.elu(x, alpha=2.0)

    @jax.jit
    def f(x):
        return fewbit.make_activation(fn, 2, grid=256)(x)

    x = jnp.linspace(-2.0, 2.0, 8)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(fn(x)))


def test_leaky_relu_traced_slope_under_jit_grad_vmap():
    x = jnp.array([-2.0, -0.5, 0.0, 0.25, 3.0])

    @jax.jit
    def f(x, s):
        return fewbit.leaky_relu(x, s)

    np.testing.assert_array_equal(np.asarray(f(x, 0.2)),
                                  np.asarray(jax.nn.leaky_relu(x, 0.2)))
    gx, gs = jax.grad(lambda x, s: jnp.sum(f(x, s) * jnp.arange(5.0)), (0, 1))(x, 0.2)
    gx0, gs0 = jax.grad(lambda x, s: jnp.sum(jax.nn.leaky_relu(x, s) * jnp.arange(5.0)),
                        (0, 1))(x, 0.2)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(gx0))
    np.testing.assert_allclose(float(gs), float(gs0), rtol=1e-6)
    slopes = jnp.array([0.0, 0.1, 0.3])
    ys = jax.vmap(lambda s: f(x, s))(slopes)
    np.testing.assert_array_equal(np.asarray(ys),
                                  np.asarray(jax.vmap(lambda s: jax.nn.leaky_relu(x, s))(slopes)))
    # per-channel slope broadcasting to x
    xc = jnp.ones((2, 3)) * -1.0
    np.testing.assert_array_equal(np.asarray(fewbit.leaky_relu(xc, jnp.array([0.1, 0.2, 0.3]))),
                                  np.asarray(-jnp.broadcast_to(jnp.array([0.1, 0.2, 0.3]),
                                                               (2, 3))))


def test_leaky_relu_traced_slope_keeps_only_the_mask():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 64))
    rep = residual_bytes(lambda x, s: fewbit.leaky_relu(x, s).sum(), x, jnp.float32(0.1),
                         argnums=0)
    assert rep.activation_bytes <= x.size // 8 + 64  # one packed bit per element (+ scalars)


def test_leaky_relu_refuses_bad_slopes():
    with pytest.raises(TypeError, match="negative_slope must be a float"):
        fewbit.leaky_relu(jnp.ones(3), True)
    with pytest.raises(ValueError, match="does not broadcast"):
        fewbit.leaky_relu(jnp.ones(3), jnp.ones(4))
    with pytest.raises(ValueError, match="negative_slope must be finite"):
        fewbit.leaky_relu(jnp.ones(3), float("nan"))


def test_codes_refuses_bad_borders():
    x = jnp.array([-1.0, 0.5, 2.0])
    np.testing.assert_array_equal(np.asarray(fewbit.codes(x, [0.0, 1.0])), [0, 1, 2])
    for bad in ([np.nan, 1.0], [1.0, 0.0], [0.0, 1e39]):
        with pytest.raises(ValueError, match="borders must be finite"):
            fewbit.codes(x, bad)
