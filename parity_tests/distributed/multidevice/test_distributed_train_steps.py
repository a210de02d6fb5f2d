"""DP / FSDP / TP train steps of zoo models with jaxmem (selective + few-bit) on 8 devices.

Gradients under each sharding equal the one-device gradients of the same model, they land
on each device's update shard (reduce-scattered, not all-reduced to a full copy, with
``shard_update``), and the update run on the shards equals the one-device update; the
compiled step of the jaxmem model has, kind by kind, no more collectives than plain JAX's
step under the same sharding.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem.models import ResNet, gpt

MODES = {"dp": {"data": 8}, "fsdp": {"data": 8}, "tp": {"data": 4, "model": 2},
         "dp-ar": {"data": 8}}  # dp-ar: the gradient all-reduced, the update replicated


def _gpt_case():
    model = gpt(vocab=64, ctx=8, d_model=32, n_head=4, n_layer=1)
    tok = jax.random.randint(jax.random.PRNGKey(1), (8, 8), 0, 64)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tok)["params"]

    def loss(m, p, batch):
        logits = m.apply({"params": p}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return model, params, (tok, jnp.roll(tok, -1, 1)), loss


def _resnet_case(block="basic", stage_sizes=(1, 1)):
    model = ResNet(block=block, stage_sizes=stage_sizes, width=0.125, num_classes=8,
                   stem="cifar")
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 8, 8, 3))
    y = jax.random.randint(jax.random.PRNGKey(3), (8,), 0, 8)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)

    def loss(m, p, batch):
        logits = m.apply({"params": p, "batch_stats": variables["batch_stats"]}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return model, variables["params"], (x, y), loss


CASES = {"gpt": _gpt_case, "resnet": _resnet_case}


@functools.cache
def _case(name):
    model, params, batch, loss = CASES[name]()
    jm = jaxmem.linen.convert(model, fewbit=3)
    return params, batch, functools.partial(loss, model), functools.partial(loss, jm)


LR = 0.5


def _recording_sgd():
    """SGD (``p - LR * g``) whose state after one update is the gradient itself: the
    compiled train step yields the gradients, the updated parameters and its HLO at once."""
    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return jax.tree.map(lambda g: -LR * g, grads), grads

    return optax.GradientTransformation(init, update)


@functools.cache
def _step(name, mode, which, reduce_early=None):
    """((gradients, new parameters) after one step, collectives, update shardings) of the
    compiled sharded step."""
    params, batch, plain_loss, jm_loss = _case(name)
    loss = plain_loss if which == "plain" else jm_loss
    opt = _recording_sgd()
    m = jd.mesh(**MODES[mode])
    step = jd.train_step(loss, opt, m, mode.removesuffix("-ar"), donate=False,
                         shard_update=not mode.endswith("-ar"), reduce_early=reduce_early)
    p, s = step.init(params)
    with jax.set_mesh(m):  # the mesh in context sets the blocks of packed residuals
        compiled = step.lower(p, s, batch).compile()
    out = compiled(p, s, batch)[:2][::-1] if which == "jaxmem" else None
    return out, jd.collectives(compiled.as_text()), step.update_shardings(params)


def _close(got, want, rtol=2e-5):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = float(np.max(np.abs(g - w))) / (float(np.max(np.abs(w))) + 1e-30)
        assert err < rtol, f"{jd.path_str(path)}: relative error {err:.2e}"


@functools.cache
def _single_device_grads(name):
    params, batch, _, jm_loss = _case(name)
    return jax.jit(jax.grad(jm_loss))(params, batch)


#: every layout for each model; the all-reduce DP step for the GPT only
LAYOUTS = [(n, m) for n in CASES for m in MODES if m != "dp-ar" or n == "gpt"]


@pytest.mark.parametrize("name,mode", LAYOUTS)
def test_sharded_grads_and_update_equal_single_device(name, mode):
    """The gradient lands on the update shards (DP and TP too: split over 'data' wherever
    an axis fits) and ``p - LR * g`` computed there equals the one-device step."""
    (got, new), _, ush = _step(name, mode, "jaxmem")
    want = _single_device_grads(name)
    _close(got, want)
    for g, sh in zip(jax.tree.leaves(got), jax.tree.leaves(ush)):
        assert g.sharding.is_equivalent_to(sh, g.ndim)
    assert any("data" in str(sh.spec) for sh in jax.tree.leaves(ush)) != (mode == "dp-ar")
    params = _case(name)[0]
    _close(new, jax.tree.map(lambda p, g: p - LR * g, params, want))


@pytest.mark.parametrize("name,mode", LAYOUTS)
def test_gradients_reduced_early_equal_single_device(name, mode):
    """``reduce_early=True`` (the default on GPU meshes, forced here on CPU): jaxmem's layers
    lay their parameter gradients out as the step reduces them, inside the backward pass.
    Gradients and update are the one-device ones, on the same update shards."""
    (got, new), _, ush = _step(name, mode, "jaxmem", reduce_early=True)
    want = _single_device_grads(name)
    _close(got, want)
    for g, sh in zip(jax.tree.leaves(got), jax.tree.leaves(ush)):
        assert g.sharding.is_equivalent_to(sh, g.ndim)
    _close(new, jax.tree.map(lambda p, g: p - LR * g, _case(name)[0], want))


@functools.cache
def _scanned_stack():
    """Three MLP blocks under ``nn.scan`` (the weights a slice of a stacked parameter in the
    loop body), the loss converted with ``jaxmem.transform``."""
    import flax.linen as nn

    from jaxmem.models.transformer import MLPBlock

    class Body(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return MLPBlock(64, gelu_approximate=True)(c) + c, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)()(x, None)[0]

    base = Stack()
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 4, 16))
    y = jax.random.normal(jax.random.PRNGKey(2), (16, 4, 16))
    params = jax.jit(base.init)(jax.random.PRNGKey(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((base.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    return params, (x, y), loss


@pytest.mark.parametrize("mode", ["dp", "fsdp", "tp"])
def test_gradients_reduced_early_inside_scan_equal_single_device(mode):
    """A scanned stack converted by ``jaxmem.transform``: the layers reduce (and under FSDP
    keep and re-gather) each weight slice inside the loop body; gradients are unchanged."""
    import jaxmem

    params, batch, loss = _scanned_stack()
    step = jd.train_step(jaxmem.transform(loss), optax.sgd(0.1), jd.mesh(**MODES[mode]), mode,
                         donate=False, reduce_early=True)
    p, _ = step.init(params)
    _close(step.grads(p, batch)[1], jax.jit(jax.grad(loss))(params, batch))


def test_reduce_early_is_off_on_cpu_and_checked():
    m = jd.mesh(data=8)
    assert jd.train_step(lambda p, b: 0.0, optax.sgd(0.1), m, "dp").reduce_early is False
    with pytest.raises(TypeError, match="reduce_early"):
        jd.train_step(lambda p, b: 0.0, optax.sgd(0.1), m, "dp", reduce_early="yes")


@pytest.mark.parametrize("name,mode", LAYOUTS)
def test_jaxmem_adds_no_collectives(name, mode):
    """ResNet under TP has 8 channels split 4+4 over 'model': its 1-bit ReLU masks are packed
    in blocks so that no byte straddles the shard boundary."""
    plain = _step(name, mode, "plain")[1]
    jm = _step(name, mode, "jaxmem")[1]
    assert jm <= plain, f"jaxmem {jm.counts} vs plain {plain.counts}"


def test_param_shardings_rules():
    params, *_ = _case("gpt")
    m = jd.mesh(data=4, model=2)
    sh = jd.param_shardings(params, m, "tp")
    attn = sh["h_0"]["attn"]
    assert attn["c_attn"]["kernel"].spec == jax.sharding.PartitionSpec(None, "model")
    assert attn["c_proj"]["kernel"].spec == jax.sharding.PartitionSpec("model", None)
    fs = jd.param_shardings(params, jd.mesh(data=8), "fsdp")
    assert fs["h_0"]["mlp"]["c_fc"]["kernel"].spec == jax.sharding.PartitionSpec(None, "data")
    with pytest.raises(ValueError, match="mode must be one of"):
        jd.param_shardings(params, m, "zero")
    with pytest.raises(ValueError, match="data\\*model"):
        jd.mesh(data=8, model=2)


@pytest.mark.parametrize("hidden,axes", [(48, None), (40, None), (40, ("model",))])
def test_fewbit_residual_stays_sharded_over_model(hidden, axes):
    """3-bit codes go 8 per 3 bytes; hidden 40 split 20+20 over 'model' packs in blocks (8 for
    any split over the 4x2 mesh, 2 when only 'model' may split the features)."""
    import contextlib

    from jaxmem._prims.bitpack import shard_axes
    from jaxmem.models.transformer import MLPBlock

    base = MLPBlock(hidden, gelu_approximate=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4, 16))
    params = jax.jit(base.init)(jax.random.PRNGKey(1), x)["params"]
    m = jd.mesh(data=4, model=2)
    sh = jd.param_shardings(params, m, "tp")
    counts = {}
    for which, mod in (("plain", base), ("jaxmem", jaxmem.linen.convert(base, fewbit=3))):
        f = jax.jit(jax.grad(lambda p, x, mod=mod: jnp.sum(mod.apply({"params": p}, x) ** 2)),
                    in_shardings=(sh, jd.batch_sharding(m)), out_shardings=sh)
        with jax.set_mesh(m), (contextlib.nullcontext() if axes is None else shard_axes(*axes)):
            counts[which] = jd.compiled_collectives(f, params, x)
    assert counts["jaxmem"] <= counts["plain"], (counts["jaxmem"].counts, counts["plain"].counts)


def test_bottleneck_tp_expansion_option_adds_no_collectives():
    """A bottleneck's 1x1 expansion recomputed in its BatchNorm's backward (the default,
    ``conv_recompute=True``) gives the plain step's gradients under TP. On the 8 x H100 plan
    of ResNet-50 the recomputation repeats that convolution's collective (82 all-gathers
    against 50, ``benchmarks/results/distributed/h100``; on these host devices and this
    small net XLA:CPU partitions it without one), so ``conv_recompute=False`` is what keeps
    jaxmem's step at no more collectives than plain JAX's, kind by kind: asserted here."""
    model, params, batch, loss = _resnet_case("bottleneck", (1,))
    mesh = jd.mesh(**MODES["tp"])
    out = {}
    for which, m in (("plain", model), ("recompute", jaxmem.linen.convert(model)),
                     ("kept", jaxmem.linen.convert(model, conv_recompute=False))):
        step = jd.train_step(functools.partial(loss, m), _recording_sgd(), mesh, "tp",
                             donate=False)
        p, s = step.init(params)
        with jax.set_mesh(mesh):
            compiled = step.lower(p, s, batch).compile()
        out[which] = (compiled(p, s, batch)[1], jd.collectives(compiled.as_text()))
    _close(out["recompute"][0], out["plain"][0])
    _close(out["kept"][0], out["plain"][0])
    assert out["kept"][1] <= out["plain"][1], (out["kept"][1].counts, out["plain"][1].counts)


@functools.cache
def _mha_case():
    """Flax's own multi-head attention (separate ``query`` / ``key`` / ``value`` projections:
    the TP rules split each by heads) after a LayerNorm, and the same with one fused
    projection split three ways (GPT-2's ``c_attn``)."""
    import flax.linen as nn

    class Three(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            # no biases: the key bias has a zero gradient (softmax is shift-invariant per row)
            return x + nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False,
                                                       name="attn")(h, h)

    x = jax.random.normal(jax.random.PRNGKey(4), (8, 64, 128))
    y = jax.random.normal(jax.random.PRNGKey(5), (8, 64, 128))
    model = Three()
    params = jax.jit(model.init)(jax.random.PRNGKey(6), x)["params"]

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    return params, (x, y), loss


def test_tp_step_recomputes_head_split_projections_without_collectives():
    """Under TP each device holds its heads' columns of the query, key and value kernels, so
    ``jaxmem.transform``'s attention recomputes ``q, k, v`` there from the norm's residuals
    (``projections=True``) with no collective: gradients are the one-device ones, the step
    has, kind by kind, no more collectives than with the projections kept, and keeps fewer
    bytes per device."""
    import jaxmem

    params, batch, loss = _mha_case()
    mesh = jd.mesh(**MODES["tp"])
    assert jd.param_shardings(params, mesh, "tp")["attn"]["query"]["kernel"].spec == \
        jax.sharding.PartitionSpec(None, "model")
    out = {}
    for projections in (True, False):
        step = jd.train_step(jaxmem.transform(loss, projections=projections),
                             _recording_sgd(), mesh, "tp", donate=False)
        p, s = step.init(params)
        with jax.set_mesh(mesh):
            compiled = step.lower(p, s, batch).compile()
        out[projections] = (compiled(p, s, batch)[1], jd.collectives(compiled.as_text()),
                            compiled.memory_analysis().temp_size_in_bytes)
    _close(out[True][0], jax.jit(jax.grad(loss))(params, batch))
    assert out[True][1] <= out[False][1], (out[True][1].counts, out[False][1].counts)
    assert out[True][2] < out[False][2], (out[True][2], out[False][2])


@pytest.mark.parametrize("mode,kind", [("tp", "collective-permute"), ("fsdp", "all-gather")])
def test_repeat_collectives_recomputes_the_fused_projection(mode, kind):
    """The zoo GPT's fused ``c_attn`` split three ways: under TP its ``q, k, v`` are kept
    (the split moves columns between devices), under FSDP with ``reduce_early`` too (the
    layer keeps its weight's shard), unless the step is made with
    ``repeat_collectives=True``; then they are recomputed, the split's collective-permutes
    (TP) or the weight's all-gather (FSDP) run again in the backward pass, and the
    gradients are still the one-device ones."""
    import jaxmem

    model, params, batch, loss = _gpt_case()
    fn = jaxmem.transform(functools.partial(loss, model))
    mesh = jd.mesh(**MODES[mode])
    out = {}
    for repeat in (False, True):
        step = jd.train_step(fn, _recording_sgd(), mesh, mode, donate=False,
                             reduce_early=True, repeat_collectives=repeat)
        p, s = step.init(params)
        with jax.set_mesh(mesh):
            compiled = step.lower(p, s, batch).compile()
        out[repeat] = (compiled(p, s, batch)[1], jd.collectives(compiled.as_text()))
    want = jax.jit(jax.grad(functools.partial(loss, model)))(params, batch)
    _close(out[True][0], want)
    _close(out[False][0], want)
    counts = {r: c.counts[kind] for r, (_, c) in out.items()}
    assert counts[True] > counts[False], counts


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hugging_face_gpt2_tp_gradients_with_out_in_kernels():
    """Hugging Face's Flax GPT-2 under TP: its ``FlaxConv1D`` kernels are stored
    ``(out, in)`` and split on that layout's output axis (``c_attn`` / ``c_fc`` rows,
    ``c_proj`` columns); with each layer reducing its gradient in place (``reduce_early``)
    and under ``jaxmem.transform`` the gradients are the one-device ones."""
    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {tr.__version__} has no Flax models")
    import jaxmem

    cfg = tr.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = tr.FlaxGPT2LMHeadModel(cfg, _do_init=False)
    shapes = jax.eval_shape(lambda k: model.init_weights(k, (1, 8)), jax.random.PRNGKey(0))
    keys = iter(jax.random.split(jax.random.PRNGKey(7), len(jax.tree.leaves(shapes))))
    params = jax.tree.map(lambda s: 0.2 * jax.random.normal(next(keys), s.shape, s.dtype),
                          shapes)
    tok = jax.random.randint(jax.random.PRNGKey(8), (8, 8), 0, 64)
    batch = (tok, jnp.roll(tok, -1, 1))

    def loss(p, batch):
        logits = model(batch[0], params=p, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    mesh = jd.mesh(**MODES["tp"])
    spec = jd.param_shardings(params, mesh, "tp")["transformer"]["h"]["0"]
    assert spec["attn"]["c_attn"]["kernel"].spec == jax.sharding.PartitionSpec("model", None)
    assert spec["mlp"]["c_proj"]["kernel"].spec == jax.sharding.PartitionSpec(None, "model")
    want = jax.jit(jax.grad(loss))(params, batch)
    for fn in (loss, jaxmem.transform(loss)):
        step = jd.train_step(fn, _recording_sgd(), mesh, "tp", donate=False,
                             reduce_early=True)
        p, s = step.init(params)
        with jax.set_mesh(mesh):
            compiled = step.lower(p, s, batch).compile()
        _close(compiled(p, s, batch)[1], want)
