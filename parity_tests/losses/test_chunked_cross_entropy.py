"""jaxmem.losses.chunked_softmax_cross_entropy: optax's head + cross-entropy, a chunk of
tokens at a time -- the same losses and gradients (float64 reference, torch beside), under
JAX's transformations, and a step that keeps no ``tokens x vocab`` array (compiled bytes on
XLA:CPU and on the H100 plan)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assert import assert_tree_close, scaled_atol

from jaxmem.losses import chunked_softmax_cross_entropy as chunked
from jaxmem.measure import compiled_memory, gpu_plan_available

N_LEAD, D, V = (3, 50), 16, 37     # 150 tokens: chunks of 32 leave a remainder of 22


def _data(dtype=jnp.float32, seed=0, lead=N_LEAD, d=D, v=V):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (*lead, d), dtype)
    w = (jax.random.normal(k[1], (d, v)) / np.sqrt(d)).astype(dtype)
    b = jax.random.normal(k[2], (v,), dtype)
    y = jax.random.randint(k[3], lead, 0, v)
    return h, w, b, y


def _ref(h, w, b, y):
    return optax.softmax_cross_entropy_with_integer_labels(h @ w + b, y)


def _mean_loss(fn, y, **kw):
    return lambda h, w, b: jnp.mean(fn(h, w, b, y, **kw) ** 2)   # a non-uniform cotangent


def _chunked(h, w, b, y, chunk_size=32):
    return chunked(h, w, y, bias=b, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [32, 50, 4096])
def test_losses_and_gradients_equal_optax_and_float64(chunk_size):
    """Every chunking (a remainder, an exact multiple, one chunk) gives optax's
    per-token losses and gradients w.r.t. features, weight and bias (float32, rtol 1e-5), and
    both are within float32 rounding of the float64 head."""
    h, w, b, y = _data()
    got = jax.jit(lambda h, w, b: _chunked(h, w, b, y, chunk_size))(h, w, b)
    want = _ref(h, w, b, y)
    assert got.shape == y.shape and got.dtype == jnp.float32
    assert_tree_close(got, want, rtol=1e-5, atol=scaled_atol(1e-6))
    g_got = jax.jit(jax.grad(_mean_loss(_chunked, y, chunk_size=chunk_size), (0, 1, 2)))(h, w, b)
    g_want = jax.grad(_mean_loss(_ref, y), (0, 1, 2))(h, w, b)
    assert_tree_close(g_got, g_want, rtol=1e-5, atol=scaled_atol(1e-6))
    with jax.enable_x64(True):
        h64, w64, b64 = (np.asarray(a, np.float64) for a in (h, w, b))
        g64 = jax.grad(_mean_loss(_ref, y), (0, 1, 2))(h64, w64, b64)
        assert_tree_close(g_got, g64, rtol=1e-5, atol=scaled_atol(1e-6))


def test_without_bias_and_tied_embedding():
    """No bias; a head tied to a ``(vocab, d)`` embedding passed as ``embedding.T``: the
    embedding's gradient equals the unchunked head's."""
    h, w, _, y = _data(seed=1)
    emb = w.T

    def ref(h, e):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ e.T, y))

    def got(h, e):
        return jnp.mean(chunked(h, e.T, y, chunk_size=16))

    assert_tree_close(jax.jit(jax.value_and_grad(got, (0, 1)))(h, emb),
                      jax.value_and_grad(ref, (0, 1))(h, emb), rtol=1e-5,
                      atol=scaled_atol(1e-6))


def test_under_vmap_scan_checkpoint_and_second_order():
    """``vmap`` over a batch of heads, inside ``lax.scan`` and ``jax.checkpoint``, and a
    Hessian-vector product: the same as the unchunked head under the same transformation."""
    h, w, b, y = _data(seed=2)
    hs = jnp.stack([h, 2 * h])
    ys = jnp.stack([y, y[::-1]])
    vm = jax.vmap(lambda h, y: chunked(h, w, y, bias=b, chunk_size=32))(hs, ys)
    assert_tree_close(vm, jax.vmap(lambda h, y: _ref(h, w, b, y))(hs, ys), rtol=1e-5,
                      atol=scaled_atol(1e-6))

    def scanned(fn):
        def loss(w):
            def body(c, hy):
                return c + jnp.sum(jax.checkpoint(fn)(hy[0], w, b, hy[1])), None
            return jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ys))[0]
        return loss

    assert_tree_close(jax.jit(jax.grad(scanned(_chunked)))(w), jax.grad(scanned(_ref))(w),
                      rtol=1e-5, atol=scaled_atol(1e-6))
    v = jax.random.normal(jax.random.key(9), h.shape)

    def hvp(fn):
        g = jax.grad(lambda h: jnp.sum(fn(h, w, b, y)))
        return jax.jvp(g, (h,), (v,))[1]

    assert_tree_close(jax.jit(lambda: hvp(_chunked))(), hvp(_ref), rtol=1e-4,
                      atol=scaled_atol(1e-5))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_as_optax_computes_it(dtype):
    """bf16/f16 inputs: losses in that dtype, computed as optax does in it -- within the
    dtype's rounding of optax's (2^-7 / 2^-10 relative, a few ulps of the log-normaliser),
    and the gradients too."""
    h, w, b, y = _data(dtype, seed=3)
    got = jax.jit(lambda h, w, b: _chunked(h, w, b, y))(h, w, b)
    assert got.dtype == dtype
    eps = float(jnp.finfo(dtype).eps)
    f32 = [np.asarray(a, np.float32) for a in (got, _ref(h, w, b, y))]
    assert_tree_close(f32[0], f32[1], rtol=4 * eps, atol=scaled_atol(4 * eps))
    g = jax.jit(jax.grad(_mean_loss(_chunked, y), (0, 1, 2)))(h, w, b)
    g_ref = jax.grad(_mean_loss(_ref, y), (0, 1, 2))(h, w, b)
    assert all(a.dtype == dtype for a in g)
    assert_tree_close(jax.tree.map(lambda a: np.asarray(a, np.float32), g),
                      jax.tree.map(lambda a: np.asarray(a, np.float32), g_ref),
                      rtol=8 * eps, atol=scaled_atol(8 * eps))


@pytest.mark.parametrize("reference", ["whole", "chunked"])
def test_torch_agrees_and_its_chunked_reference_saves_no_logits(reference):
    """torch (float64) -- ``F.cross_entropy`` on the whole ``h @ W + b``, and the reference
    ``torch_ref.losses.chunked_cross_entropy`` (32-token chunks under
    ``torch.utils.checkpoint``) -- gives jaxmem's losses and gradients; autograd saves no
    ``tokens x vocab`` array for the chunked reference (``torch_ref.measure.saved_bytes``)."""
    torch = pytest.importorskip("torch")
    from torch_ref.losses import chunked_cross_entropy
    from torch_ref.measure import saved_bytes

    h, w, b, y = _data(seed=4)
    th, tw, tb = (torch.tensor(np.asarray(a, np.float64), requires_grad=True)
                  for a in (h, w, b))
    ty = torch.tensor(np.asarray(y, np.int64))

    def torch_losses(th, tw, tb):
        if reference == "chunked":
            return chunked_cross_entropy(th, tw, ty, bias=tb, chunk_size=32)
        return torch.nn.functional.cross_entropy((th @ tw + tb).reshape(-1, V), ty.reshape(-1),
                                                 reduction="none").reshape(N_LEAD)

    tl = torch_losses(th, tw, tb)
    (tl ** 2).mean().backward()
    got = jax.jit(lambda h, w, b: _chunked(h, w, b, y))(h, w, b)
    g = jax.jit(jax.grad(_mean_loss(_chunked, y), (0, 1, 2)))(h, w, b)
    assert_tree_close(got, tl.detach().numpy(), rtol=1e-5, atol=scaled_atol(1e-6))
    assert_tree_close(g, [t.grad.numpy() for t in (th, tw, tb)], rtol=1e-5,
                      atol=scaled_atol(1e-6))
    logits = np.prod(N_LEAD) * V * 8
    saved = saved_bytes(lambda *a: (torch_losses(*a) ** 2).mean(), th, tw, tb)
    if reference == "chunked":
        assert saved.activation_bytes < logits / 2, (saved.activation_bytes, logits)
    else:
        assert saved.activation_bytes >= logits, (saved.activation_bytes, logits)


_TARGETS = ["cpu", pytest.param("h100", marks=pytest.mark.skipif(
    not gpu_plan_available(), reason="the H100 plan needs the CUDA PJRT plugin"))]


@pytest.mark.parametrize("target", _TARGETS)
def test_step_keeps_no_tokens_by_vocab_array(target):
    """Compiled bytes of the head's ``value_and_grad`` (1024 tokens, d 64, vocab 1024: logits
    4 MiB): the unchunked head keeps at least two ``tokens x vocab`` arrays at its peak, the
    chunked one (chunks of 128 tokens) less than one, on XLA:CPU's and on XLA:GPU's plan."""
    n, d, v = 1024, 64, 1024
    h = jax.ShapeDtypeStruct((n, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)
    logits = n * v * 4

    def temp(fn):
        return compiled_memory(jax.value_and_grad(lambda h, w, y: jnp.mean(fn(h, w, y)),
                                                  (0, 1)), h, w, y, target=target).temp_bytes

    plain = temp(lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y))
    lean = temp(lambda h, w, y: chunked(h, w, y, chunk_size=128))
    assert plain >= 2 * logits, (plain, logits)
    assert lean < logits, (lean, logits)


@pytest.mark.parametrize("kw,match", [
    ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": 2.0}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"), ({"bias": np.zeros(V + 1, np.float32)}, "bias"),
])
def test_bad_options_are_refused(kw, match):
    h, w, _, y = _data()
    with pytest.raises(ValueError, match=match):
        chunked(h, w, y, **kw)


def test_bad_shapes_and_dtypes_are_refused():
    h, w, _, y = _data()
    with pytest.raises(ValueError, match=r"\(d, vocab\)"):
        chunked(h, w.T, y)
    with pytest.raises(ValueError, match="labels"):
        chunked(h, w, y[:, :-1])
    with pytest.raises(TypeError, match="integers"):
        chunked(h, w, y.astype(jnp.float32))
    with pytest.raises(TypeError, match="features"):
        chunked(h.astype(jnp.int32), w, y)
    with pytest.raises(TypeError, match="weight"):
        chunked(h, w[0], y)


def test_gpt_features_feed_the_chunked_head_with_the_tied_embedding():
    """``models.gpt``'s ``features=True`` output times ``wte.embedding.T`` is its logits, and
    the chunked loss over it has the whole head's gradient w.r.t. every parameter."""
    from jaxmem import models

    m = models.gpt(n_layer=1, d_model=16, n_head=2, ctx=8, vocab=40)
    tok = jax.random.randint(jax.random.key(5), (3, 8), 0, 40)
    params = m.init(jax.random.key(6), tok)["params"]
    tgt = jnp.roll(tok, -1, axis=1)

    def whole(p):
        lg = m.apply({"params": p}, tok)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(lg, tgt))

    def lean(p):
        h = m.apply({"params": p}, tok, features=True)
        return jnp.mean(chunked(h, p["wte"]["embedding"].T, tgt, chunk_size=5))

    h = m.apply({"params": params}, tok, features=True)
    assert h.shape == (3, 8, 16)
    assert_tree_close(h @ params["wte"]["embedding"].T, m.apply({"params": params}, tok),
                      rtol=1e-5, atol=scaled_atol(1e-6))
    assert_tree_close(jax.jit(jax.value_and_grad(lean))(params),
                      jax.jit(jax.value_and_grad(whole))(params), rtol=1e-5,
                      atol=scaled_atol(1e-6))


def test_no_tokens_gives_empty_losses_and_zero_gradients():
    """Zero tokens: empty losses of the logits' dtype, and zero gradients, as optax gives."""
    h, w, b, _ = _data(lead=(0, 5))
    y = jnp.zeros((0, 5), jnp.int32)
    got = chunked(h, w, y, bias=b)
    assert got.shape == (0, 5) and got.dtype == jnp.float32
    g = jax.grad(lambda h, w, b: jnp.sum(chunked(h, w, y, bias=b)), (0, 1, 2))(h, w, b)
    g_ref = jax.grad(lambda h, w, b: jnp.sum(_ref(h, w, b, y)), (0, 1, 2))(h, w, b)
    assert_tree_close(g, g_ref, rtol=0, atol=0)


def test_half_precision_weight_gradient_is_summed_over_chunks_in_float32():
    """A bf16 head in 64 chunks: ``dW`` is the chunks' sum in float32, rounded to bf16 once
    (as one product over all rows rounds it), so it differs from the unchunked head's by about
    bf16's rounding (normwise 0.25 % here); summed in bf16 chunk by chunk it would be 0.96 %."""
    k = jax.random.split(jax.random.key(3), 3)
    n, d, v = 1024, 32, 64
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v)) / 6).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    whole = jax.jit(jax.grad(lambda w: _ref(h, w, 0.0, y).sum()))(w)
    parts = jax.jit(jax.grad(lambda w: chunked(h, w, y, chunk_size=16).sum()))(w)
    assert parts.dtype == jnp.bfloat16
    whole, parts = (np.asarray(a, np.float32) for a in (whole, parts))
    assert np.linalg.norm(parts - whole) / np.linalg.norm(whole) < 0.005
