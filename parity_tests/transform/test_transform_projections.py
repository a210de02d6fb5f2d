"""``jaxmem.transform(..., projections=True)``: an attention whose queries, keys and values
are dense projections of a layer norm's output (``LN(x) W + b``, then reshapes, a split, a
constant scale) keeps the norm's residuals and the weights instead of ``q, k, v`` and
recomputes the projections in its backward pass. Gradients are the untouched function's;
the stored activations drop by ``q, k, v`` per layer; nothing but the attention core reads
the recorded projections (a dense layer fed one keeps its input as before)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem.measure import residual_bytes
from jaxmem.transform import transform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close, normal

#: two layers: the first reads the argument, the second a previous layer's output
B, T, D, HEADS, LAYERS = 2, 16, 32, 4, 2


def _ln(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * g + b


def _heads(a):
    return a.reshape(*a.shape[:-1], HEADS, a.shape[-1] // HEADS)


def _attend(q, k, v):
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)         # Flax's query scaling
    p = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q, k), -1)
    o = jnp.einsum("...hqk,...khd->...qhd", p, v)
    return o.reshape(*o.shape[:-2], -1)


def _layer(p, x, fused):
    h = _ln(x, p["g"], p["b"])
    if fused:          # GPT-2's one projection, split three ways
        q, k, v = jnp.split(h @ p["wqkv"] + p["bqkv"], 3, axis=-1)
    else:              # BERT's / ViT's three projections
        q, k, v = (h @ p["w" + n] + p["b" + n] for n in "qkv")
    return x + _attend(_heads(q), _heads(k), _heads(v)) @ p["wo"]


def _loss(fused):
    def loss(params, x):
        for p in params:
            x = _layer(p, x, fused)
        return jnp.mean(x ** 2)
    return loss


def _params(dtype=jnp.float32):
    def one():
        p = {"g": 1 + normal((D,), dtype, 0.2), "b": normal((D,), dtype, 0.2),
             "wqkv": normal((D, 3 * D), dtype, D ** -0.5), "bqkv": normal((3 * D,), dtype, 0.1),
             "wo": normal((D, D), dtype, D ** -0.5)}
        for n in "qkv":
            p["w" + n], p["b" + n] = normal((D, D), dtype, D ** -0.5), normal((D,), dtype, 0.1)
        return p
    return [one() for _ in range(LAYERS)]


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_gradients_exact_and_q_k_v_not_stored(fused):
    loss, params, x = _loss(fused), _params(), normal((B, T, D))
    # one compiled program for both sides
    got, want = jax.jit(lambda p, x: tuple(jax.grad(fn, argnums=(0, 1))(p, x)
                                           for fn in (transform(loss), loss)))(params, x)
    close(got, want)
    kept = residual_bytes(transform(loss), params, x).activation_bytes
    stored = residual_bytes(transform(loss, projections=False), params, x).activation_bytes
    # q, k and v of every layer (f32) are gone; nothing replaces them (the norm's input and
    # statistics and the weights are kept anyway)
    assert stored - kept >= LAYERS * 3 * B * T * D * 4, (stored, kept)


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_recomputed_projections_in_query_chunks(fused):
    """``attention_chunk=6`` of ``T = 16`` rows: the core recomputes ``q, k, v`` once and
    runs its chunks over them; the same gradients, ``q, k, v`` still not stored."""
    loss, params, x = _loss(fused), _params(), normal((B, T, D))
    g = transform(loss, attention_chunk=6)
    rows = g.report(params, x).by_kind("attention")
    assert all("6 of 16 query rows" in r.became and "recomputed" in r.reason for r in rows)
    got, want = jax.jit(lambda p, x: tuple(jax.grad(fn, argnums=(0, 1))(p, x)
                                           for fn in (g, loss)))(params, x)
    close(got, want)
    kept = residual_bytes(g, params, x).activation_bytes
    assert kept == residual_bytes(transform(loss), params, x).activation_bytes


def test_under_vmap_scan_checkpoint_and_bf16():
    """Under ``vmap`` and in bf16 one layer (the rule is per layer); ``scan`` over the
    stacked layers of :func:`_params` under ``jax.checkpoint``."""
    loss, params = _loss(False), _params()
    x = normal((3, B, T, D))
    # one compiled program for both sides (op by op, a vmapped gradient is dozens of small
    # compiles)
    got, want = jax.jit(lambda p, x: tuple(jax.vmap(jax.grad(fn), in_axes=(None, 0))(p, x)
                                           for fn in (transform(loss), loss)))(params[:1], x)
    close(got, want)

    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params)

    def scanned(ps, x):
        def body(h, p):
            return _layer(p, h, False), None
        return jnp.mean(lax.scan(jax.checkpoint(body), x, ps)[0] ** 2)

    got, want = jax.jit(lambda ps, x: tuple(jax.grad(fn)(ps, x)
                                            for fn in (transform(scanned), scanned)))(
        stacked, x[0])
    close(got, want)

    pb, xb = _params(jnp.bfloat16)[:1], x[0].astype(jnp.bfloat16)
    got = jax.jit(jax.grad(transform(loss)))(pb, xb)
    want = jax.jit(jax.grad(transform(loss, projections=False)))(pb, xb)
    # the same bf16 arithmetic recomputed: equal up to bf16 rounding of the recomputation
    close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
          jax.tree.map(lambda a: a.astype(jnp.float32), want), rtol=2e-2, atol=2e-2)


def test_recorded_projection_is_read_by_the_attention_only():
    """A dense layer fed a projection (``LN(x) W1`` then ``@ W2``, no attention) keeps its
    input as before: the recipe does not make other rules recompute products."""
    def loss(p, x):
        h = _ln(x, p["g"], p["b"]) @ p["wq"]
        return jnp.mean((h.reshape(B, T, HEADS, -1).reshape(B, T, D) @ p["wo"]) ** 2)

    p, x = _params()[0], normal((B, T, D))
    on = residual_bytes(transform(loss), p, x).activation_bytes
    off = residual_bytes(transform(loss, projections=False), p, x).activation_bytes
    assert on == off
    close(jax.jit(jax.grad(transform(loss)))(p, x), jax.jit(jax.grad(loss))(p, x))


def test_projections_option_is_checked():
    with pytest.raises(TypeError, match="projections"):
        transform(_loss(False), projections="yes")


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_report_says_which_inputs_are_recomputed(fused):
    """The attention rows name q, k, v as recomputed from their projection (they are, per
    ``test_gradients_exact_and_q_k_v_not_stored``); without the option they say q, k, v are
    kept."""
    loss, params, x = _loss(fused), _params(), normal((B, T, D))
    on = [r for r in transform(loss).report(params, x) if r.kind == "attention"]
    off = [r for r in transform(loss, projections=False).report(params, x)
           if r.kind == "attention"]
    assert len(on) == len(off) == LAYERS
    for r in on:
        assert r.reason.startswith("keeps row statistics; q, k, v: recomputed"), r.reason
    for r in off:
        assert r.reason == "keeps q, k, v and row statistics, no T x S array"


def test_report_of_cross_attention_keeps_what_has_no_projection():
    """Queries projected from a norm, keys and values from an encoder output as given: only
    q is reported as recomputed."""
    def loss(p, x, enc):
        q = _ln(x, p["g"], p["b"]) @ p["wq"]
        o = _attend(_heads(q), _heads(enc), _heads(enc))
        return jnp.mean((o @ p["wo"]) ** 2)

    p, x, enc = _params()[0], normal((B, T, D)), normal((B, T, D), scale=0.5)
    rows = [r for r in transform(loss).report(p, x, enc) if r.kind == "attention"]
    assert len(rows) == 1 and rows[0].reason.startswith("keeps k, v and row statistics; q: ")
    close(jax.jit(jax.grad(transform(loss)))(p, x, enc), jax.jit(jax.grad(loss))(p, x, enc))


def test_grouped_query_keys_and_values_repeated_are_recomputed():
    """Grouped-query attention as Llama / Mistral write it: two key / value heads repeated
    (``jnp.repeat``, a broadcast and a reshape) to the four query heads; the repeated keys and
    values are recomputed from their projection like q, the gradients exact."""
    def loss(p, x):
        h = _ln(x, p["g"], p["b"])
        q = _heads(h @ p["wq"])
        k, v = (jnp.repeat(_heads2(h @ p["w" + n][:, :D // 2]), 2, axis=2) for n in "kv")
        return jnp.mean((_attend(q, k, v) @ p["wo"]) ** 2)

    p, x = _params()[0], normal((B, T, D))
    rows = [r for r in transform(loss).report(p, x) if r.kind == "attention"]
    assert len(rows) == 1 and rows[0].reason.startswith("keeps row statistics; q, k, v:"), rows
    got, want = jax.jit(lambda p, x: tuple(jax.grad(fn)(p, x)
                                           for fn in (transform(loss), loss)))(p, x)
    close(got, want)
    kept = residual_bytes(transform(loss), p, x).activation_bytes
    stored = residual_bytes(transform(loss, projections=False), p, x).activation_bytes
    assert stored - kept >= 3 * B * T * D * 4, (stored, kept)     # q and the repeated k, v


def _rotary(t, sin, cos):
    """Llama's rotary embedding: ``t cos + rotate_half(t) sin``."""
    half = t.shape[-1] // 2
    return t * cos + jnp.concatenate((-t[..., half:], t[..., :half]), axis=-1) * sin


def test_rotary_queries_and_keys_are_recomputed():
    """Queries and keys rotated as Llama / GPT-NeoX do (``concatenate`` of the negated and
    plain halves, products with per-position ``sin`` / ``cos`` gathered from a table): the
    rotation stays recorded, so the core keeps the norm's residuals, the weights and the
    (B, T, 1, D) tables instead of q and k; gradients exact."""
    d = D // HEADS
    table = jnp.asarray(np.random.default_rng(0).standard_normal((T, 1, 2 * d)), jnp.float32)

    def loss(p, x, pos):
        h = _ln(x, p["g"], p["b"])
        sin, cos = jnp.split(table[pos], 2, axis=-1)
        q, k = (_rotary(_heads(h @ p["w" + n]), sin, cos) for n in "qk")
        return jnp.mean((_attend(q, k, _heads(h @ p["wv"])) @ p["wo"]) ** 2)

    p, x = _params()[0], normal((B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    rows = [r for r in transform(loss).report(p, x, pos) if r.kind == "attention"]
    assert len(rows) == 1 and rows[0].reason.startswith("keeps row statistics; q, k, v:"), rows
    got, want = jax.jit(lambda p, x: tuple(jax.grad(fn)(p, x, pos)
                                           for fn in (transform(loss), loss)))(p, x)
    close(got, want)
    kept = residual_bytes(transform(loss), p, x, pos).activation_bytes
    stored = residual_bytes(transform(loss, projections=False), p, x, pos).activation_bytes
    assert stored - kept >= 3 * B * T * D * 4 - 2 * B * T * d * 4, (stored, kept)


def _heads2(a):
    return a.reshape(*a.shape[:-1], HEADS // 2, a.shape[-1] // (HEADS // 2))


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_under_tensor_parallelism_only_unsplit_projections_recomputed(fused):
    """In a tensor parallel step's context (a ``'model'`` feature axis) a device holds its
    heads' columns of each projection: three projections are still recomputed there; a fused
    projection split three ways is kept (the split moves columns between devices, so the
    recomputation would repeat the forward's collectives), unless the step allows those
    collectives to run again. With no step's layout known (a bare mesh) none is
    recomputed."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxmem._prims.bitpack import shard_axes
    from jaxmem._prims.grad_layout import repeated_collectives

    loss, params, x = _loss(fused), _params(), normal((B, T, D))
    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def reasons(*axes):
        with jax.sharding.use_abstract_mesh(mesh), shard_axes(*axes):
            return [r.reason for r in transform(loss).report(params, x)
                    if r.kind == "attention"]

    tp = reasons("model")
    assert len(tp) == LAYERS
    for r in tp:
        assert r.startswith("keeps q, k, v" if fused else "keeps row statistics; q, k, v: "
                            "recomputed"), r
    # a step made with ``repeat_collectives=True`` recomputes the split one too
    with repeated_collectives(True):
        for r in reasons("model"):
            assert r.startswith("keeps row statistics; q, k, v: recomputed"), r
    with jax.sharding.use_abstract_mesh(mesh):
        bare = [r.reason for r in transform(loss).report(params, x) if r.kind == "attention"]
    assert all(r.startswith("keeps q, k, v") for r in bare), bare
