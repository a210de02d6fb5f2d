"""Hugging Face ``transformers`` 4.x Flax models (tiny configs: hidden 32, one layer -- two in
T5's encoder --, sequence 8; random weights, nothing downloaded) under ``jaxmem.transform``: the loss and
its gradients equal the untouched model's, in train mode (dropout with the same rng) and in
evaluation mode, and the report accounts for every Dense / Conv1D / convolution, norm,
activation, attention and dropout of the config with what happened to it.

The untouched and the transformed step are compiled as one program (``values_and_grads``;
the suite's cheap code generation, ``FAST_CODEGEN`` in ``parity_tests/conftest.py``, applies).
"""
from __future__ import annotations

import collections
import sys

import jax
import pytest

_transformers = pytest.importorskip("transformers")
if not hasattr(_transformers, "FlaxPreTrainedModel"):   # transformers 5 dropped Flax
    pytest.skip(f"transformers {_transformers.__version__} has no Flax models",
                allow_module_level=True)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0])
sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/transform")
from _assert import assert_tree_close, scaled_atol
from _models import CASES, T5_ENC_LAYERS, L
from _util import values_and_grads

from jaxmem.transform import transform

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

def _close(got, want):
    """Leaf-wise ``|got - want| <= 1e-5 max(1, max|want|) + 1e-5 |want|`` (f32 rounding of
    differently ordered sums; a gradient that is 0 in exact arithmetic, e.g. of the key
    bias under a softmax, is rounding noise on both sides)."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert_tree_close(got, want, rtol=1e-5, atol=scaled_atol(1e-5, floor=1.0))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    c = CASES[request.param]()
    c.name = request.param
    return c


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_loss_and_gradients_are_exact(case, train):
    if not train and case.name in ("t5", "clip", "roberta"):
        pytest.skip("evaluation mode of the large encoder-decoder / dual models: the same "
                    "ops as train mode minus dropout, covered by bert / gpt2 / vit")
    rng = jax.random.key(jax.random.randint(jax.random.key(0), (), 0, 2**30).item()
                         ^ hash(case.name) % 997)

    def f(p, *inputs):
        return case.loss(p, inputs, rng, train)

    got, want = values_and_grads([transform(f), f], case.params, *case.inputs)
    _close(got, want)


def _counts(case, train, **options):
    rng = jax.random.key(0)
    g = transform(lambda p, *inputs: case.loss(p, inputs, rng, train), **options)
    rep = g.report(case.params, *case.inputs)
    assert all(r.reason for r in rep.unconverted())
    return rep, collections.Counter((r.kind, r.converted) for r in rep)


# per config: (dots, convs, norms, piecewise-linear activations, smooth activations,
# attentions, dropouts in train mode, attentions with dropout in train mode) -- from the
# architecture, L layers (T5: E encoder and L decoder layers)
def _expected(name, train):
    if name == "resnet" and not train:
        # running averages: each BatchNorm is affine in x, nothing to re-emit; the smooth
        # rsqrt(running var + eps) of each is reported (kept as it is)
        return (0, 6, 0, 5, 6, 0, 0, 0)
    E = T5_ENC_LAYERS
    drop_att = {"t5": E + L, "clip": 0}.get(name, L)
    return {
        # q k v o, up, down per layer; MLM head transform + tied decoder; GELU per layer and
        # in the head; LN: embeddings, 2 per layer, head; dropout: embeddings, 2 per layer
        "bert": (6 * L + 2, 0, 2 * L + 2, 0, L + 1, L, 2 * L + 1, L),
        # as BERT with a pooler (Dense + tanh) instead of the MLM head
        "roberta": (6 * L + 1, 0, 2 * L + 1, 0, L + 1, L, 2 * L + 1, L),
        # Conv1D: c_attn (q, k, v in one), c_proj, c_fc, c_proj per layer; tied LM head;
        # LN: 2 per layer + final; dropout: embeddings, attention output, MLP output
        "gpt2": (4 * L + 1, 0, 2 * L + 1, 0, L, L, 2 * L + 1, L),
        # patch embedding conv; 6 per layer + pooler; LN 2 per layer + final; GELU per
        # layer (the pooler's tanh is summed by the loss: no activation to approximate)
        "vit": (6 * L + 1, 1, 2 * L + 1, 0, L, L, 2 * L + 1, L),
        # encoder 6 per layer, decoder 10 per layer, LM head; RMS norms 2E+1 / 3L+1; ReLU
        # per layer; attention: encoder self, decoder self + cross (Hugging Face calls the
        # cross-attention without ``deterministic``: it never drops); dropout: embeddings,
        # each residual branch, after each ReLU, final (per stack)
        "t5": (6 * E + 10 * L + 1, 0, 2 * E + 3 * L + 2, E + L, 0, E + 2 * L,
               3 * E + 4 * L + 4, drop_att),
        # stem conv, per basic block two convs (+ a projection shortcut where the width
        # changes), a BatchNorm after each conv, ReLUs; no dropout
        "resnet": (0, 6, 6, 5, 0, 0, 0, 0),
        # text and vision towers: 6 per layer, projections; LN 2 per layer + final (+ the
        # vision pre-LN); quick_gelu per layer and exp(logit_scale); the logits are a product
        # of the two towers' embeddings; L2 normalisations kept (no eps: not a norm)
        "clip": (12 * L + 3, 1, 4 * L + 3, 0, 2 * L + 1, 2 * L, 0, 0),
        # q k v out_lin, lin1, lin2 per layer; MLM head transform + tied projector; LN:
        # embeddings, 2 per layer, head; GELU per layer and in the head; dropout:
        # embeddings, the FFN's; scores minus 1e30 (1 - mask): a subtracted bias
        "distilbert": (6 * L + 2, 0, 2 * L + 2, 0, L + 1, L, L + 1, L),
        # q k v o, gate, up, down per layer and the LM head; RMS norms 2 per layer + final;
        # SiLU gating each MLP (a gated product per layer); no dropout
        "llama": (7 * L + 1, 0, 2 * L + 1, 0, L, L, 0, 0),
        # as ViT without the pooler's Dense (mean pooling + LN instead of a final LN)
        "beit": (6 * L, 1, 2 * L + 1, 0, L, L, 2 * L + 1, L),
    }[name]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_report_accounts_for_every_layer(case, train):
    rep, n = _counts(case, train)
    dots, convs, norms, act_on, act_off, atts, drops, drop_att = _expected(case.name, train)
    # gated linear units (Llama's SwiGLU): one gated product per layer
    assert n["gate", True] == (L if case.name == "llama" else 0)
    # BEiT's layer scales gamma * (h W + b), two per layer: materialised where they read the
    # product directly (evaluation mode; in train mode the dropout between them is re-emitted,
    # and the selective dropout's output is what the scale reads)
    assert n["scale", True] == (2 * L if case.name == "beit" and not train else 0)
    assert n["dot", True] == dots and not n["dot", False]
    assert n["conv", True] == convs and not n["conv", False]
    assert n["norm", True] == norms
    # without fewbit a smooth activation keeps its input only (exact), except where JAX's
    # autodiff keeps a single array anyway: CLIP's exp(logit_scale), the rsqrt of each
    # running variance (eval-mode batch norm)
    stay = act_off if case.name == "resnet" else {"clip": 1}.get(case.name, 0)
    assert n["activation", True] == act_on + act_off - stay
    exact = [r for r in rep.by_kind("activation") if r.became.startswith("exact")]
    assert len(exact) == act_off - stay
    assert n["attention", True] == atts and not n["attention", False]
    assert n["dropout", True] == (drops if train else 0) and not n["dropout", False]
    smooth = [r for r in rep.by_kind("activation") if not r.converted and "smooth" in r.reason]
    assert len(smooth) == stay
    att = rep.by_kind("attention")
    assert sum("dropout" in r.matched for r in att) == (drop_att if train else 0)
    # with fewbit every smooth activation becomes a code; the rsqrt of a running variance
    # (eval-mode batch norm) has no finite derivative on the fitting interval: kept, said so
    if act_off:
        rep3, n3 = _counts(case, train, fewbit=3)
        failed = [r for r in rep3.by_kind("activation") if "fit failed" in r.reason]
        assert len(failed) == (act_off if case.name == "resnet" else 0)
        assert n3["activation", True] == act_on + act_off - len(failed)
        assert not [r for r in rep3.by_kind("activation") if "smooth" in r.reason]
