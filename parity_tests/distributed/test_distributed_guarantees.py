"""One-device checks of what ``jaxmem.distributed`` promises: tensor-parallel rules match
Flax's auto-names, and ``TrainStep.init`` never hands the caller's buffers to a donating
step."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxmem import distributed as jd


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, tok):
        h = nn.Conv(4, (3, 3))(x)
        h = nn.Conv(6, (3,))(h.reshape(h.shape[0], -1, h.shape[-1]))
        h = nn.ConvTranspose(4, (3,))(h)
        e = nn.Embed(10, 4)(tok)
        return jnp.mean(h) + jnp.mean(e)


def _specs(params, mesh, mode):
    sh = jd.param_shardings(params, mesh, mode)
    return {jd.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(sh)[0]}


def test_tp_splits_auto_named_convs_on_output_channels_and_embeddings_on_vocab():
    x, tok = _x(0, (2, 5, 5, 3)), jnp.array([[1, 2, 3]])
    params = jax.eval_shape(_Net().init, jax.random.key(0), x, tok)["params"]  # shapes only
    specs = _specs(params, jd.mesh(data=1, model=1), "tp")
    for name in ("Conv_0/kernel", "Conv_1/kernel", "ConvTranspose_0/kernel"):
        ndim = params[name.split("/")[0]]["kernel"].ndim
        assert specs[name] == P(*([None] * (ndim - 1) + ["model"])), (name, specs[name])
    assert specs["Embed_0/embedding"] == P("model", None)
    assert specs["Conv_0/bias"] == P()  # biases of convs stay replicated


def test_init_copies_the_callers_params_so_donating_steps_leave_them_usable():
    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    params = {"w": _x(1, (4, 2)), "b": _x(2, (2,))}
    kept = jax.tree.map(lambda a: np.array(a, copy=True), params)  # no view kept alive
    batch = {"x": _x(3, (8, 4)), "y": _x(4, (8, 2))}
    for mode in ("dp", "fsdp", "tp"):
        step = jd.train_step(loss_fn, optax.sgd(0.1), jd.mesh(data=1, model=1), mode)
        p, s = step.init(params)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
            assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        for _ in range(2):
            p, s, _ = step(p, s, batch)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(kept)):
            assert not a.is_deleted()
            np.testing.assert_array_equal(np.asarray(a), b)
        assert not np.allclose(np.asarray(p["w"]), kept["w"])  # the step did train


def test_weights_whole_only_where_no_layout_splits_a_weight():
    """Recomputing a product of a weight in the backward pass (``projections``) adds no
    collective only where every device holds the whole weight: one device, a data parallel
    step (no feature axis split, no weight kept as its shard). Not under tensor
    parallelism, not in a fully sharded step with ``reduce_early`` (its layers hold
    shards), not under a bare mesh whose layout jaxmem does not know."""
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

    from jaxmem._prims.bitpack import shard_axes
    from jaxmem._prims.grad_layout import gradient_layout, weights_whole

    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    assert weights_whole()
    with jax.sharding.use_abstract_mesh(mesh):
        assert not weights_whole()
        with shard_axes():
            assert weights_whole()                                   # "dp"
            with gradient_layout(lambda s: None):
                assert weights_whole()                               # "dp", reduce_early
            with gradient_layout(lambda s: None, lambda s: None,
                                 NamedSharding(mesh, PartitionSpec())):
                assert not weights_whole()                           # "fsdp", reduce_early
        with shard_axes("data"):
            assert not weights_whole()                               # "tp"-like


def test_weights_local_adds_tensor_parallel_steps_only():
    """A product of a weight split along its output features (a tensor parallel step: a
    feature axis named, no weight kept as its shard) recomputes on each device without a
    collective, beside everywhere :func:`weights_whole` holds; a fully sharded step with
    ``reduce_early`` (weights kept as shards) and a bare mesh are not. A split of such a
    product's features is recomputed only where weights are whole or the step allows its
    collectives to run again (``repeat_collectives``, checked), which also lets a fully
    sharded step recompute from its kept shard gathered once more."""
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

    from jaxmem._prims.bitpack import shard_axes
    from jaxmem._prims.grad_layout import (
        gradient_layout,
        regathering_recomputes,
        repeated_collectives,
        reslice_recomputable,
        weights_local,
        weights_whole,
    )

    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert weights_local()
    with jax.sharding.use_abstract_mesh(mesh):
        assert not weights_local()                                   # layout unknown
        with shard_axes():
            assert weights_local()                                   # "dp"
        with shard_axes("model"):
            assert weights_local() and not weights_whole()           # "tp"
            with gradient_layout(lambda s: None):
                assert weights_local()                               # "tp", reduce_early
        with shard_axes(), gradient_layout(lambda s: None, lambda s: None,
                                           NamedSharding(mesh, PartitionSpec())):
            assert not weights_local()                               # "fsdp", reduce_early
            assert not reslice_recomputable() and not regathering_recomputes()
            with repeated_collectives(True):                         # the shard gathered again
                assert reslice_recomputable() and regathering_recomputes()
        with shard_axes("model"):
            assert not reslice_recomputable()                        # a fused split: kept
            with repeated_collectives(True):
                assert reslice_recomputable()                        # unless allowed
        with shard_axes():
            assert reslice_recomputable()                            # "dp": whole weights
    with pytest.raises(TypeError, match="allow"), repeated_collectives("yes"):
        pass
    with pytest.raises(TypeError, match="repeat_collectives"):
        jd.train_step(lambda p, b: 0.0, optax.sgd(0.1), jd.mesh(data=1), "tp",
                      repeat_collectives=1)


def _sds_tree(tree):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree,
                        is_leaf=lambda s: isinstance(s, tuple))


def test_tp_splits_output_features_of_kernels_stored_out_in():
    """Hugging Face's GPT-2 stores its ``FlaxConv1D`` kernels ``(out, in)``: the column-
    parallel ``c_attn`` / ``c_fc`` still split their outputs (the axis of the bias's length),
    the row-parallel ``c_proj`` their inputs, the square ``attn/c_proj`` like its module's
    ``c_attn``. The same names stored ``(in, out)`` (Flax's ``Dense``, the zoo) keep the
    plain rules; user rules are taken as written."""
    d = 8
    out_in = {"attn": {"c_attn": {"kernel": (3 * d, d), "bias": (3 * d,)},
                       "c_proj": {"kernel": (d, d), "bias": (d,)}},
              "mlp": {"c_fc": {"kernel": (4 * d, d), "bias": (4 * d,)},
                      "c_proj": {"kernel": (d, 4 * d), "bias": (d,)}}}
    in_out = {"attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                       "c_proj": {"kernel": (d, d), "bias": (d,)}},
              "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                      "c_proj": {"kernel": (4 * d, d), "bias": (d,)}}}
    m = jd.mesh(data=1, model=1)
    col, row = P(None, "model"), P("model", None)
    got = _specs(_sds_tree(out_in), m, "tp")
    assert got["attn/c_attn/kernel"] == row and got["mlp/c_fc/kernel"] == row
    assert got["attn/c_proj/kernel"] == col and got["mlp/c_proj/kernel"] == col
    assert got["attn/c_attn/bias"] == P("model") and got["mlp/c_proj/bias"] == P()
    got = _specs(_sds_tree(in_out), m, "tp")
    assert got["attn/c_attn/kernel"] == col and got["mlp/c_fc/kernel"] == col
    assert got["attn/c_proj/kernel"] == row and got["mlp/c_proj/kernel"] == row
    sh = jd.param_shardings(_sds_tree(out_in), m, "tp", rules=[(r"c_attn/kernel$", col)])
    assert sh["attn"]["c_attn"]["kernel"].spec == col


def test_tp_rules_name_bert_t5_and_llama_layers():
    """Megatron pairs by the names of common Flax transformer implementations: BERT /
    RoBERTa / ViT (``intermediate/dense`` then ``output/dense``; ``attention/output/dense``),
    T5 (``SelfAttention/q``.. then ``/o``; ``wi`` / ``wi_0`` then ``wo``), LLaMA-style
    (``gate_proj`` / ``up_proj`` then ``down_proj``), DistilBERT and BLOOM."""
    d = 8
    k = lambda a, b: {"kernel": (a, b)}
    params = {"layer": {"attention": {"self": {"query": k(d, d)}, "output": {"dense": k(d, d)}},
                        "intermediate": {"dense": k(d, 4 * d)},
                        "output": {"dense": k(4 * d, d)}},
              "t5": {"SelfAttention": {"q": k(d, d), "o": k(d, d)},
                     "DenseReluDense": {"wi_0": k(d, 4 * d), "wo": k(4 * d, d)}},
              "llama": {"mlp": {"gate_proj": k(d, 4 * d), "down_proj": k(4 * d, d)}},
              "distilbert": {"q_lin": k(d, d), "out_lin": k(d, d), "lin1": k(d, 4 * d),
                             "lin2": k(4 * d, d)},
              "bloom": {"self_attention": {"query_key_value": k(d, 3 * d), "dense": k(d, d)},
                        "mlp": {"dense_h_to_4h": k(d, 4 * d), "dense_4h_to_h": k(4 * d, d)}},
              "pooler": {"dense": k(d, d)}}
    got = _specs(_sds_tree(params), jd.mesh(data=1, model=1), "tp")
    col, row = P(None, "model"), P("model", None)
    for path in ("layer/attention/self/query", "layer/intermediate/dense", "t5/SelfAttention/q",
                 "t5/DenseReluDense/wi_0", "llama/mlp/gate_proj", "distilbert/q_lin",
                 "distilbert/lin1", "bloom/self_attention/query_key_value",
                 "bloom/mlp/dense_h_to_4h"):
        assert got[path + "/kernel"] == col, path
    for path in ("layer/attention/output/dense", "layer/output/dense", "t5/SelfAttention/o",
                 "t5/DenseReluDense/wo", "llama/mlp/down_proj", "distilbert/out_lin",
                 "distilbert/lin2", "bloom/self_attention/dense", "bloom/mlp/dense_4h_to_h"):
        assert got[path + "/kernel"] == row, path
    assert got["pooler/dense/kernel"] == P()
