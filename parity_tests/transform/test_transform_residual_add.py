"""A residual add of two values a selective op can recompute (a ResNet block's
``bn2(conv2(h)) + x``, then ReLU) is recorded by the transformation: the next block's first
convolution recomputes its input for its kernel gradient from the norms' residuals instead
of keeping it. Gradients are the untouched function's; residual bytes drop by one block
output per block that feeds another."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

#: two blocks: the first one's output feeds the second
N, S, C, BLOCKS = 4, 8, 8, 2


def _bn(h, g, b):
    mu = jnp.mean(h, (0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(h - mu), (0, 1, 2), keepdims=True)
    return (h - mu) * lax.rsqrt(var + 1e-5) * g + b


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss(params, x):
    x = jax.nn.relu(_bn(_conv(x, params["stem"]), *params["stem_bn"]))
    for w1, n1, w2, n2 in params["blocks"]:
        h = jax.nn.relu(_bn(_conv(x, w1), *n1))
        x = jax.nn.relu(_bn(_conv(h, w2), *n2) + x)
    return jnp.mean(jnp.square(x))


def _params():
    def norm():
        return (1.0 + 0.2 * normal((C,)), 0.2 * normal((C,)))
    return {"stem": normal((3, 3, 3, C), scale=0.3), "stem_bn": norm(),
            "blocks": [(normal((3, 3, C, C), scale=0.2), norm(),
                        normal((3, 3, C, C), scale=0.2), norm()) for _ in range(BLOCKS)]}


def test_recorded_add_keeps_no_block_output_and_gradients_are_exact():
    params, x = _params(), normal((N, S, S, 3))
    fns = (transform(loss), transform(loss, residual_adds=False), loss)
    # the three gradients in one compiled program
    got, got_apart, want = jax.jit(lambda p, x: tuple(jax.grad(fn)(p, x) for fn in fns))(
        params, x)
    close(got, want)
    close(got_apart, want)
    recorded = residual_bytes(fns[0], params, x).activation_bytes
    apart = residual_bytes(fns[1], params, x).activation_bytes
    block_output, stats = N * S * S * C * 4, 2 * C * 4
    # every block output but the last feeds the next block's first conv (the stem's output,
    # a ReLU of a norm, is recorded either way); each recomputation keeps the norm's
    # mean and variance of the add's other operand instead
    assert apart - recorded >= (BLOCKS - 1) * (block_output - stats), \
        (apart, recorded, block_output)


@pytest.mark.parametrize("products", [True, False])
def test_add_of_values_without_recipes_records_nothing(products):
    """An add of plain arrays (no selective op in front) is left alone, and with products
    off nothing is recorded at all: the same residuals with and without the recording."""
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w + x) ** 2)

    w, x = normal((8, 8)), normal((4, 8))
    g = transform(f, products=products)
    before = residual_bytes(g, w, x).activation_bytes
    apart = transform(f, products=products, residual_adds=False)
    assert residual_bytes(apart, w, x).activation_bytes == before
    close(*jax.jit(lambda w, x: (jax.grad(g)(w, x), jax.grad(f)(w, x)))(w, x))


def test_recorded_add_compiled_slope_on_cpu():
    """XLA:CPU's compiled plan, not only the jaxpr's residuals: per added block, the
    converted step's temp + output bytes drop by about one f32 block output (4 B per element,
    less the statistics kept instead) with the add recorded; fusion does not undo it."""
    from jaxmem.measure import compiled_memory, slope

    n, s, c = 8, 16, 16
    elems = n * s * s * c
    x = normal((n, s, s, 3))

    def params(blocks):
        def norm():
            return (1.0 + 0.2 * normal((c,)), 0.2 * normal((c,)))
        return {"stem": normal((3, 3, 3, c), scale=0.3), "stem_bn": norm(),
                "blocks": [(normal((3, 3, c, c), scale=0.2), norm(),
                            normal((3, 3, c, c), scale=0.2), norm()) for _ in range(blocks)]}

    def per_block(**options):
        def measure(d):
            m = compiled_memory(jax.grad(transform(loss, **options)), params(d), x)
            return m.temp_bytes + m.output_bytes
        # depths 1 and 2: the second block's input is a recorded block output, as in any
        # deeper stack (the same figures per block as between depths 2 and 4: 3.996 vs 3.995)
        return slope(measure, 1) / elems

    recorded, apart = per_block(), per_block(residual_adds=False)
    assert apart - recorded >= 3.5, (apart, recorded)


def test_linen_and_nnx_convert_pass_residual_adds_on():
    """``jaxmem.linen.convert`` / ``jaxmem.nnx.convert`` take the same option: with
    ``residual_adds=False`` the converted model keeps the block outputs again (more residual
    bytes), with the same gradients either way; a non-bool is a ``TypeError``."""
    import flax.linen as nn
    from flax import nnx

    import jaxmem

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            p = self.param("p", lambda k: _params())
            return loss(p, x)

    x = normal((N, S, S, 3))
    net = Net()
    # compiled programs (op by op, every conv / norm op compiles on its own): the init, and
    # the gradients of the untouched and both converted models together
    v = jax.jit(net.init)(jax.random.key(0), x)
    on, off = jaxmem.linen.convert(net), jaxmem.linen.convert(net, residual_adds=False)
    want, got_on, got_off = jax.jit(lambda v: tuple(
        jax.grad(lambda v, m=m: m.apply(v, x))(v) for m in (net, on, off)))(v)
    close(got_on, want)
    close(got_off, want)

    def kept(m):
        return residual_bytes(lambda v: m.apply(v, x), v).activation_bytes

    assert kept(off) - kept(on) >= (BLOCKS - 1) * N * S * S * C * 4 // 2

    class NnxNet(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(_params())

        def __call__(self, x):
            return loss(self.p.value, x)

    def nnx_kept(**options):
        m = jaxmem.nnx.convert(NnxNet(), **options)
        graphdef, state = nnx.split(m)
        return residual_bytes(lambda s: nnx.merge(graphdef, s)(x), state).activation_bytes

    assert nnx_kept(residual_adds=False) > nnx_kept()
    for convert, model in ((jaxmem.linen.convert, net), (jaxmem.nnx.convert, NnxNet())):
        with pytest.raises(TypeError, match="residual_adds"):
            convert(model, residual_adds=1)
    with pytest.raises(TypeError, match="residual_adds"):
        transform(loss, residual_adds="no")
