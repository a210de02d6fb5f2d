"""jaxmem.nnx.convert (the exact techniques: ``jaxmem.transform`` over the module's state) on
NNX models written the way NNX users write
them: a CNN with Conv/BatchNorm/Dropout/max_pool/Linear trained with ``nnx.Optimizer``, a
ViT-like block with ``nnx.MultiHeadAttention`` and LinearGeneral/Einsum projections, a stack
of layers created with ``nnx.vmap`` and applied with ``nnx.scan`` (optionally
``nnx.remat``), cross-device BatchNorm (``axis_name``), Dropout's rng handling, Embed, and
what each layer reports."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assert import assert_tree_close, max_abs
from _data import normal
from _lazy import Lazy
from flax import nnx

import jaxmem
from jaxmem.measure import residual_bytes
from jaxmem.selective import linen as SL

#: the selective part alone (no attention; few-bit is off by default)
_nnx_convert = functools.partial(jaxmem.nnx.convert, attention=False, copy=False)

K = Lazy(lambda: jax.random.split(jax.random.key(11), 8))


def _close(a, b, rtol=1e-5):
    """Leaf-wise equal up to ``rtol`` of the leaf's largest magnitude, or of a tenth of the
    tree's, if larger (f32 rounding of sums taken in another order; some gradients, e.g. of
    attention's key bias, are exactly 0 in math and rounding noise in f32)."""
    floats = [v for v in jax.tree.leaves(b) if jnp.issubdtype(v.dtype, jnp.floating)]
    tree = max([max_abs(v) for v in floats], default=0.0)
    scale = lambda v: max(max_abs(v), 0.1 * tree) if v.dtype.kind == "f" else 0.0
    assert_tree_close(a, b, rtol=rtol, atol=lambda v: rtol * scale(v))


def _build(make):
    """``make()`` with every initialiser in one compiled program (built eagerly, each
    initialiser op is compiled on its own): the same module, parameters and rng state."""
    graphdef = nnx.graphdef(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make()))())


def _pair(make):
    """An untouched model and a converted clone of it (same parameters and rng state)."""
    ref = _build(make)
    return ref, _nnx_convert(nnx.clone(ref))


def _records(fn, *args):
    """The jaxmem report entries of tracing ``fn(*args)`` abstractly."""
    return jaxmem.report(fn, *args).entries


def _param_loss(model, x):
    """``(loss(params, rest), params, rest)`` for residual / report measurements."""
    gdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, r):
        # fresh Variables at this trace level: NNX refuses to update (batch statistics, rng
        # counts) Variables that were created outside the transform
        p, r = jax.tree.map(lambda a: a, (p, r))
        return jnp.sum(jnp.sin(nnx.merge(gdef, p, r)(x)))
    return loss, params, rest


# ------------------------------------------------------------------------------- CNN
class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        # no conv bias before a batch norm: its exact gradient is 0, and Adam would turn
        # float noise of it into +-lr steps
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.4, rngs=rngs)
        self.linear1 = nnx.Linear(2 * 2 * 16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.linear1(x)))
        return self.linear2(x)


def _mnist_batch(seed, n=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(rng.integers(0, 10, n, dtype=np.int32))


def _loss_fn(model, x, y):
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, logits


@nnx.jit
def _train_step(model, optimizer, x, y):
    (loss, _), grads = nnx.value_and_grad(_loss_fn, has_aux=True)(model, x, y)
    optimizer.update(model, grads)
    return loss, grads


def test_cnn_training_matches_untouched_model():
    ref, sel = _pair(lambda: CNN(rngs=nnx.Rngs(0, dropout=1)))
    assert type(sel.dropout) is nnx.Dropout  # layers are not changed
    assert sel.conv1.kernel is not ref.conv1.kernel
    opts = [nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param) for m in (ref, sel)]
    for step in range(2):
        x, y = _mnist_batch((0, step))
        for m in (ref, sel):
            m.train()
        (l_r, g_r), (l_s, g_s) = (_train_step(m, o, x, y) for m, o in zip((ref, sel), opts))
        np.testing.assert_allclose(l_s, l_r, rtol=1e-5)
        _close(g_s, g_r)
        _close(nnx.state(sel), nnx.state(ref))  # params, stats, rngs


def test_cnn_converted_is_a_working_nnx_module_and_stores_less():
    ref, sel = _pair(lambda: CNN(rngs=nnx.Rngs(0, dropout=1)))
    x, _ = _mnist_batch(2)
    gdef, state = nnx.split(sel)
    again = nnx.merge(gdef, state)
    assert type(again.bn1) is type(sel.bn1) and type(again.linear1) is type(sel.linear1)
    assert type(nnx.clone(sel).dropout) is type(sel.dropout)
    assert jax.tree.structure(nnx.state(sel)) == jax.tree.structure(nnx.state(ref))
    loss_r, p_r, r_r = _param_loss(ref, x)
    loss_s, p_s, r_s = _param_loss(sel, x)
    res_r = residual_bytes(loss_r, p_r, r_r, argnums=0)
    res_s = residual_bytes(loss_s, p_s, r_s, argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.JaxmemDeprecationWarning)
        with jaxmem.scope(attention=False, selective=False):  # only the masks, argmax codes
            res_r_scoped = residual_bytes(loss_r, p_r, r_r, argnums=0)
    # relu / max_pool keep 1-bit masks / packed argmax positions; on top of that batch norm
    # keeps one f32 input-sized tensor instead of two, dropout its key only
    bn_inputs = 4 * (8 * 8 * 8 * 8 + 8 * 4 * 4 * 16)
    assert res_s.activation_bytes < 0.4 * res_r.activation_bytes, (str(res_s), str(res_r))
    assert res_s.activation_bytes <= res_r_scoped.activation_bytes - 0.8 * bn_inputs
    entries = _records(loss_s, p_s, r_s)
    got = {(e.kind, e.status) for e in entries}
    for kind in ("conv", "norm", "dropout", "dot", "pool", "activation"):
        assert (kind, "converted") in got, got
    assert len([e for e in entries if e.kind == "norm" and e.status == "converted"]) == 2


def test_cnn_eval_mode_matches_and_dropout_runs_nnx_code():
    ref, sel = _pair(lambda: CNN(rngs=nnx.Rngs(0, dropout=1)))
    x, _ = _mnist_batch(3)
    for m in (ref, sel):
        m.eval()
    _close(sel(x), ref(x))
    loss, p, r = _param_loss(sel, x)
    entries = _records(loss, p, r)
    assert not [e for e in entries if e.kind == "dropout"]  # eval: dropout is the identity
    assert len([e for e in entries if e.kind == "conv" and e.status == "converted"]) == 2


# ------------------------------------------------------------------------ ViT block
class ViTBlock(nnx.Module):
    def __init__(self, dim, heads, *, rngs: nnx.Rngs):
        self.patch = nnx.LinearGeneral(12, (heads, dim // heads), rngs=rngs)
        self.merge = nnx.LinearGeneral((heads, dim // heads), dim, axis=(-2, -1), rngs=rngs)
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim,
                                           dropout_rate=0.1, decode=False, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Einsum("bnd,df->bnf", (dim, 2 * dim), (2 * dim,), rngs=rngs)
        self.down = nnx.Einsum("bnf,fd->bnd", (2 * dim, dim), (dim,), rngs=rngs)
        self.mlp_drop = nnx.Dropout(0.1, broadcast_dims=(1,), rngs=rngs)

    def __call__(self, patches):
        x = self.merge(self.patch(patches))
        x = x + self.drop(self.attn(self.ln1(x)))
        h = self.mlp_drop(nnx.gelu(self.up(self.ln2(x))))
        return x + self.down(h)


def _vit():
    return ViTBlock(16, 4, rngs=nnx.Rngs(params=2, dropout=3))


@pytest.mark.parametrize("train", [True, False])
def test_vit_block_outputs_and_gradients_match(train):
    ref, sel = _pair(_vit)
    assert type(sel.attn.query) is nnx.LinearGeneral and type(sel.up) is nnx.Einsum
    for m in (ref, sel):
        m.train() if train else m.eval()
    x = normal(4, (2, 6, 12))

    @nnx.jit
    def step(m, x):
        return nnx.value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=(0, 1))(m, x)

    (v_r, (g_r, gx_r)), (v_s, (g_s, gx_s)) = step(ref, x), step(sel, x)
    np.testing.assert_allclose(v_s, v_r, rtol=1e-5)
    _close(g_s, g_r)
    _close(gx_s, gx_r)
    _close(nnx.state(sel), nnx.state(ref))  # rng streams advanced alike


def test_vit_block_stores_less_and_reports_projections():
    ref, sel = _pair(_vit)
    for m in (ref, sel):
        m.train()
    x = normal(5, (2, 6, 12))
    (loss_r, p_r, r_r), (loss_s, p_s, r_s) = _param_loss(ref, x), _param_loss(sel, x)
    res_r = residual_bytes(loss_r, p_r, r_r, argnums=0)
    res_s = residual_bytes(loss_s, p_s, r_s, argnums=0)
    assert res_s.activation_bytes < res_r.activation_bytes, (str(res_s), str(res_r))
    entries = _records(loss_s, p_s, r_s)
    # patch, merge, the four attention projections, up, down (and the block's other
    # products): every one converted
    dots = [e.status for e in entries if e.kind == "dot"]
    assert len(dots) >= 8 and set(dots) == {"converted"}, dots
    # the block's dropout and the attention weights' dropout: regenerated masks (the
    # attention itself, with its dropout, is not matched as one attention yet)
    assert [e.status for e in entries if e.kind == "dropout"] == ["converted"] * 2


def test_einsum_and_linear_general_keep_only_what_requested_grads_need():
    """Weights frozen, input differentiated: nothing input-sized is kept (the weights are
    arguments, not activations); weights trained, input constant: only the inputs."""
    m = _nnx_convert(nnx.Einsum("bnd,df->bnf", (16, 32), (32,), rngs=nnx.Rngs(0)))
    lg = _nnx_convert(nnx.LinearGeneral(16, (4, 8), rngs=nnx.Rngs(1)))
    x = normal(6, (4, 8, 16))
    for layer in (m, lg):
        gdef, p = nnx.split(layer)
        f = lambda p, x, gdef=gdef: jnp.sum(jnp.sin(nnx.merge(gdef, p)(x)))
        assert residual_bytes(f, p, x, argnums=1).activation_bytes <= 4 * 4 * 8 * 32 * 2
        rep = residual_bytes(f, p, x, argnums=0)
        assert rep.activation_bytes <= x.size * 4 + 4 * 4 * 8 * 32 * 2


# ------------------------------------------------------------- nnx.vmap / nnx.scan stack
DEPTH = 3


class Block(nnx.Module):
    def __init__(self, dim, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x):
        return self.norm(x + self.dropout(nnx.relu(self.bn(self.linear(x)))))


class ScanStack(nnx.Module):
    def __init__(self, dim, *, remat=False, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(dim, rngs=rngs)

        self.blocks = make(rngs)
        self.remat = remat
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        def body(x, block):
            return block(x)
        if self.remat:
            body = nnx.remat(body)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return body(x, block)

        return self.head(run(x, self.blocks))


@pytest.mark.parametrize("remat", [False, True])
def test_scan_over_vmapped_layers_matches(remat):
    ref, sel = _pair(lambda: ScanStack(8, remat=remat, rngs=nnx.Rngs(4, dropout=5)))
    assert type(sel.blocks.dropout) is nnx.Dropout
    assert sel.blocks.linear.kernel.shape == (DEPTH, 8, 8)
    x = normal(7, (6, 8))
    grad = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x)))))
    for train in (True, False) if not remat else (True,):
        for m in (ref, sel):
            m.train() if train else m.eval()
        (v_r, g_r), (v_s, g_s) = grad(ref, x), grad(sel, x)
        np.testing.assert_allclose(v_s, v_r, rtol=1e-5)
        _close(g_s, g_r)
        _close(nnx.state(sel), nnx.state(ref))  # batch stats and rng counts
    if not remat:
        for m in (ref, sel):
            m.train()
        (loss_r, p_r, r_r), (loss_s, p_s, r_s) = _param_loss(ref, x), _param_loss(sel, x)
        with jaxmem.scope(attention=False):
            res_s = residual_bytes(loss_s, p_s, r_s, argnums=0)
        res_r = residual_bytes(loss_r, p_r, r_r, argnums=0)
        assert res_s.activation_bytes < res_r.activation_bytes, (str(res_s), str(res_r))


# ----------------------------------------------------------------- BatchNorm axis_name
def _bn_pair(**kw):
    make = lambda: nnx.BatchNorm(5, axis_name="batch", momentum=0.8, rngs=nnx.Rngs(0), **kw)
    ref, sel = _pair(make)
    for m in (ref, sel):  # non-trivial affine parameters
        m.scale[...] = normal(0, (5,), 0.3, 1.0)
        m.bias[...] = normal(1, (5,), 0.1)
    return ref, sel


@pytest.mark.parametrize("fast_variance", [True, False])
def test_batch_norm_axis_name_under_nnx_vmap_matches(fast_variance):
    """Data-parallel step (per-device gradients inside ``nnx.vmap(axis_name=...)``):
    statistics over the mapped axis (``lax.pmean``), values, gradients and running
    statistics equal NNX's BatchNorm."""
    ref, sel = _bn_pair(use_fast_variance=fast_variance)
    x = normal(2, (4, 3, 5), shift=2.0)  # 4 "devices" x 3 rows x 5 features

    @nnx.jit  # one compiled program per model; the running statistics update through it
    @nnx.vmap(in_axes=(None, 0), out_axes=0, axis_name="batch")
    def step(bn, x):
        def loss(bn, x):
            return jnp.sum(jnp.sin(bn(x, use_running_average=False)) * jnp.arange(5.0))
        return nnx.value_and_grad(loss, argnums=(0, 1))(bn, x)

    (v_r, (g_r, gx_r)), (v_s, (g_s, gx_s)) = step(ref, x), step(sel, x)
    _close(v_s, v_r)
    _close(g_s, g_r)
    _close(gx_s, gx_r)
    _close(nnx.state(sel), nnx.state(ref))  # running statistics from the global batch
    assert not np.allclose(ref.mean[...], 0.2 * jnp.mean(x[0], 0))
    y = nnx.vmap(lambda bn, x: bn(x, use_running_average=True), in_axes=(None, 0))
    _close(y(sel, x), y(ref, x))


def _synced_loss(model, x):
    gdef, params, stats = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        p, s = jax.tree.map(lambda a: a, (params, stats))
        bn = nnx.merge(gdef, p, s)
        y = bn(x, use_running_average=False)
        return jnp.sum(jnp.cos(y) * jnp.arange(5.0)), nnx.state(bn, nnx.BatchStat)
    return loss, params


def test_batch_norm_axis_name_under_jax_vmap_and_report():
    ref, sel = _bn_pair()
    x = normal(3, (4, 3, 5), np.arange(1.0, 5.0)[:, None, None])
    out = []
    for m in (ref, sel):
        loss, params = _synced_loss(m, x)
        vg = jax.value_and_grad(loss, (0, 1), has_aux=True)
        out.append(jax.jit(jax.vmap(vg, in_axes=(None, 0), axis_name="batch"))(params, x))
    _close(out[1], out[0])  # values, new running statistics, parameter and input grads
    loss, params = _synced_loss(sel, x)
    per_device = jax.vmap(lambda p, x: loss(p, x)[0], in_axes=(None, 0), axis_name="batch")
    entries = _records(per_device, params, x)
    assert [(e.kind, e.status) for e in entries] == [("norm", "converted")], entries
    assert "pooled over axis 'batch'" in entries[0].target
    res = residual_bytes(lambda p, x: jnp.sum(per_device(p, x)), params, x, argnums=(0, 1))
    assert res.activation_bytes <= x.size * 4 + 1024, str(res)


def test_batch_norm_axis_name_gradient_outside_the_vmap():
    """``nnx.vmap(axis_name=...)`` inside ``nnx.value_and_grad``: the backward pass runs
    outside the vmap, so no collective may sit in a custom backward rule."""
    ref, sel = _bn_pair()
    x = normal(4, (4, 3, 5), shift=2.0)

    def loss(bn, x):
        @nnx.vmap(in_axes=(None, 0), out_axes=0, axis_name="batch")
        def apply(bn, x):
            return bn(x, use_running_average=False)
        return jnp.sum(jnp.sin(apply(bn, x)) * jnp.arange(5.0))

    vg = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
    g_r = vg(ref, x)
    _close(vg(sel, x), g_r)


# ------------------------------------------------------------------------ Dropout rngs
def test_dropout_call_time_rngs_and_deterministic_keep_nnx_semantics():
    ref, sel = _pair(lambda: nnx.Dropout(0.5, broadcast_dims=(0,), rngs=nnx.Rngs(dropout=7)))
    x = normal(4, (3, 10))
    # constructor stream, an Rngs, an RngStream, a raw key: the same bits as NNX's Dropout
    np.testing.assert_array_equal(sel(x), ref(x))
    rr, rs = nnx.Rngs(dropout=9), nnx.Rngs(dropout=9)
    np.testing.assert_array_equal(sel(x, rngs=rs), ref(x, rngs=rr))
    np.testing.assert_array_equal(sel(x, rngs=rs.dropout), ref(x, rngs=rr.dropout))
    _close(nnx.state(rs), nnx.state(rr))
    np.testing.assert_array_equal(sel(x, rngs=K[5]), ref(x, rngs=K[5]))
    np.testing.assert_array_equal(sel(x, deterministic=True), x)
    sel.eval()
    np.testing.assert_array_equal(sel(x), x)
    np.testing.assert_array_equal(sel(x, deterministic=False, rngs=K[6]),
                                  ref(x, deterministic=False, rngs=K[6]))
    # gradient: the same mask, regenerated from the key
    g = lambda m: jax.grad(lambda x: jnp.sum(m(x, deterministic=False, rngs=K[7]) * x))(x)
    np.testing.assert_array_equal(g(sel), g(ref))
    # a module without rngs raises NNX's own error (after saying it runs NNX's own code)
    with pytest.raises(ValueError, match="rngs"), warnings.catch_warnings():
        warnings.simplefilter("ignore", SL.SelectiveFallbackWarning)
        warnings.simplefilter("ignore", jaxmem.NothingConvertedWarning)
        _nnx_convert(nnx.Dropout(0.5))(x, deterministic=False)


def test_dropout_keeps_only_the_key():
    sel = _nnx_convert(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))
    ref = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    x = normal(0, (64, 64))
    w = normal(2, x.shape)
    f = lambda m: lambda x: jnp.sum(m(x, rngs=K[1]) * w)
    assert residual_bytes(f(sel), x).activation_bytes <= 64
    assert residual_bytes(f(ref), x).activation_bytes >= x.size


# ---------------------------------------------------------------------------- Embed
def test_embed_call_and_attend_match_and_attend_is_selective():
    ref, sel = _pair(lambda: nnx.Embed(11, 8, rngs=nnx.Rngs(0)))
    tok = jnp.asarray(np.random.default_rng(2).integers(0, 11, (3, 5), dtype=np.int32))
    q = normal(3, (3, 5, 8))

    def f(m, q):
        return jnp.sum(jnp.sin(m(tok))) + jnp.sum(jnp.cos(m.attend(q)))
    vg = nnx.jit(nnx.value_and_grad(f, argnums=(0, 1)))
    (v_r, g_r), (v_s, g_s) = vg(ref, q), vg(sel, q)
    np.testing.assert_allclose(v_s, v_r, rtol=1e-6)
    _close(g_s, g_r)
    gdef, p = nnx.split(sel)
    h = lambda p, q: jnp.sum(jnp.cos(nnx.merge(gdef, p).attend(q)))
    # the query is differentiated, the table not: the query is not kept
    assert residual_bytes(h, p, q, argnums=1).activation_bytes <= 4 * 3 * 5 * 11 * 2
    entries = _records(lambda p: f(nnx.merge(gdef, p), q), p)
    # attend is a product (the lookup a gather of integer indices: nothing to convert)
    assert [e.status for e in entries if e.kind == "dot"] == ["converted"], entries


# --------------------------------------------------------------------------- fallbacks
def test_custom_dot_general_converted_and_masked_norm_exact():
    """A custom ``dot_general`` is converted by what it computes (a layer rule could not)."""
    lin = _nnx_convert(nnx.Linear(4, 3, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                                rngs=nnx.Rngs(0)))
    x = normal(4, (2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin(x)
    gdef, p = nnx.split(lin)
    recs = _records(lambda p: nnx.merge(gdef, p)(x), p)
    assert [(e.kind, e.status) for e in recs] == [("dot", "converted"), ("bias", "converted")]
    ln = _nnx_convert(nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.NothingConvertedWarning)
        y = ln(x, mask=x > 0)
    np.testing.assert_allclose(y, nnx.LayerNorm(4, rngs=nnx.Rngs(0))(x, mask=x > 0),
                               rtol=1e-6, atol=1e-6)


def test_convert_is_in_place_idempotent_and_leaves_subclasses():
    class MyLinear(nnx.Linear):
        pass

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = MyLinear(3, 3, rngs=rngs)
    net = Net(nnx.Rngs(0))
    kernel, b_kernel = net.a.kernel, net.b.kernel
    x = normal(103, (2, 3))
    b_out = net.b(x)
    assert _nnx_convert(net) is net and _nnx_convert(net) is net
    # the layers are not changed (the root's calls run through jaxmem.transform), the
    # subclass included
    assert net.a.kernel is kernel and type(net.a) is nnx.Linear
    assert type(net.b) is MyLinear and net.b.kernel is b_kernel
    np.testing.assert_array_equal(np.asarray(net.b(x)), np.asarray(b_out))
