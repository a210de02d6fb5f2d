"""Sharded steps on XLA:GPU's plan for 8 x H100 (compiled here without a GPU): the gradient
is reduce-scattered, never all-reduced to a full copy.

A jaxmem MLP block (selective + 3-bit few-bit GELU, every parameter axis divisible by 8)
with Adam. Under FSDP and under DP with ``shard_update`` (the default) each device receives
``(sum_d g_d)[shard]``: reduce-scatters whose results are one eighth of the parameters, and
no all-reduce beyond the scalar loss. The all-reduce DP step (``shard_update=False``) is the
control: it all-reduces every gradient and keeps a replicated Adam state, and its per-device
bytes are above both. Skipped where the CUDA PJRT plugin is not installed.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmem.linen
import jaxmem.selective.linear
from jaxmem import distributed as jd
from jaxmem.models.transformer import MLPBlock

D, HIDDEN, BATCH, T = 128, 512, 16, 8
NDEV = 8
SCALAR = 4  # bytes of the f32 loss, the only value the steps may all-reduce


@pytest.fixture(scope="module", autouse=True)
def _gpu_plan():
    from jaxmem.measure import gpu_plan_available

    if not gpu_plan_available():
        pytest.skip("XLA:GPU plan tests need the CUDA PJRT plugin (docs/measuring.md, "
                    "'XLA:GPU's plan without a GPU')")


@functools.cache
def _case(layers=1, tokens=T):
    base = MLPBlock(HIDDEN, gelu_approximate=True)
    if layers > 1:
        base = nn.Sequential([MLPBlock(HIDDEN, gelu_approximate=True) for _ in range(layers)])
    model = jaxmem.linen.convert(base, fewbit=3)
    x = jax.ShapeDtypeStruct((BATCH, tokens, D), jnp.float32)
    params = jax.eval_shape(base.init, jax.random.key(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    return loss, params, (x, x)


def _param_bytes():
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(_case()[1]))


@functools.cache
def _compiled(mode, shard_update=True, reduce_early=None, layers=1, tokens=T,
              gather_in_layer=True):
    """(memory_analysis, collectives) of the step compiled for 8 x H100.
    ``gather_in_layer=False``: the layers read the step's gathered copy of each weight
    (``grad_layout.unplaced`` made the identity), for comparison."""
    from unittest import mock

    from jaxmem.measure import target_mesh
    from jaxmem.measure.target import compile_lowered

    loss, params, batch = _case(layers, tokens)
    opt = optax.adam(1e-3)
    devs = list(target_mesh("h100", (NDEV,), ("data",)).devices.flat)
    shape = {"data": NDEV // 2, "model": 2} if mode == "tp" else {"data": NDEV}
    step = jd.train_step(loss, opt, jd.mesh(**shape, devices=devs), mode,
                         shard_update=shard_update, reduce_early=reduce_early)
    assert step.reduce_early is (reduce_early is not False)  # on by default on GPU meshes
    with mock.patch("jaxmem.selective.linear.unplaced",
                    (lambda w: w) if not gather_in_layer else jaxmem.selective.linear.unplaced):
        lowered = step.lower(params, jax.eval_shape(opt.init, params), batch)
    compiled, _ = compile_lowered(lowered, "h100", "auto")
    return compiled.memory_analysis(), jd.collectives(compiled.as_text())


def _total(m):
    return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_gradient_is_reduce_scattered_not_all_reduced(mode):
    _, c = _compiled(mode)
    assert c.counts["reduce-scatter"] >= 1, c.counts
    assert c.bytes["reduce-scatter"] == _param_bytes() // NDEV, c.bytes
    assert c.bytes["all-reduce"] <= SCALAR, c.bytes


def test_all_reduce_dp_control_all_reduces_the_whole_gradient():
    _, c = _compiled("dp", shard_update=False)
    assert c.counts["reduce-scatter"] == 0, c.counts
    assert c.bytes["all-reduce"] >= _param_bytes(), c.bytes


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_per_device_bytes_below_the_all_reduce_dp_step(mode):
    """Adam's state is sharded with the update (1/8 of it a device), and the gradient a
    device keeps is its eighth: both the temporaries and the total are below the all-reduce
    step's."""
    m, _ = _compiled(mode)
    ar, _ = _compiled("dp", shard_update=False)
    assert m.temp_size_in_bytes < ar.temp_size_in_bytes, (m, ar)
    assert _total(m) < _total(ar), (_total(m), _total(ar))


@pytest.mark.parametrize("mode,shard_update",
                         [("dp", True), ("fsdp", True), ("dp", False), ("tp", True)])
def test_gradients_reduced_where_formed_lower_per_device_bytes(mode, shard_update):
    """``reduce_early`` (on by default for GPU meshes): each jaxmem layer reduces its weight
    gradient where its backward forms it and passes its input gradient on after it, so
    XLA:GPU no longer keeps every layer's cotangent until one combined reduction at the end
    (FSDP: each weight also kept as its shard and gathered again in the backward; TP on a
    4 x 2 mesh, the layout found by the weight's shape). Fewer temporaries (three blocks,
    128 tokens a device), the same reduction bytes (one per
    parameter instead of one combined; never an all-reduce of a reduce-scattered
    gradient); FSDP gathers the dense weights twice."""
    m, c = _compiled(mode, shard_update, layers=3, tokens=64)
    late, c_late = _compiled(mode, shard_update, reduce_early=False, layers=3, tokens=64)
    assert m.temp_size_in_bytes < late.temp_size_in_bytes, (m, late)
    for kind in ("reduce-scatter", "all-reduce"):
        assert c.bytes[kind] == c_late.bytes[kind], (kind, c.bytes, c_late.bytes)
    assert c.counts["reduce-scatter" if shard_update else "all-reduce"] > 1, c.counts
    gathers = c.bytes["all-gather"] - c_late.bytes["all-gather"]
    kernels = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(_case(3, 64)[1])
                  if a.ndim == 2)
    # every kernel but the first, whose input (the data) needs no gradient: not kept
    regathered = kernels - D * HIDDEN * 4
    assert gathers == (regathered if mode == "fsdp" else 0), (gathers, kernels)


def test_fsdp_layers_gather_their_weight_where_they_run():
    """Under FSDP (``reduce_early``) a jaxmem layer takes its weight's shard, not the copy
    the step gathered before the loss, and gathers it once its input exists: XLA cannot
    combine every weight's all-gather into one at the start of the step, where all gathered
    kernels would be live together. Fewer temporaries than the layers reading the step's
    copy, more (per-layer) all-gathers, the same reductions."""
    m, c = _compiled("fsdp", layers=3, tokens=64)
    held, c_held = _compiled("fsdp", layers=3, tokens=64, gather_in_layer=False)
    assert m.temp_size_in_bytes < held.temp_size_in_bytes, (m, held)
    assert c.counts["all-gather"] > c_held.counts["all-gather"], (c.counts, c_held.counts)
    for kind in ("reduce-scatter", "all-reduce"):
        assert c.bytes[kind] == c_held.bytes[kind], (kind, c.bytes, c_held.bytes)


class _Attention(nn.Module):
    """LayerNorm, then attention over ``q, k, v`` projections of it: three Dense layers split
    by heads under TP (``fused=False``, Flax's and BERT's layout), or one fused projection
    split three ways (GPT-2's ``c_attn``)."""

    fused: bool

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        if self.fused:
            q, k, v = jnp.split(nn.Dense(3 * D, use_bias=False, name="c_attn")(h), 3, -1)
        else:
            q, k, v = (nn.Dense(D, use_bias=False, name=n)(h) for n in ("query", "key", "value"))
        q, k, v = (a.reshape(*a.shape[:-1], 4, D // 4) for a in (q, k, v))
        o = jax.nn.dot_product_attention(q, k, v).reshape(x.shape)
        return x + nn.Dense(D, use_bias=False, name="out")(o)


#: attention layers and tokens of the TP case. Not a saving everywhere: where the peak is
#: the first layer's attention backward (3 layers of 256 tokens: its ``T x S`` arrays), no
#: other layer's ``q, k, v`` is held there, and the recomputation's own buffers cost 2.5 %
LAYERS, TOKENS = 4, 128


def _attention_steps(fused, mode):
    """``{(projections, repeat_collectives): (temp bytes, collectives)}`` of the attention
    stack's step under ``mode`` on the 8 x H100 plan (``"tp"``: 4 x 2 mesh, ``"fsdp"``: 8),
    for ``projections=True`` / ``False`` and ``projections=True`` with
    ``repeat_collectives=True``."""
    import jaxmem
    from jaxmem.measure import target_mesh
    from jaxmem.measure.target import compile_lowered

    model = nn.Sequential([_Attention(fused) for _ in range(LAYERS)])
    x = jax.ShapeDtypeStruct((BATCH, TOKENS, D), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    devs = list(target_mesh("h100", (NDEV,), ("data",)).devices.flat)
    shape = {"data": NDEV // 2, "model": 2} if mode == "tp" else {"data": NDEV}
    mesh = jd.mesh(**shape, devices=devs)
    out = {}
    for projections, repeat in ((True, False), (False, False), (True, True)):
        step = jd.train_step(jaxmem.transform(loss, projections=projections), optax.sgd(0.1),
                             mesh, mode, repeat_collectives=repeat)
        lowered = step.lower(params, jax.eval_shape(optax.sgd(0.1).init, params), (x, x))
        compiled, _ = compile_lowered(lowered, "h100", "auto")
        out[projections, repeat] = (compiled.memory_analysis().temp_size_in_bytes,
                                    jd.collectives(compiled.as_text()))
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["three", "split"])
def test_tp_projections_recomputed_where_no_collective_repeats(fused):
    """TP on the 8 x H100 plan: ``jaxmem.transform``'s attention recomputes ``q, k, v`` from
    the norm's residuals where each device holds its heads' projection columns -- fewer
    bytes per device than with ``projections=False``, and no collective more, kind by kind.
    A fused projection split three ways is kept (its recomputation would repeat the split's
    collective-permutes): the same step as with ``projections=False``, unless the step is
    made with ``repeat_collectives=True`` (fewer bytes, more collective-permutes)."""
    out = _attention_steps(fused, "tp")
    on, off, repeated = out[True, False], out[False, False], out[True, True]
    assert on[1] <= off[1], (on[1].counts, off[1].counts)
    if fused:
        assert on[0] == off[0], out
        # ``repeat_collectives=True``: recomputed, the split's collective-permutes again
        assert repeated[0] < off[0], out
        assert repeated[1].counts["collective-permute"] > off[1].counts["collective-permute"]
    else:
        assert on[0] < off[0], out
        assert repeated == on, out


def test_fsdp_repeat_collectives_recomputes_from_the_gathered_shard():
    """FSDP on the 8 x H100 plan (``reduce_early``: each layer keeps its weight's shard):
    ``q, k, v`` are kept -- the same step as ``projections=False`` -- unless the step is made
    with ``repeat_collectives=True``; then the attention's backward gathers the shard once
    more and recomputes them: fewer bytes per device, more all-gathers."""
    out = _attention_steps(True, "fsdp")
    on, off, repeated = out[True, False], out[False, False], out[True, True]
    assert on == off, out
    assert repeated[0] < off[0], out
    assert repeated[1].counts["all-gather"] > off[1].counts["all-gather"], out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_tp_splits_hugging_face_gpt2_out_in_kernels_by_output():
    """Hugging Face's Flax GPT-2 stores its ``FlaxConv1D`` kernels ``(out, in)``. Split on
    that layout's output axis (``TP_RULES``) its TP step on the 8 x H100 plan keeps fewer
    bytes and moves fewer collective bytes per device than with the kernels split as if
    stored ``(in, out)`` (the names alone: column-parallel layers splitting their inputs,
    each layer's partial sums all-reduced): 18.2 against 21.8 MiB, 14.8 against 30.0 MB at
    hidden 256, 2 layers, 16 x 128 tokens. The collective bytes halve at any size; the temp
    saving needs activations to outweigh the weights (hidden 128, 64 tokens: 6.77 against
    6.06 MB)."""
    from jax.sharding import PartitionSpec as P

    from jaxmem.measure import target_mesh
    from jaxmem.measure.target import compile_lowered

    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {tr.__version__} has no Flax models")
    cfg = tr.GPT2Config(vocab_size=128, n_positions=128, n_embd=256, n_layer=2, n_head=4)
    model = tr.FlaxGPT2LMHeadModel(cfg, _do_init=False)
    params = jax.eval_shape(lambda k: model.init_weights(k, (1, 128)), jax.random.key(0))
    tok = jax.ShapeDtypeStruct((BATCH, 128), jnp.int32)

    def loss(p, batch):
        logits = model(batch[0], params=p, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    names_only = ((r"(c_attn|c_fc)/kernel$", P(None, "model")),
                  (r"(c_attn|c_fc)/bias$", P("model")), (r"c_proj/kernel$", P("model", None)))
    devs = list(target_mesh("h100", (NDEV,), ("data",)).devices.flat)
    mesh = jd.mesh(data=NDEV // 2, model=2, devices=devs)
    out = {}
    for name, rules in (("out_in", None), ("names_only", names_only)):
        step = jd.train_step(loss, optax.sgd(0.1), mesh, "tp", rules=rules)
        lowered = step.lower(params, jax.eval_shape(optax.sgd(0.1).init, params), (tok, tok))
        compiled, _ = compile_lowered(lowered, "h100", "auto")
        c = jd.collectives(compiled.as_text())
        out[name] = (compiled.memory_analysis().temp_size_in_bytes, sum(c.bytes.values()))
    assert out["out_in"][0] < out["names_only"][0], out
    assert out["out_in"][1] < out["names_only"][1], out
