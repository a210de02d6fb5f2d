"""jaxmem.planner.offload: host offload of a chunk's residuals, exact values and gradients."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import Offloadable, Saveable

from jaxmem import models
from jaxmem._compat import core, prng
from jaxmem.planner import offload as O
from jaxmem.planner import trace as T

PLATFORM = jax.devices()[0].platform


def _layer(w, x):
    return jnp.tanh(x @ w)


def _gelu_layer(w, x):
    return jax.nn.gelu(x @ w, approximate=False) * 0.5


def _mlp_loss(wrap, layer=_layer):
    def loss(ws, x):
        for w in ws:
            x = wrap(layer)(w, x)
        return jnp.sum(x ** 2) / x.size

    return loss


def _weights(key, depth, d, dtype=jnp.float32):
    ks = jax.random.split(key, depth + 1)
    ws = [(jax.random.normal(k, (d, d)) / math.sqrt(d)).astype(dtype) for k in ks[:-1]]
    return ws, ks[-1]


def _assert_tree_close(a, b, rtol, atol=0.0):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol)


def _compile_or_skip(f, *args):
    """Compile ``f``; on a backend other than CPU (where offload is measured to compile) a
    compile error skips with its message."""
    try:
        return jax.jit(f).lower(*args).compile()
    except Exception as e:
        if PLATFORM == "cpu":
            raise
        pytest.skip(f"offload does not compile on {PLATFORM}: {type(e).__name__}: {e}")


# --- detection -------------------------------------------------------------------------------

def test_detection_on_this_backend():
    ok, why = O.offload_available()
    d = jax.devices()[0]
    assert O.offload_available(d) == (ok, why)
    assert isinstance(why, str) and why
    if PLATFORM == "cpu":
        assert not ok
        assert why == "CPU: host memory is the device memory; offloading saves nothing"
        assert O.host_offload_kind() is None
        assert "pinned_host" in [m.kind for m in d.addressable_memories()]
    else:
        assert ok == (O.host_offload_kind(d) == "pinned_host")
        assert why.startswith(f"{PLATFORM}: ")


def test_bad_arguments_raise_named_errors():
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        O.offload_available("cpu")
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        O.host_offload_kind(0)
    with pytest.raises(ValueError, match=r"dst must be 'pinned_host'.*'unpinned_host'"):
        O.offload_policy("unpinned_host")
    with pytest.raises(ValueError, match="dst must be 'pinned_host'"):
        O.offload_chunk(_layer, dst=None)
    with pytest.raises(TypeError, match="only_dots must be a bool, got 1"):
        O.offload_policy(only_dots=1)
    with pytest.raises(TypeError, match="f must be callable"):
        O.offload_chunk(3)
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
        O.transfer_seconds(1e6, bandwidth=0)
    with pytest.raises(ValueError, match="residual_bytes must be a finite number >= 0"):
        O.transfer_seconds(-1)
    with pytest.raises(ValueError, match="arrays must be an int >= 0"):
        O.transfer_seconds(1e6, arrays=1.5)

    class NoStats:
        def memory_analysis(self):
            return None

    with pytest.raises(ValueError, match="memory_analysis"):
        O.compiled_bytes(NoStats())


def test_transfer_seconds_is_bytes_over_bandwidth_both_ways():
    assert O.transfer_seconds(0, latency=0) == 0.0
    assert O.transfer_seconds(2 ** 30, bandwidth=2 ** 30, latency=0) == pytest.approx(2.0)
    assert O.transfer_seconds(1e9, bandwidth=25e9, latency=1e-5, arrays=4) == pytest.approx(
        2 * (4 * 1e-5 + 1e9 / 25e9))
    assert O.transfer_seconds(np.int64(10), bandwidth=np.float32(10), latency=0) == 2.0


# --- residual placement (jaxpr level: any backend) -----------------------------------------

def test_policy_moves_every_inner_residual_to_host():
    ws, kx = _weights(jax.random.key(0), 1, 16)
    x = jax.random.normal(kx, (8, 16))
    plain = O.residual_bytes(_gelu_layer, ws[0], x)
    off = O.residual_bytes(O.offload_chunk(_gelu_layer), ws[0], x)
    assert plain["host"] == 0 and plain["device"] > 0
    assert off["device"] == 0 and off["host"] > 0
    assert off["arguments"] == plain["arguments"] == (16 * 16 + 8 * 16) * 4
    dots = O.residual_bytes(O.offload_chunk(_gelu_layer, only_dots=True), ws[0], x)
    assert dots == {"arguments": off["arguments"], "device": 0, "host": 8 * 16 * 4}


def test_keys_and_host_values_stay_put_and_dropout_is_exact():
    def drop(w, x, seed):
        key = jax.random.fold_in(jax.random.key(seed), 3)
        keep = jax.random.bernoulli(key, 0.75, x.shape)
        return jnp.where(keep, jax.nn.relu(x @ w), 0.0) / 0.75

    ws, kx = _weights(jax.random.key(1), 1, 16)
    x = jax.random.normal(kx, (8, 16))
    pol = O.offload_policy()
    f32, u32 = core.ShapedArray((8,), jnp.float32), core.ShapedArray((2,), jnp.uint32)
    key = jax.typeof(jax.random.key(0))
    assert pol(lax.tanh_p, f32) == Offloadable(src="device", dst="pinned_host")
    assert pol(prng.random_wrap_p, u32) is Saveable       # makes a key from uint32 data
    assert pol(prng.random_bits_p, key) is Saveable       # reads a key
    host = core.ShapedArray((8,), jnp.float32, memory_space=core.MemorySpace.Host)
    assert pol(lax.exp_p, host) is Saveable               # source is already host memory

    def loss(f):
        return lambda w, x: jnp.sum(f(w, x, 5) ** 2)

    ref = jax.jit(jax.value_and_grad(loss(drop), argnums=(0, 1)))(ws[0], x)
    got = jax.jit(jax.value_and_grad(loss(O.offload_chunk(drop)), argnums=(0, 1)))(ws[0], x)
    _assert_tree_close(got, ref, rtol=1e-5, atol=1e-7)


# --- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("layer,only_dots", [(_layer, False), (_gelu_layer, False),
                                             (_gelu_layer, True)],
                         ids=["tanh", "gelu", "gelu-only-dots"])
def test_offloaded_mlp_values_and_gradients_exact(layer, only_dots):
    ws, kx = _weights(jax.random.key(2), 3, 32)
    x = jax.random.normal(kx, (16, 32))
    plain = jax.value_and_grad(_mlp_loss(lambda f: f, layer), argnums=(0, 1))
    off = jax.value_and_grad(_mlp_loss(lambda f: O.offload_chunk(f, only_dots=only_dots), layer),
                             argnums=(0, 1))
    compiled = _compile_or_skip(off, ws, x)
    _assert_tree_close(compiled(ws, x), jax.jit(plain)(ws, x), rtol=1e-5, atol=1e-7)
    if layer is _layer:  # and against a float64 reference
        with jax.enable_x64(True):
            ref = jax.jit(plain)([np.asarray(w, np.float64) for w in ws], np.asarray(x, np.float64))
        _assert_tree_close(compiled(ws, x), jax.tree_util.tree_map(
            lambda a: np.asarray(a, np.float32), ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_offloaded_low_precision_matches_untouched(dtype):
    ws, kx = _weights(jax.random.key(3), 2, 32, dtype)
    x = jax.random.normal(kx, (16, 32)).astype(dtype)
    plain = jax.value_and_grad(_mlp_loss(lambda f: f), argnums=(0, 1))
    off = jax.value_and_grad(_mlp_loss(O.offload_chunk), argnums=(0, 1))
    compiled = _compile_or_skip(off, ws, x)
    got, ref = compiled(ws, x), jax.jit(plain)(ws, x)
    assert all(a.dtype == dtype for a in jax.tree_util.tree_leaves(got))
    _assert_tree_close(got, ref, rtol=1e-2, atol=1e-3)


def test_offload_under_vmap_scan_and_checkpoint():
    ws, kx = _weights(jax.random.key(4), 1, 8)
    w = ws[0]
    xs = jax.random.normal(kx, (3, 4, 8))
    f = O.offload_chunk(_layer)

    def per_example(g):
        return jax.vmap(jax.grad(lambda w, x: jnp.sum(g(w, x) ** 2)), in_axes=(None, 0))

    _assert_tree_close(jax.jit(per_example(f))(w, xs), jax.jit(per_example(_layer))(w, xs),
                       rtol=1e-5, atol=1e-7)

    def scanned(g):
        def loss(w, xs):
            def body(c, x):
                return c + jnp.sum(g(w, x) ** 2), None

            return lax.scan(body, 0.0, xs)[0]

        return jax.value_and_grad(loss)

    _assert_tree_close(jax.jit(scanned(f))(w, xs), jax.jit(scanned(_layer))(w, xs), rtol=1e-5,
                       atol=1e-7)
    outer = jax.checkpoint(lambda w, x: f(w, f(w, x)))
    _assert_tree_close(jax.jit(jax.grad(lambda w: jnp.sum(outer(w, xs[0]))))(w),
                       jax.jit(jax.grad(lambda w: jnp.sum(_layer(w, _layer(w, xs[0])))))(w),
                       rtol=1e-5, atol=1e-7)


def test_offload_on_flax_chunks_of_a_traced_loss():
    """Offload every unit of a traced Flax loss (what a unit option ``offload`` runs)."""
    m = models.MLP(features=(16, 16, 4), activation="gelu")
    tok = jax.random.normal(jax.random.key(5), (4, 8))
    params = jax.jit(m.init)(jax.random.key(6), tok)["params"]

    def loss(p, t):
        return jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, t))[..., 0] ** 2)

    tr = T.trace(loss, (params, tok))
    units = T.choose_units(tr)
    assert len(units) >= 3

    def offloaded(p, t):
        flat = jax.tree_util.tree_leaves((p, t))
        jaxpr = tr.closed.jaxpr
        env = dict(zip(jaxpr.constvars, tr.closed.consts))
        env.update(zip(jaxpr.invars, flat))
        for u in units:
            ins, outs = T.chunk_io(jaxpr, u.start, u.stop)
            vals = O.offload_chunk(T.chunk_fn(jaxpr, u.start, u.stop, ins, outs),
                                   only_dots=False)(*[env[v] for v in ins])
            env.update(zip(outs, vals))
        return env[jaxpr.outvars[0]]

    ref = jax.jit(jax.value_and_grad(loss))(params, tok)
    got = jax.jit(jax.value_and_grad(offloaded))(params, tok)
    _assert_tree_close(got, ref, rtol=1e-5, atol=1e-7)
    res = O.residual_bytes(lambda p: offloaded(p, tok), params)
    assert res["host"] > 0


# --- compiled bytes ---------------------------------------------------------------------------

def test_compiled_bytes_on_cpu_offload_moves_nothing_to_host():
    """On CPU the host copies lower to nothing: no host bytes, no placement annotations; the
    device keeps what the chunk's VJP keeps (its residuals are a custom_vjp's, so the program
    is not the untouched one, but it keeps no more than every residual of every layer)."""
    if PLATFORM != "cpu":
        pytest.skip(f"device/host figures on {PLATFORM} are not measured by this test")
    ws, kx = _weights(jax.random.key(7), 4, 64)
    x = jax.random.normal(kx, (32, 64))
    plain = jax.jit(jax.value_and_grad(_mlp_loss(lambda f: f))).lower(ws, x).compile()
    ref = O.compiled_bytes(plain)
    m = plain.memory_analysis()
    assert ref["device"] == (m.argument_size_in_bytes + m.output_size_in_bytes
                             + m.temp_size_in_bytes - m.alias_size_in_bytes)
    for only_dots in (False, True):
        off = jax.jit(jax.value_and_grad(_mlp_loss(
            lambda f, d=only_dots: O.offload_chunk(f, only_dots=d)))).lower(ws, x).compile()
        got = O.compiled_bytes(off)
        assert got["host"] == 0
        # every layer's input, pre-activation and tanh' kept at once, beside the plain step
        assert got["device"] <= ref["device"] + 3 * 4 * x.size * 4
        assert "annotate_device_placement" not in off.as_text()
