"""Memory claims of jaxmem.selective, pinned at the residual level (exact bytes) and at the
compiled level (compiled-bytes slope per added layer, two depths)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from _data import normal
from _lazy import once
from jax import lax

import jaxmem.selective as S
from jaxmem.measure import compiled_memory, residual_bytes, slope

CT = once(lambda: normal(7, (6, 10)))


def _named(report, what):
    return [e for e in report.entries if what in str(e.source)]


# --------------------------------------------------------------------------- residuals
def test_dense_saves_input_only_for_weight_grad():
    x, w = normal(0, (6, 8)), normal(1, (8, 10))
    f = lambda x, w: jnp.sum(S.dense(x * 2.0, w) * CT())  # input is an intermediate
    only_x = residual_bytes(f, x, w, argnums=0)
    only_w = residual_bytes(f, x, w, argnums=1)
    assert only_x.activation_bytes == 0  # needs W (an argument) only
    assert only_w.activation_bytes == x.size * 4  # exactly the layer input
    assert _named(only_w, "jaxmem.selective.dense.input")


def test_default_jax_relu_keeps_more_than_one_bit():
    x = normal(0, (64, 64))
    ours = residual_bytes(lambda x: jnp.sum(S.relu(x * 2.0)), x).activation_bytes
    jaxs = residual_bytes(lambda x: jnp.sum(jax.nn.relu(x * 2.0)), x).activation_bytes
    assert ours == math.ceil(x.size / 8)  # 1 bit per element, packed
    assert jaxs >= x.size  # bool mask (+ zeros) in plain JAX


@pytest.mark.parametrize("argnums,expected", [
    ((0,), lambda n, c: n * c * 4 + 2 * n * 4 + c * 4),  # x, mu, rstd (+ scale reshape)
    ((1,), lambda n, c: n * c * 4 + 2 * n * 4),  # x, mu, rstd
    ((2,), lambda n, c: 0),  # bias only: nothing
])
def test_layer_norm_residual_bytes(argnums, expected):
    x, s, b = normal(0, (6, 10)), jnp.ones(10), jnp.zeros(10)
    r = residual_bytes(lambda x, s, b: jnp.sum(S.layer_norm(x, s, b) * CT()), x, s, b,
                       argnums=argnums)
    assert r.activation_bytes == expected(6, 10)


def test_norm_stores_at_most_one_input_sized_tensor():
    x = normal(0, (4, 8, 8, 16))
    ct = normal(3, x.shape)
    f = lambda x: jnp.sum(S.batch_norm(x * 1.5, train=True)[0] * ct)
    big = [e for e in residual_bytes(f, x).entries
           if e.kind == "activation" and e.nbytes >= x.nbytes]
    assert len(big) == 1, big


def test_max_pool_saves_packed_positions():
    x = normal(0, (2, 16, 16, 4))
    r = residual_bytes(lambda x: jnp.sum(S.max_pool(x * 2.0, (3, 3), (2, 2), "SAME")), x)
    out = 2 * 8 * 8 * 4
    assert r.activation_bytes == math.ceil(out * 4 / 8)  # 9 positions -> 4 bits each


def test_dropout_saves_only_the_key():
    x = normal(0, (6, 10))
    r = residual_bytes(lambda x: jnp.sum(S.dropout(jax.random.key(1), x * 2.0, 0.5) * CT()), x)
    assert r.activation_bytes <= 16


def test_residual_structure_same_under_scan():
    """Inside lax.scan, the saved residuals (not the structure bookkeeping) stay minimal."""
    w = normal(1, (8, 8))

    def loss(x):
        def body(h, _):
            return S.relu(S.dense(h, w)), None
        h, _ = lax.scan(body, x, None, length=3)
        return jnp.sum(h)
    x = normal(0, (16, 8))
    r = residual_bytes(loss, x)
    # per step: a packed mask (16*8/8 bytes); W is a closed-over constant
    assert r.activation_bytes <= 3 * 16 + 64, r


# ----------------------------------------------------------------- compiled-bytes slopes
E = 8 * 32 * 32 * 8  # elements of one activation in the chains below
KERNEL = 3 * 3 * 8 * 8 * 4 / E  # one copy of a kernel, per element


def _chain(layer, depth):
    def loss(x, ws):
        for i in range(depth):
            x = layer(x, ws[i])
        return jnp.sum(x * x)
    return loss


def _compiled_slope(layer, make_w, argnums=0, depth=3):
    def measure(d):
        x = normal(0, (8, 32, 32, 8))
        ws = [make_w(i) for i in range(d)]
        c = compiled_memory(jax.grad(_chain(layer, d), argnums), x, ws)
        return c.temp_bytes + c.output_bytes
    return slope(measure, depth) / E  # bytes per element per added layer


def _kernel(i):
    return normal((1, i), (3, 3, 8, 8), 0.2)


def _lax_conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_relu_slope_is_one_eighth_byte():
    """Frozen conv + relu, input differentiated: 1/8 B per element per layer (the packed
    mask) where plain JAX keeps >= 4 B (the conv input / relu output)."""
    ours = _compiled_slope(lambda x, w: S.relu(S.conv(x, w)), _kernel)
    jaxs = _compiled_slope(lambda x, w: jax.nn.relu(_lax_conv(x, w)), _kernel)
    assert ours <= 0.125 + KERNEL + 0.01, ours  # + the flipped kernel copy XLA keeps
    assert jaxs >= 4.0, jaxs


@pytest.mark.xla_cpu  # XLA:GPU plans differently: benchmarks/gpu, README
def test_batch_norm_slope_one_tensor():
    """Frozen conv + train-mode BN, input differentiated: one f32 tensor per layer."""
    bn = lambda x, w: S.batch_norm(S.conv(x, w), train=True)[0]
    ours = _compiled_slope(bn, _kernel)
    assert ours <= 4.0 + KERNEL + 0.01, ours


def test_max_pool_slope_packed_codes():
    """Stride-1 2x2 'SAME' pooling chain: 4 positions -> 2 bits per element per layer."""
    pool = lambda x, w: S.max_pool(x, (2, 2), (1, 1), "SAME") * w
    ours = _compiled_slope(pool, lambda i: jnp.float32(1.0 + i / 10))
    assert ours <= 0.25 + 0.05, ours


def test_dropout_regenerated_not_merged_with_the_forward():
    """Pre-norm blocks with two residual dropouts under ``jaxmem.transform``: the backward
    draws each mask from a key tied to the cotangent; untied, XLA:CPU merged that draw with
    the forward's and kept the bits (measured 32.1 B per residual-stream element and block,
    16.1 B tied). The H100 plan: ``parity_tests/gpu_plan/test_gpu_plan_dropout.py``."""
    from _dropout_blocks import D, R, args, loss

    from jaxmem.transform import transform

    g = jax.jit(jax.grad(transform(loss)))
    per_elem = slope(lambda d: compiled_memory(g, *args(d)).temp_bytes, 2) / (R * D)
    assert per_elem <= 20.0, per_elem
