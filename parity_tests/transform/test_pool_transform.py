"""Max pools (``reduce_window`` max, however spelled: ``flax.linen.max_pool``,
``nnx.max_pool``, ``lax.reduce_window(x, -inf, lax.max, ...)`` on any axes) become
``jaxmem.selective.max_pool``: the same outputs, the same gradients as JAX's own (ties
included: a window of equal values sends its gradient to its first element), argmax codes
kept instead of the input.  Min pools, dilated windows and integer inputs stay, with a
reason; ``pools=False`` leaves every pool."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxmem.measure import compiled_memory, gpu_plan_available, residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal


def _ties(shape, dtype=jnp.float32):
    """Values on a coarse grid (many equal values), half of them negative: after a ReLU,
    whole windows of zeros."""
    return (jnp.round(normal(shape) * 2.0) / 2.0).astype(dtype)


def _rw(window, strides, padding):
    return lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)


#: name -> (pool, input shape, window positions' bits)
POOLS = {
    "linen 3x3/2 SAME": (lambda x: nn.max_pool(x, (3, 3), (2, 2), "SAME"), (2, 9, 9, 4)),
    "linen 2x2/2 VALID": (lambda x: nn.max_pool(x, (2, 2), (2, 2), "VALID"), (2, 8, 8, 3)),
    "linen 3x3/1 explicit pads": (lambda x: nn.max_pool(x, (3, 3), (1, 1), ((1, 0), (2, 1))),
                                  (2, 7, 6, 2)),
    "nnx 2x2/2": (lambda x: nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2)),
                  (3, 8, 8, 2)),
    "linen 1-D 3/2 SAME": (lambda x: nn.max_pool(x, (3,), (2,), "SAME"), (2, 11, 4)),
    "lax NCHW 3x3/2 padded": (_rw((1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (0, 2))),
                              (2, 3, 9, 8)),
    "lax axes 1 and 3": (_rw((1, 3, 1, 2), (1, 2, 1, 1), "SAME"), (2, 7, 3, 6)),
    "lax 2-D array": (_rw((2, 2), (2, 2), "VALID"), (6, 8)),
}


def _loss(pool):
    def f(w, x):
        h = jax.nn.relu(x * w)
        return jnp.sum(jnp.sin(pool(h)) * (1.0 + jnp.cos(pool(h))))
    return f


def _pool_rows(g, *a):
    return g.report(*a).by_kind("pool")


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool_is_exact_with_ties(name):
    pool, shape = POOLS[name]
    f = _loss(pool)
    g = transform(f)
    w, x = jnp.float32(1.0), _ties(shape)
    # one compiled program for both sides (not one per eager op)
    both = jax.jit(lambda w, x: ((g(w, x), jax.grad(g, (1, 0))(w, x)),
                                 (f(w, x), jax.grad(f, (1, 0))(w, x))))
    (gv, (gx, gw)), (fv, (fx, fw)) = both(w, x)
    close(gv, fv)
    # exactly JAX's own gradient: the same positions receive the same sums
    np.testing.assert_array_equal(np.asarray(gx) != 0, np.asarray(fx) != 0)
    close(gx, fx)
    close(gw, fw)
    rows = _pool_rows(g, w, x)
    assert [r.converted for r in rows] == [True, True], rows
    assert all(r.became == "jaxmem.selective.max_pool" for r in rows)
    assert "test_pool_transform" in rows[0].where or "pooling.py" in rows[0].where


def test_all_equal_windows_send_the_gradient_to_their_first_element():
    x = jnp.zeros((1, 4, 4, 1))
    dy = jnp.arange(1.0, 5.0).reshape(1, 2, 2, 1)

    def f(x):
        return jnp.sum(nn.max_pool(x, (3, 3), (2, 2), "SAME") * dy)

    got, want = jax.jit(lambda x: (jax.grad(transform(f))(x), jax.grad(f)(x)))(x)
    np.testing.assert_array_equal(got, want)
    assert int(jnp.sum(want != 0)) == 4


def test_float64_is_exact(x64):
    with x64("float64"):
        pool = POOLS["linen 3x3/2 SAME"][0]
        f = _loss(pool)
        w, x = jnp.float64(1.0), _ties((2, 9, 9, 4), jnp.float64)
        g = transform(f)
        v, got, want = jax.jit(lambda w, x: (g(w, x), jax.grad(g, (0, 1))(w, x),
                                             jax.grad(f, (0, 1))(w, x)))(w, x)
        assert v.dtype == jnp.float64
        close(got, want, rtol=1e-12, atol=1e-12)


def test_bfloat16():
    pool = POOLS["linen 3x3/2 SAME"][0]
    f = _loss(pool)
    g = transform(f)
    w, x = jnp.bfloat16(1.0), _ties((2, 9, 9, 4), jnp.bfloat16)
    gv, fv, gx, fx = jax.jit(lambda w, x: (g(w, x), f(w, x), jax.grad(g, 1)(w, x),
                                           jax.grad(f, 1)(w, x)))(w, x)
    assert gv.dtype == jnp.bfloat16
    close(gv.astype(jnp.float32), fv.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    assert gx.dtype == jnp.bfloat16
    # overlapping windows sum in another order: bf16 rounding only
    close(gx.astype(jnp.float32), fx.astype(jnp.float32), rtol=2e-2, atol=2e-2)
    assert [r.converted for r in _pool_rows(g, w, x)] == [True, True]


def test_under_jit_vmap_scan_checkpoint_and_second_order():
    pool = POOLS["linen 3x3/2 SAME"][0]
    w = jnp.float32(1.0)
    xs = _ties((3, 2, 9, 9, 4))

    def f(w, x):
        return jnp.sum(jnp.sin(pool(jax.nn.relu(x * w))))

    def scanned(w, xs):
        def step(c, x):
            return c + jax.checkpoint(f)(w, x), None
        return lax.scan(step, 0.0, xs)[0]

    g_scan = transform(scanned)
    # values and gradients of both sides: one compiled program
    got, want = jax.jit(lambda w, xs: tuple((fn(w, xs), jax.grad(fn, (0, 1))(w, xs))
                                            for fn in (g_scan, scanned)))(w, xs)
    close(got, want)
    assert {r.path for r in _pool_rows(g_scan, w, xs)} == {"scan/remat2"}

    g = transform(f)

    def uses(fn, remat, w, xs):  # per-example gradients, grad of a vmap, grad of grad
        return (jax.vmap(jax.grad(fn, 1), in_axes=(None, 0))(w, xs),
                jax.grad(lambda w, xs: jnp.sum(jax.vmap(fn, (None, 0))(w, xs)))(w, xs),
                jax.grad(remat(fn), 1)(w, xs[0]),
                jax.grad(jax.grad(fn))(w, xs[0]))

    # one compiled program for both sides (not one per eager op)
    got, want = jax.jit(lambda w, xs: (uses(g, jax.checkpoint, w, xs),
                                       uses(f, lambda fn: fn, w, xs)))(w, xs)
    close(got[:3], want[:3])
    # the transformed function inside the caller's checkpoint and grad of grad in w
    close(got[3], want[3], rtol=1e-4)


def test_generic_reduce_window_with_a_max_body():
    """``lax.reduce_window`` with a ``jnp`` array as initial value (under ``jit``) emits the
    generic ``reduce_window`` primitive, which JAX cannot differentiate; re-emitted, it has
    ``reduce_window_max``'s forward and gradient."""
    body = jax.jit(lambda x: lax.reduce_window(x, jnp.array(-jnp.inf), lax.max, (1, 3, 3, 1),
                                               (1, 2, 2, 1), "SAME"))
    known = POOLS["linen 3x3/2 SAME"][0]
    f, ref = _loss(body), _loss(known)
    w, x = jnp.float32(1.0), _ties((2, 9, 9, 4))
    with pytest.raises(ValueError):
        jax.grad(f, 1)(w, x)
    g = transform(f)
    # one compiled program per side: value and gradients (not one compile per eager op)
    both = lambda fn: jax.jit(lambda w, x: (fn(w, x), jax.grad(fn, (0, 1))(w, x)))(w, x)
    (vg, gg), (vr, gr) = both(g), both(ref)
    close(vg, vr)
    close(gg, gr)
    rows = _pool_rows(g, w, x)
    assert [r.converted for r in rows] == [True, True]
    assert "generic reduce_window" in rows[0].reason


def test_what_stays_and_why():
    x = normal((2, 8, 8, 3))

    def f(x):
        a = lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        b = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID",
                              window_dilation=(1, 2, 2, 1))
        i = lax.reduce_window(jnp.round(x * 4).astype(jnp.int32), np.int32(-2**31), lax.max,
                              (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        c = jax.jit(lambda x: lax.reduce_window(x, jnp.array(0.0), lax.max, (1, 2, 2, 1),
                                                (1, 2, 2, 1), "VALID"))(x)
        return jnp.sum(a ** 2) + jnp.sum(b ** 2) + jnp.sum(i) + jnp.sum(c)

    g = transform(f)
    close(*jax.jit(lambda x: (g(x), f(x)))(x))
    rows = _pool_rows(g, x)
    assert not [r for r in rows if r.converted]
    reasons = " | ".join(r.reason for r in rows)
    for word in ("min pool", "dilated", "integer", "initial value is not -inf"):
        assert word in reasons, reasons
    # a max reduce_window with another initial value is not differentiable in JAX: grad of
    # the rest only
    h = lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) ** 2)
    off = transform(h, pools=False)
    assert not _pool_rows(off, x)
    close(*jax.jit(lambda x: (jax.grad(off)(x), jax.grad(h)(x)))(x))
    with pytest.raises(TypeError):
        transform(h, pools=1)


def _pool_net(w, x):
    """conv -> relu -> 3x3/2 max pool -> mean: the pool's input is what autodiff keeps."""
    h = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(jnp.sin(nn.max_pool(jax.nn.relu(h), (3, 3), (2, 2), "SAME")))


def _pool_args():
    return normal((3, 3, 8, 32), scale=0.2), normal((8, 32, 32, 8))


def test_residuals_hold_codes_not_the_input():
    w, x = _pool_args()
    pool_in = (8, 32, 32, 32)

    def kept(fn):
        return [e for e in residual_bytes(fn, w, x, argnums=1).entries
                if tuple(e.shape) == pool_in and str(e.dtype) == "float32"]

    assert kept(_pool_net)
    assert not kept(transform(_pool_net))


@pytest.mark.xla_cpu
def test_compiled_step_is_smaller_on_cpu():
    w, x = _pool_args()
    step = lambda fn: jax.grad(fn, (0, 1))
    base = compiled_memory(step(_pool_net), w, x).temp_bytes
    mine = compiled_memory(step(transform(_pool_net)), w, x).temp_bytes
    assert mine < 0.8 * base, (mine, base)
    # the pool alone accounts for it
    other = compiled_memory(step(transform(_pool_net, pools=False)), w, x).temp_bytes
    assert mine < other, (mine, other)


@pytest.mark.skipif(not gpu_plan_available(),
                    reason="the CUDA PJRT plugin for GPU plans is not installed")
def test_compiled_step_is_smaller_on_the_h100_plan():
    w, x = _pool_args()
    step = lambda fn: jax.grad(fn, (0, 1))
    base = compiled_memory(step(_pool_net), w, x, target="h100").temp_bytes
    mine = compiled_memory(step(transform(_pool_net)), w, x, target="h100").temp_bytes
    other = compiled_memory(step(transform(_pool_net, pools=False)), w, x,
                            target="h100").temp_bytes
    assert mine < 0.8 * base, (mine, base)
    assert mine < other, (mine, other)
