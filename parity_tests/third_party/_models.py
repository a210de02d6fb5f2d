"""Tiny third-party models (random init from a config, nothing downloaded) and a loss each.

``CASES[name]()`` returns a :class:`Case`: ``loss(params, inputs, rng, train)`` is a scalar
function of the model's parameters (``rng`` feeds dropout in train mode), ``config`` the
sizes the report is checked against.  Sizes: hidden 32, sequence 8, batch 2; ``L = 1`` layer
(per tower / stack), the layers of each model being copies of one another -- except T5's
encoder, ``T5_ENC_LAYERS = 2`` layers: its first layer computes the relative position bias the
later ones reuse.
"""
from __future__ import annotations

import contextlib
import dataclasses
import secrets
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

B, T, H, L, HEADS, FF, VOCAB = 2, 8, 32, 1, 4, 64, 48
T5_ENC_LAYERS = 2
_RNG = np.random.default_rng(secrets.randbits(64))


def seed() -> int:
    return secrets.randbits(31)


def ids(shape=(B, T)):
    return jnp.asarray(_RNG.integers(3, VOCAB, shape), jnp.int32)


def pixels(shape):
    return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


def mask():
    m = np.ones((B, T), np.int32)
    m[1, T - 2:] = 0
    return jnp.asarray(m)


@dataclasses.dataclass
class Case:
    loss: Callable[..., Any]
    params: Any
    inputs: tuple
    config: Any
    dropout: bool = True          # the model has dropout layers (train mode differs)


def _tr():
    import transformers
    return transformers


def _leaf(path, s):
    """A fresh random value for one parameter: kernels ``N(0, 1/fan_in)``-like, norm scales
    around 1, variances positive, everything else small."""
    name = jax.tree_util.keystr(path).lower()
    noise = _RNG.standard_normal(s.shape)
    if "var" in name and "batch_stats" in name:
        v = 1.0 + 0.1 * np.abs(noise)
    elif len(s.shape) >= 2:
        v = noise * 0.7 / np.sqrt(max(1, int(np.prod(s.shape[:-1]))))
    elif name.endswith(("['scale']", "['weight']")):
        v = 1.0 + 0.1 * noise
    else:
        v = 0.1 * noise
    return jnp.asarray(v.astype(s.dtype))


def _init(cls, cfg, **kw):
    """``cls(cfg)`` with fresh random weights of the shapes its ``init_weights`` gives (Hugging
    Face's own initialisation runs op by op: seconds per model)."""
    m = cls(cfg, _do_init=False, **kw)
    shapes = jax.eval_shape(lambda k: m.init_weights(k, m.input_shape), jax.random.key(0))
    return m, jax.tree_util.tree_map_with_path(_leaf, shapes)


def _common(**kw):
    base = {"hidden_size": H, "num_hidden_layers": L, "num_attention_heads": HEADS,
                "intermediate_size": FF, "max_position_embeddings": 4 * T, "vocab_size": VOCAB,
                "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    base.update(kw)
    return base


def _text_loss(model):
    def loss(params, inputs, rng, train):
        i, m = inputs
        out = model(i, attention_mask=m, params=params, dropout_rng=rng, train=train)
        return jnp.mean(out[0] ** 2)
    return loss


def bert():
    tr = _tr()
    cfg = tr.BertConfig(**_common())
    m, p = _init(tr.FlaxBertForMaskedLM, cfg)
    return Case(_text_loss(m), p, (ids(), mask()), cfg)


def roberta():
    tr = _tr()
    cfg = tr.RobertaConfig(**_common(pad_token_id=1))
    m, p = _init(tr.FlaxRobertaModel, cfg, add_pooling_layer=True)
    return Case(_text_loss(m), p, (ids(), mask()), cfg)


def gpt2():
    tr = _tr()
    cfg = tr.GPT2Config(vocab_size=VOCAB, n_positions=4 * T, n_embd=H, n_layer=L,
                        n_head=HEADS, n_inner=FF, resid_pdrop=0.1, embd_pdrop=0.1,
                        attn_pdrop=0.1)
    m, p = _init(tr.FlaxGPT2LMHeadModel, cfg)
    return Case(_text_loss(m), p, (ids(), mask()), cfg)


def distilbert():
    tr = _tr()
    cfg = tr.DistilBertConfig(vocab_size=VOCAB, dim=H, n_layers=L, n_heads=HEADS, hidden_dim=FF,
                              max_position_embeddings=4 * T, dropout=0.1,
                              attention_dropout=0.1)
    m, p = _init(tr.FlaxDistilBertForMaskedLM, cfg)
    return Case(_text_loss(m), p, (ids(), mask()), cfg)


def llama():
    tr = _tr()
    cfg = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FF,
                         num_hidden_layers=L, num_attention_heads=HEADS,
                         max_position_embeddings=4 * T)
    m, p = _init(tr.FlaxLlamaForCausalLM, cfg)
    return Case(_text_loss(m), p, (ids(), mask()), cfg, dropout=False)


def vit():
    tr = _tr()
    cfg = tr.ViTConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                       intermediate_size=FF, image_size=16, patch_size=8, num_channels=3,
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    m, p = _init(tr.FlaxViTModel, cfg)

    def loss(params, inputs, rng, train):
        out = m(inputs[0], params=params, dropout_rng=rng, train=train)
        return jnp.mean(out[0] ** 2) + jnp.mean(out[1])

    return Case(loss, p, (pixels((B, 3, 16, 16)),), cfg)


def beit():
    """BEiT: layer scales ``x + gamma * (h W + b)`` after attention and MLP, a relative
    position bias added to the scores, mean pooling with a LayerNorm."""
    tr = _tr()
    cfg = tr.BeitConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                        intermediate_size=FF, image_size=16, patch_size=8, num_channels=3,
                        use_relative_position_bias=True, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    m, p = _init(tr.FlaxBeitModel, cfg)

    def loss(params, inputs, rng, train):
        out = m(inputs[0], params=params, dropout_rng=rng, train=train)
        return jnp.mean(out[0] ** 2) + jnp.mean(out[1])

    return Case(loss, p, (pixels((B, 3, 16, 16)),), cfg)


@contextlib.contextmanager
def t5_clip_patch():
    """Hugging Face's Flax T5 calls ``jnp.clip(x, a_max=...)``, a keyword jax 0.10 no longer
    takes: inside the context its module sees a ``jnp`` whose ``clip`` maps it to ``max``."""
    from transformers.models.t5 import modeling_flax_t5 as mod

    real = mod.jnp
    shim = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                    if not k.startswith("__")})

    def clip(a, a_min=None, a_max=None, **kw):
        kw.setdefault("min", a_min)
        kw.setdefault("max", a_max)
        return real.clip(a, **kw)

    shim.clip = clip
    mod.jnp = shim
    try:
        yield
    finally:
        mod.jnp = real


def t5():
    tr = _tr()
    cfg = tr.T5Config(vocab_size=VOCAB, d_model=H, d_kv=H // HEADS, d_ff=FF,
                      num_layers=T5_ENC_LAYERS, num_decoder_layers=L, num_heads=HEADS, dropout_rate=0.1,
                      relative_attention_num_buckets=8, decoder_start_token_id=0)
    with t5_clip_patch():
        m, p = _init(tr.FlaxT5ForConditionalGeneration, cfg)

    def loss(params, inputs, rng, train):
        i, msk, dec = inputs
        with t5_clip_patch():
            out = m(i, attention_mask=msk, decoder_input_ids=dec, params=params,
                    dropout_rng=rng, train=train)
        return jnp.mean(out[0] ** 2)

    return Case(loss, p, (ids(), mask(), ids()), cfg)


def resnet():
    tr = _tr()
    cfg = tr.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], layer_type="basic", hidden_act="relu")
    m, p = _init(tr.FlaxResNetModel, cfg)

    def loss(params, inputs, rng, train):
        out = m(inputs[0], params=params, train=train)
        if train:
            out, _ = out
        return jnp.mean(out[0] ** 2) + jnp.mean(out[1] ** 2)

    return Case(loss, p, (pixels((B, 3, 16, 16)),), cfg, dropout=False)


def clip():
    tr = _tr()
    text = {"vocab_size": VOCAB, "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": L,
                "num_attention_heads": HEADS, "max_position_embeddings": 4 * T}
    vision = {"hidden_size": H, "intermediate_size": FF, "num_hidden_layers": L,
                  "num_attention_heads": HEADS, "image_size": 16, "patch_size": 8}
    cfg = tr.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    m, p = _init(tr.FlaxCLIPModel, cfg)

    def loss(params, inputs, rng, train):
        i, msk, px = inputs
        out = m(i, px, attention_mask=msk, params=params, dropout_rng=rng, train=train)
        return jnp.mean(out.logits_per_image ** 2) + jnp.mean(out.text_embeds ** 2)

    return Case(loss, p, (ids(), mask(), pixels((B, 3, 16, 16))), cfg,
                dropout=False)


CASES = {"bert": bert, "roberta": roberta, "gpt2": gpt2, "vit": vit, "t5": t5,
         "resnet": resnet, "clip": clip, "distilbert": distilbert, "llama": llama,
         "beit": beit}
