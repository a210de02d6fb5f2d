"""jaxmem.transform's language-model heads (``match_logits``): a product ``h W`` with more
columns than ``h`` feeding a softmax-like loss per row, in any spelling, is computed a chunk
of rows at a time -- the same losses, extra outputs and gradients as the untouched function
(float32 rtol 1e-5; float64 beside), under JAX's transformations, a report row with the
reason where it is not chunked, and a compiled step that keeps no ``tokens x vocab`` array
(XLA:CPU and the H100 plan)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem.measure import compiled_memory, gpu_plan_available
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

B, T, D, V = 3, 50, 8, 40       # 150 rows: chunks of 32 leave a remainder of 22
CHUNK = 32


def _data(dtype=jnp.float32):
    rng = np.random.default_rng()
    x = normal((B, T, D), dtype)
    w = normal((D, V), dtype, 1 / np.sqrt(D))
    b = normal((V,), dtype, 0.5)
    y = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    return x, w, b, y


def optax_integer(x, w, b, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()


def log_softmax_take(x, w, b, y):
    lp = jax.nn.log_softmax(x @ w + b)
    return -jnp.take_along_axis(lp, y[..., None], -1).mean()


def flat_one_hot_sum(x, w, b, y):
    lp = jax.nn.log_softmax((x @ w + b).reshape(-1, V))
    return -(jax.nn.one_hot(y.reshape(-1), V) * lp).sum(-1).mean()


def optax_one_hot(x, w, b, y):
    return optax.softmax_cross_entropy(x @ w + b, jax.nn.one_hot(y, V)).mean()


def einsum_one_hot(x, w, b, y):
    lp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w) + b)
    return -jnp.einsum("btv,btv->bt", jax.nn.one_hot(y, V), lp).mean()


def hand_logsumexp_tied(x, w, b, y):
    emb = w.T                                   # a tied (vocab, d) embedding: x @ emb.T
    z = jnp.dot(x, emb.T)
    m = jax.lax.stop_gradient(z.max(-1, keepdims=True))
    lse = jnp.log(jnp.exp(z - m).sum(-1)) + m[..., 0]
    return (lse - jnp.take_along_axis(z, y[..., None], -1)[..., 0]).mean()


def next_token_slice(x, w, b, y):
    """Hugging Face's ``run_clm_flax`` loss: logits and labels shifted by one token, labels
    one-hot by comparison with ``arange``."""
    z = x @ w
    logits, labels = z[:, :-1], y[:, 1:]
    one_hot = (labels[..., None] == jnp.arange(V)).astype(jnp.float32)
    return optax.softmax_cross_entropy(logits, one_hot).mean()


def label_smoothing(x, w, b, y):
    smoothed = optax.smooth_labels(jax.nn.one_hot(y, V), 0.1)
    return optax.softmax_cross_entropy(x @ w + b, smoothed).mean()


def masked_vocab_z_loss(x, w, b, y):
    """Some classes masked out with a large negative constant (a literal in the jaxpr), a
    z-loss on the log-normaliser, padding tokens weighted out after the head."""
    z = jnp.where(jnp.arange(V) % 7 != 3, x @ w + b, -1e9)
    y = jnp.where(y % 7 == 3, y + 1, y)          # no label among the masked classes
    lse = jax.nn.logsumexp(z, -1)
    per_token = lse - jnp.take_along_axis(z, y[..., None], -1)[..., 0] + 1e-4 * lse ** 2
    keep = (jnp.arange(T) < T - 5)[None, :]
    return jnp.sum(per_token * keep) / jnp.sum(keep * jnp.ones_like(per_token))


def named_column(x, w, b, y):
    """Logits named for a remat policy (``checkpoint_name``), one column of the log-softmax
    (a slice within each row)."""
    from jax.ad_checkpoint import checkpoint_name

    z = checkpoint_name(x @ w + b, "logits")
    return -jnp.mean(jax.nn.log_softmax(z)[..., 0])


SPELLINGS = [optax_integer, log_softmax_take, flat_one_hot_sum, optax_one_hot, einsum_one_hot,
             hand_logsumexp_tied, next_token_slice, label_smoothing, masked_vocab_z_loss,
             named_column]


def _logit_rows(g, *args):
    return g.report(*args).by_kind("logits")


@pytest.mark.parametrize("loss", SPELLINGS, ids=lambda f: f.__name__)
def test_every_spelling_is_chunked_with_the_same_loss_and_gradients(loss):
    x, w, b, y = _data()
    g = transform(loss, logits_chunk=CHUNK)
    rows = _logit_rows(g, x, w, b, y)
    assert len(rows) == 1 and rows[0].converted, rows
    assert "row-chunked head" in rows[0].became and f"{CHUNK} of" in rows[0].became
    got, want = jax.jit(lambda *a: (jax.value_and_grad(g, (0, 1, 2))(*a),
                                    jax.value_and_grad(loss, (0, 1, 2))(*a)))(x, w, b, y)
    close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_match_float64():
    x, w, b, y = _data()
    g = transform(optax_integer, logits_chunk=CHUNK)
    got = jax.jit(jax.grad(g, (0, 1, 2)))(x, w, b, y)
    with jax.enable_x64(True):
        args64 = [np.asarray(a, np.float64) for a in (x, w, b)]
        want = jax.grad(optax_integer, (0, 1, 2))(*args64, y)
    close(got, want, rtol=1e-5, atol=1e-6)


def test_per_token_values_and_aux_outputs_are_the_same():
    """Several per-row outputs (the losses and an argmax accuracy) leave the chunked head."""
    x, w, b, y = _data()

    def loss(x, w, b, y):
        z = x @ w + b
        per_token = optax.softmax_cross_entropy_with_integer_labels(z, y)
        return per_token.mean(), (per_token, jnp.argmax(z, -1) == y)

    g = transform(loss, logits_chunk=CHUNK)
    assert _logit_rows(g, x, w, b, y)[0].converted
    got, want = jax.jit(lambda *a: (jax.value_and_grad(g, (0, 1), has_aux=True)(*a),
                                    jax.value_and_grad(loss, (0, 1), has_aux=True)(*a)))(
        x, w, b, y)
    close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[0][1][1] == want[0][1][1]).all()


def _refused(loss, chunk=CHUNK):
    x, w, b, y = _data()
    rows = _logit_rows(transform(loss, logits_chunk=chunk), x, w, b, y)
    assert len(rows) == 1 and not rows[0].converted, rows
    return rows[0].reason


def test_heads_that_cannot_be_chunked_say_why():
    def logits_returned(x, w, b, y):
        z = x @ w + b
        return optax.softmax_cross_entropy_with_integer_labels(z, y).mean(), z

    def logits_summed(x, w, b, y):
        z = x @ w
        return optax.softmax_cross_entropy_with_integer_labels(z, y).mean() + 1e-3 * z.sum()

    def rows_mixed(x, w, b, y):    # a softmax over the tokens, not within a row
        z = x @ w
        return -jnp.mean(jax.nn.log_softmax(z, axis=1)[..., 0])

    assert "output of the function" in _refused(logits_returned)
    assert "reduces over the rows" in _refused(logits_summed)
    assert "over the rows" in _refused(rows_mixed)
    assert "fit one chunk" in _refused(optax_integer, chunk=B * T)


def test_other_products_are_left_alone():
    """An MLP's up-projection (more columns than its input, no softmax), a softmax-weighted
    product (an attention), and ``logits_chunk=None``: no logits rows, nothing chunked."""
    x, w, b, y = _data()
    w2 = normal((V, D))

    def mlp(x, w, b, y):
        return jnp.mean(jax.nn.gelu(x @ w + b) @ w2)

    def attention(x, w, b, y):
        q = x[0]                                   # (T, D) queries
        p = jax.nn.softmax(q @ x[1].T)             # (T, T) weights over another sequence
        return jnp.mean(p @ x[2])

    for loss in (mlp, attention):
        assert not _logit_rows(transform(loss, logits_chunk=CHUNK), x, w, b, y)
    assert not _logit_rows(transform(optax_integer, logits_chunk=None), x, w, b, y)


def test_under_vmap_scan_checkpoint_and_grad_of_grad():
    x, w, b, y = _data()
    g = transform(optax_integer, logits_chunk=16)
    # per-sequence losses and gradients under vmap (50 rows each: chunks of 16 + 2)
    per_seq = jax.vmap(jax.value_and_grad(g, (0, 1)), in_axes=(0, None, None, 0))
    want_seq = jax.vmap(jax.value_and_grad(optax_integer, (0, 1)), in_axes=(0, None, None, 0))
    close(jax.jit(per_seq)(x, w, b, y), want_seq(x, w, b, y), rtol=1e-5, atol=1e-6)

    # micro-batches in lax.scan, the loss under jax.checkpoint
    def accumulate(fn):
        def total(w, b):
            def step(c, xy):
                return c + jax.checkpoint(fn)(xy[0][None], w, b, xy[1][None]), None
            return jax.lax.scan(step, 0.0, (x, y))[0]
        return jax.grad(total, (0, 1))

    close(jax.jit(accumulate(g))(w, b), accumulate(optax_integer)(w, b), rtol=1e-5, atol=1e-6)

    # a Hessian-vector product w.r.t. the bias
    v = normal((V,))

    def hvp(fn):
        return jax.jvp(jax.grad(lambda b: fn(x, w, b, y)), (b,), (v,))[1]

    close(jax.jit(lambda: hvp(g))(), hvp(optax_integer), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype):
    """bf16 / f16 heads: the transformed loss and gradients equal the untouched ones in that
    dtype within its rounding (the chunks' products may block the sums differently)."""
    x, w, b, y = _data(dtype)
    g = transform(optax_integer, logits_chunk=CHUNK)
    assert _logit_rows(g, x, w, b, y)[0].converted
    got, want = jax.jit(lambda *a: (jax.value_and_grad(g, (0, 1, 2))(*a),
                                    jax.value_and_grad(optax_integer, (0, 1, 2))(*a)))(
        x, w, b, y)
    assert jax.tree_util.tree_map(lambda a: a.dtype, got) == jax.tree_util.tree_map(
        lambda a: a.dtype, want)
    f32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), (got, want))
    close(*f32, rtol=2e-2, atol=2e-2)


_TARGETS = ["cpu", pytest.param("h100", marks=pytest.mark.skipif(
    not gpu_plan_available(), reason="the H100 plan needs the CUDA PJRT plugin"))]


@pytest.mark.parametrize("target", _TARGETS)
def test_step_keeps_no_tokens_by_vocab_array(target):
    """Compiled bytes of ``value_and_grad`` of optax's loss (2 x 512 tokens, d 64, vocab
    1024: logits 4 MiB): untouched, at least two ``tokens x vocab`` arrays at the peak;
    transformed (chunks of 128 rows), less than one."""
    sd = jax.ShapeDtypeStruct
    args = (sd((2, 512, 64), jnp.float32), sd((64, 1024), jnp.float32), sd((1024,), jnp.float32),
            sd((2, 512), jnp.int32))
    logits = 2 * 512 * 1024 * 4

    def temp(fn):
        return compiled_memory(jax.value_and_grad(fn, (0, 1, 2)), *args,
                               target=target).temp_bytes

    plain = temp(optax_integer)
    lean = temp(transform(optax_integer, logits_chunk=128))
    assert plain >= 2 * logits, (plain, logits)
    assert lean < logits, (lean, logits)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "1024"])
def test_bad_logits_chunk_is_refused(bad):
    with pytest.raises(ValueError, match="logits_chunk"):
        transform(optax_integer, logits_chunk=bad)


def test_hugging_face_gpt2_next_token_loss():
    """A tiny Hugging Face Flax GPT-2 (random init from a config) with ``run_clm_flax``'s
    shifted one-hot loss: its tied head is chunked, every parameter's gradient unchanged."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=16, n_layer=1,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=False)
    params = jax.jit(m.init_weights, static_argnums=1)(jax.random.key(0), m.input_shape)
    ids = jnp.asarray(np.random.default_rng().integers(0, 96, (2, 64)), jnp.int32)

    def loss(params, ids):
        logits = m(ids, params=params, train=False).logits
        shifted, labels = logits[:, :-1], ids[:, 1:]
        return optax.softmax_cross_entropy(shifted, jax.nn.one_hot(labels, 96)).mean()

    g = transform(loss, logits_chunk=48)
    rows = _logit_rows(g, params, ids)
    assert len(rows) == 1 and rows[0].converted and "126 rows" in rows[0].became, rows
    got, want = jax.jit(lambda *a: (jax.value_and_grad(g)(*a),
                                    jax.value_and_grad(loss)(*a)))(params, ids)
    close(got, want, rtol=1e-5, atol=1e-6)


def test_jaxmem_report_names_the_chunked_head():
    """``jaxmem.report`` of the transformed loss: one 'logits' entry, converted, technique
    'chunked'."""
    import jaxmem

    x, w, b, y = _data()
    rep = jaxmem.report(transform(optax_integer, logits_chunk=CHUNK), x, w, b, y)
    (entry,) = rep.by_kind("logits")
    assert (entry.status, entry.technique) == ("converted", "chunked"), entry


def test_head_of_a_converted_linen_model_is_chunked():
    """A Linen model converted with ``jaxmem.linen.convert``: its tied head is jaxmem's own
    selective product (a ``custom_vjp`` whose gradient is the product's transpose), which the
    transform reads as the product it computes and chunks -- the untouched model's loss and
    gradients, and a compiled step keeping at least one ``tokens x vocab`` array less than the
    converted model's alone."""
    import jaxmem
    from jaxmem import models

    m = models.gpt(n_layer=1, d_model=16, n_head=2, ctx=32, vocab=1024)
    tok = jnp.asarray(np.random.default_rng().integers(0, 1024, (3, 32)), jnp.int32)
    params = m.init(jax.random.key(0), tok)["params"]
    converted = jaxmem.linen.convert(m)

    def loss_of(model):
        def loss(p, t):
            z = model.apply({"params": p}, t)
            return optax.softmax_cross_entropy_with_integer_labels(z, t).mean()
        return loss

    g = transform(loss_of(converted), logits_chunk=CHUNK)
    rows = _logit_rows(g, params, tok)
    assert len(rows) == 1 and rows[0].converted and "96 rows" in rows[0].became, rows
    got, want = jax.jit(lambda *a: (jax.value_and_grad(g)(*a),
                                    jax.value_and_grad(loss_of(m))(*a)))(params, tok)
    close(got, want, rtol=1e-5, atol=1e-6)

    def temp(fn):
        return compiled_memory(jax.value_and_grad(fn), params, tok).temp_bytes

    logits = 3 * 32 * 1024 * 4
    assert temp(g) + logits <= temp(transform(loss_of(converted), logits_chunk=None))


def test_a_custom_vjp_product_keeps_its_own_rule():
    """A head whose product is the user's own ``custom_vjp`` (a gradient scaled by 2) is not
    read through: no chunked row, and the gradient is the custom rule's."""
    x, w, b, y = _data()

    @jax.custom_vjp
    def scaled_dot(x, w):
        return x @ w

    scaled_dot.defvjp(lambda x, w: (x @ w, (x, w)),
                      lambda r, g: (2 * g @ r[1].T, 2 * jnp.einsum("btd,btv->dv", r[0], g)))

    def loss(x, w, b, y):
        return optax.softmax_cross_entropy_with_integer_labels(scaled_dot(x, w) + b, y).mean()

    g = transform(loss, logits_chunk=CHUNK)
    assert not any(r.converted for r in _logit_rows(g, x, w, b, y))
    got, want = jax.jit(lambda *a: (jax.grad(g, (0, 1))(*a), jax.grad(loss, (0, 1))(*a)))(
        x, w, b, y)
    close(got, want, rtol=1e-5, atol=1e-6)
