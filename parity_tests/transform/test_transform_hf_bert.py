"""A tiny Hugging Face Flax BERT (random init from a config, no download) under
jaxmem.transform: exact gradients, and the report names its Dense layers, its GELU (an
``ACT2FN`` partial, matched by what it computes), its three LayerNorms (embeddings and two
per layer) as selective normalisations, and its attention (Flax's weights, HF's head-mask
einsum, the einsum with v) as one exact memory-lean attention.  The other Hugging Face
models are in ``parity_tests/third_party``."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.transform import transform

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FlaxPreTrainedModel"):   # transformers 5 dropped Flax
    pytest.skip(f"transformers {transformers.__version__} has no Flax models",
                allow_module_level=True)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _util import close


def _model():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    # Hugging Face's own initialisation runs op by op (seconds); one jitted init instead
    m = transformers.FlaxBertForSequenceClassification(cfg, _do_init=False)
    init = jax.jit(m.init_weights, static_argnums=1)
    return m, init(jax.random.key(int(np.random.default_rng().integers(2**31))), m.input_shape)


def test_tiny_bert_gradients_are_exact_and_reported():
    m, params = _model()
    rng = np.random.default_rng()
    ids = jnp.asarray(rng.integers(0, 64, (2, 8)))
    mask = jnp.ones((2, 8), jnp.int32).at[1, 6:].set(0)

    def loss(params, ids, mask):
        return jnp.sum(m(ids, attention_mask=mask, params=params, train=False).logits ** 2)

    g = transform(loss)
    # one compiled program for both sides
    got, want = jax.jit(lambda *a: (jax.grad(g)(*a), jax.grad(loss)(*a)))(params, ids, mask)
    close(got, want, rtol=1e-5, atol=1e-6)
    rep = g.report(params, ids, mask)
    dots = [r for r in rep.by_kind("dot") if r.converted]
    assert len(dots) >= 8                      # q, k, v, out, up, down, pooler, classifier
    gelu = [r for r in rep.by_kind("activation") if "erfc" in r.matched]
    assert gelu and gelu[0].converted and "modeling_flax_bert" in gelu[0].where
    # an ACT2FN partial, found by what it computes: keeps its input, the product recomputes
    assert gelu[0].became.startswith("exact") and "recomputed by the product" in gelu[0].reason
    att = rep.by_kind("attention")     # flax weights + HF's head-mask einsum + einsum with v
    assert [r.converted for r in att] == [True] and "head factor" in att[0].matched
    norms = rep.by_kind("norm")
    assert [r.converted for r in norms] == [True] * 3
    assert all(r.matched.startswith("layer norm") and "eps 1e-12" in r.matched for r in norms)
    assert all(r.reason for r in rep.unconverted())
