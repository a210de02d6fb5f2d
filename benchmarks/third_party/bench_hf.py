"""Hugging Face Flax models under ``jaxmem.transform``: XLA's memory plan of a full train step.

For each model (random weights from a config, nothing downloaded) the jitted step

    loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)    # train mode, dropout
    updates, opt_state = optax.adamw(1e-4).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

(parameters and optimizer state donated) is compiled three times -- the untouched loss,
``jaxmem.transform(loss)`` (exact) and ``jaxmem.transform(loss, fewbit=3)`` -- for XLA:CPU and
for XLA:GPU's H100 plan (``target="h100"``, compiled without a GPU), and
``jaxmem.measure.compiled_memory`` reports its temp and total bytes.  CPU step times: the
three steps run in turn in each of ``--repeats`` rounds after one warm-up call each; the
table gives the median wall seconds and process CPU seconds (the work done, less sensitive
to other jobs on a shared machine) and, as the ratio, the median of the per-round ratios to
the default step.

Size (``--size moderate``, the default): hidden 256, 4 layers, 4 heads, MLP 1024, batch 8,
sequence 128 (ViT: 176 x 176 images, patch 16: 122 tokens; T5: 4 encoder + 4 decoder
layers; ResNet: widths 64-128-256-512, one basic block each, 8 x 3 x 128 x 128; CLIP: both
towers of that size, 122 image tokens).

Models: bert, roberta, gpt2, vit, t5, resnet, clip, distilbert, the gated-MLP decoders
llama, mistral (grouped-query attention), gemma (multi-query, GeGLU), and the layer-scaled
vision transformers beit (relative position bias) and dinov2 (images and patches as ViT's;
both with their configs' dropout rates, 0).
and the speech encoder wav2vec2 (Wav2Vec2's own 7-layer convolutional feature extractor,
320 samples per frame, at width 64; ``audio`` samples per clip).
``--off gated_products,scaled_products`` adds ``jaxmem.transform(loss, OPTION=False)`` for
each option named (``OPTION=None`` for ``attention_chunk`` / ``logits_chunk``;
``--gated-off``: ``--off gated_products``); ``--set seq=2048`` (repeatable) overrides one
field of the size.

Run:  .venv/bin/python benchmarks/third_party/bench_hf.py [--models bert,gpt2,vit]
      [--targets cpu,h100] [--out benchmarks/results/third_party] [--stem hf]
      .venv/bin/python benchmarks/third_party/bench_hf.py --models llama,mistral,gemma,distilbert
      --gated-off --out benchmarks/results/third_party --stem hf_decoders
      .venv/bin/python benchmarks/third_party/bench_hf.py --models beit,dinov2
      --off scaled_products --out benchmarks/results/third_party --stem hf_layer_scale
      .venv/bin/python benchmarks/third_party/bench_hf.py --models beit,dinov2
      --off scaled_products --set image=64 --set patch=8 --out benchmarks/results/third_party
      --stem hf_layer_scale_64px
      .venv/bin/python benchmarks/third_party/bench_hf.py --models llama,wav2vec2
      --off attention_chunk --set seq=2048 --set batch=2 --set audio=320000 --repeats 3
      --out benchmarks/results/third_party --stem hf_long_sequences
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", category=FutureWarning)

SIZES = {"moderate": {"hidden": 256, "layers": 4, "heads": 4, "ff": 1024, "batch": 8,
                      "seq": 128, "image": 176, "patch": 16, "vocab": 1024, "audio": 16000},
         "tiny": {"hidden": 32, "layers": 2, "heads": 4, "ff": 64, "batch": 2, "seq": 16,
                  "image": 32, "patch": 8, "vocab": 64, "audio": 4000}}


def _leaf(rng):
    def fill(path, s):
        name = jax.tree_util.keystr(path).lower()
        noise = rng.standard_normal(s.shape)
        if "var" in name and "batch_stats" in name:
            v = 1.0 + 0.1 * np.abs(noise)
        elif len(s.shape) >= 2:
            v = noise * 0.7 / np.sqrt(max(1, int(np.prod(s.shape[:-1]))))
        elif name.endswith(("['scale']", "['weight']")):
            v = 1.0 + 0.1 * noise
        else:
            v = 0.02 * noise
        return jnp.asarray(v.astype(s.dtype))
    return fill


def _init(cls, cfg, rng, **kw):
    m = cls(cfg, _do_init=False, **kw)
    shapes = jax.eval_shape(lambda k: m.init_weights(k, m.input_shape), jax.random.key(0))
    return m, jax.tree_util.tree_map_with_path(_leaf(rng), shapes)


def build(name: str, z: dict, rng):
    """``(loss(params, batch, dropout_rng), params, batch)`` of one model."""
    import transformers as tr

    B, T, H = z["batch"], z["seq"], z["hidden"]
    ids = jnp.asarray(rng.integers(3, z["vocab"], (B, T)), jnp.int32)
    mask = jnp.ones((B, T), jnp.int32)
    px = jnp.asarray(rng.standard_normal((B, 3, z["image"], z["image"])).astype(np.float32))
    enc = {"hidden_size": H, "num_hidden_layers": z["layers"], "num_attention_heads": z["heads"],
               "intermediate_size": z["ff"]}
    text = dict(enc, vocab_size=z["vocab"], max_position_embeddings=2 * T)

    def text_loss(m):
        def loss(p, batch, r):
            out = m(batch[0], attention_mask=batch[1], params=p, dropout_rng=r, train=True)
            return jnp.mean(out[0] ** 2)
        return loss

    if name == "bert":
        m, p = _init(tr.FlaxBertForMaskedLM, tr.BertConfig(**text), rng)
        return text_loss(m), p, (ids, mask)
    if name == "roberta":
        m, p = _init(tr.FlaxRobertaForMaskedLM, tr.RobertaConfig(**text, pad_token_id=1), rng)
        return text_loss(m), p, (ids, mask)
    if name == "gpt2":
        cfg = tr.GPT2Config(vocab_size=z["vocab"], n_positions=2 * T, n_embd=H,
                            n_layer=z["layers"], n_head=z["heads"], n_inner=z["ff"])
        m, p = _init(tr.FlaxGPT2LMHeadModel, cfg, rng)
        return text_loss(m), p, (ids, mask)
    if name == "distilbert":
        cfg = tr.DistilBertConfig(vocab_size=z["vocab"], dim=H, n_layers=z["layers"],
                                  n_heads=z["heads"], hidden_dim=z["ff"],
                                  max_position_embeddings=2 * T)
        m, p = _init(tr.FlaxDistilBertForMaskedLM, cfg, rng)
        return text_loss(m), p, (ids, mask)
    if name in ("llama", "mistral", "gemma"):
        # SwiGLU / GeGLU MLPs, RMS norms, rotary embeddings; Mistral with grouped-query
        # attention (2 key / value heads), Gemma with multi-query attention (1)
        cls, conf, kw = {"llama": (tr.FlaxLlamaForCausalLM, tr.LlamaConfig, {}),
                         "mistral": (tr.FlaxMistralForCausalLM, tr.MistralConfig,
                                     {"num_key_value_heads": 2}),
                         "gemma": (tr.FlaxGemmaForCausalLM, tr.GemmaConfig,
                                   {"num_key_value_heads": 1,
                                    "head_dim": H // z["heads"],
                                    "hidden_activation": "gelu_pytorch_tanh"})}[name]
        m, p = _init(cls, conf(**text, **kw), rng)
        return text_loss(m), p, (ids, mask)
    if name == "vit":
        cfg = tr.ViTConfig(**enc, image_size=z["image"], patch_size=z["patch"],
                           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        m, p = _init(tr.FlaxViTForImageClassification, cfg, rng)

        def loss(p, batch, r):
            return jnp.mean(m(batch[0], params=p, dropout_rng=r, train=True)[0] ** 2)
        return loss, p, (px,)
    if name in ("beit", "dinov2"):
        # layer scales ``x + gamma * (h W + b)`` after attention and MLP; the configs'
        # own dropout rates (0: nothing between the product and its scale)
        cls, conf, kw = {"beit": (tr.FlaxBeitModel, tr.BeitConfig,
                                  {"use_relative_position_bias": True,
                                   "intermediate_size": z["ff"]}),
                         "dinov2": (tr.FlaxDinov2Model, tr.Dinov2Config,
                                    {"mlp_ratio": z["ff"] // H})}[name]
        args = {k: v for k, v in enc.items() if k != "intermediate_size"}
        cfg = conf(**args, **kw, image_size=z["image"], patch_size=z["patch"])
        m, p = _init(cls, cfg, rng)

        def loss(p, batch, r):
            return jnp.mean(m(batch[0], params=p, dropout_rng=r, train=True)[0] ** 2)
        return loss, p, (px,)
    if name == "wav2vec2":
        cfg = tr.Wav2Vec2Config(**enc, conv_dim=(64,) * 7, do_stable_layer_norm=True,
                                feat_extract_norm="layer")
        m, p = _init(tr.FlaxWav2Vec2Model, cfg, rng)
        audio = jnp.asarray(rng.standard_normal((B, z["audio"])).astype(np.float32))

        def loss(p, batch, r):
            return jnp.mean(m(batch[0], params=p, dropout_rng=r, train=True)[0] ** 2)
        return loss, p, (audio,)
    if name == "t5":
        from transformers.models.t5 import modeling_flax_t5 as mod
        _patch_t5(mod)
        cfg = tr.T5Config(vocab_size=z["vocab"], d_model=H, d_kv=H // z["heads"],
                          d_ff=z["ff"], num_layers=z["layers"], num_heads=z["heads"],
                          decoder_start_token_id=0)
        m, p = _init(tr.FlaxT5ForConditionalGeneration, cfg, rng)

        def loss(p, batch, r):
            out = m(batch[0], attention_mask=batch[1], decoder_input_ids=batch[0], params=p,
                    dropout_rng=r, train=True)
            return jnp.mean(out[0] ** 2)
        return loss, p, (ids, mask)
    if name == "resnet":
        cfg = tr.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512],
                              depths=[1, 1, 1, 1], layer_type="basic")
        m, p = _init(tr.FlaxResNetForImageClassification, cfg, rng)
        img = jnp.asarray(rng.standard_normal((B, 3, 128, 128)).astype(np.float32))

        def loss(p, batch, r):
            out, _ = m(batch[0], params=p, train=True)
            return jnp.mean(out[0] ** 2)
        return loss, p, (img,)
    if name == "clip":
        cfg = tr.CLIPConfig(text_config=dict(text),
                            vision_config=dict(enc, image_size=z["image"],
                                               patch_size=z["patch"]), projection_dim=H)
        m, p = _init(tr.FlaxCLIPModel, cfg, rng)

        def loss(p, batch, r):
            out = m(batch[0], batch[2], attention_mask=batch[1], params=p, dropout_rng=r,
                    train=True)
            return jnp.mean(out.logits_per_image ** 2)
        return loss, p, (ids, mask, px)
    raise ValueError(f"unknown model {name!r}")


def _patch_t5(mod):
    """Hugging Face's Flax T5 calls ``jnp.clip(x, a_max=...)`` (a keyword jax 0.10 dropped):
    its module gets a ``jnp`` whose ``clip`` takes it."""
    import types
    real = jnp
    if getattr(mod.jnp, "_jaxmem_clip", False):
        return
    shim = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                    if not k.startswith("__")})

    def clip(a, a_min=None, a_max=None, **kw):
        kw.setdefault("min", a_min)
        kw.setdefault("max", a_max)
        return real.clip(a, **kw)

    shim.clip = clip
    shim._jaxmem_clip = True
    mod.jnp = shim


def train_step(loss):
    import optax

    opt = optax.adamw(1e-4)

    def step(params, opt_state, batch, r):
        value, grads = jax.value_and_grad(loss)(params, batch, r)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return opt, step


def _time_side_by_side(steps: dict, args: tuple, repeats):
    """Per variant (each step called as ``step(*args)``): median wall seconds, median process
    CPU seconds (all threads) and the median of the per-round ratios to ``default``.  The
    variants run in turn within each of ``repeats`` rounds (after one warm-up call each), so
    a change of load on a shared machine hits all of them alike; CPU seconds are the work
    done, which waiting for a core does not inflate."""
    fns = {k: jax.jit(s) for k, s in steps.items()}
    for f in fns.values():
        jax.block_until_ready(f(*args))
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for i in range(repeats):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for k in order:
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[k](*args))
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    out = {}
    for k in fns:
        out[k] = {"step_s": statistics.median(wall[k]), "step_cpu_s": statistics.median(cpu[k]),
                  "step_ratio": statistics.median(a / b for a, b in zip(wall[k],
                                                                         wall["default"])),
                  "step_cpu_ratio": statistics.median(a / b for a, b in zip(cpu[k],
                                                                             cpu["default"]))}
    return out


def run(models, targets, z, repeats, off=()):
    import jaxmem
    from jaxmem.measure import compiled_memory

    rows = []
    for name in models:
        rng = np.random.default_rng(0)
        loss, params, batch = build(name, z, rng)
        r = jax.random.key(1)
        variants = {"default": loss, "transform": jaxmem.transform(loss),
                    "transform(fewbit=3)": jaxmem.transform(loss, fewbit=3)}
        for option in off:
            value = None if option.endswith("_chunk") else False
            variants[f"transform({option}={value})"] = jaxmem.transform(loss, **{option: value})
        rep = variants["transform(fewbit=3)"].report(params, batch, r)
        counts = {}
        for row in rep:
            k = f"{row.kind} {'converted' if row.converted else 'kept'}"
            counts[k] = counts.get(k, 0) + 1
        steps = {}
        for vname, fn in variants.items():
            opt, step = train_step(fn)
            opt_state = opt.init(params)
            steps[vname] = step
            for target in targets:
                t0 = time.perf_counter()
                cm = compiled_memory(step, params, opt_state, batch, r, target=target,
                                     donate_argnums=(0, 1))
                row = {"model": name, "variant": vname, "target": target, "temp": cm.temp_bytes,
                           "total": cm.total_bytes, "compile_s": round(time.perf_counter() - t0, 1)}
                if vname == "transform(fewbit=3)" and target == targets[0]:
                    row["report"] = counts
                rows.append(row)
                print(json.dumps(row), flush=True)
        if "cpu" in targets and repeats:
            times = _time_side_by_side(steps, (params, opt_state, batch, r), repeats)
            for row in rows:
                if row["model"] == name and row["target"] == "cpu":
                    row.update(times[row["variant"]])
            print(json.dumps({"model": name, "times": times}), flush=True)
    return rows


def markdown(rows, z) -> str:
    mib = 2 ** 20
    base = {(r["model"], r["target"]): r for r in rows if r["variant"] == "default"}
    out = [(f"Train step (adamw, value_and_grad, update; params and optimizer state donated), "
           f"random weights, train mode with dropout. Size: hidden {z['hidden']}, "
           f"{z['layers']} layers, {z['heads']} heads, MLP {z['ff']}, batch {z['batch']}, "
           f"sequence {z['seq']} (ViT / CLIP / BEiT / DINOv2: {z['image']}^2 images, patch "
           f"{z['patch']}; wav2vec2: {z['audio']} audio samples)."),
           "", ("| model | variant | plan | temp MiB | ratio | total MiB | ratio | CPU step s "
           "| ratio | CPU-s of work | ratio |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[(r["model"], r["target"])]
        step = f"{r['step_s']:.3f}" if "step_s" in r else ""
        sratio = f"{r['step_ratio']:.2f}x" if "step_ratio" in r else ""
        work = f"{r['step_cpu_s']:.3f}" if "step_cpu_s" in r else ""
        wratio = f"{r['step_cpu_ratio']:.2f}x" if "step_cpu_ratio" in r else ""
        out.append(f"| {r['model']} | {r['variant']} | {r['target']} | "
                   f"{r['temp'] / mib:.1f} | {r['temp'] / b['temp']:.2f}x | "
                   f"{r['total'] / mib:.1f} | {r['total'] / b['total']:.2f}x | {step} | "
                   f"{sratio} | {work} | {wratio} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert,gpt2,vit")
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--size", default="moderate", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="")
    ap.add_argument("--stem", default="hf", help="output file names: STEM.json, STEM.md")
    ap.add_argument("--off", default="",
                    help="comma-separated jaxmem.transform options: also measure "
                         "jaxmem.transform(loss, OPTION=False) for each")
    ap.add_argument("--gated-off", action="store_true", help="the same as --off gated_products")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                    help="override one field of the size (repeatable)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    off = [o for o in a.off.split(",") if o] + (["gated_products"] if a.gated_off else [])
    size = dict(SIZES[a.size])
    for item in a.set:
        field, _, value = item.partition("=")
        if field not in size:
            ap.error(f"--set: unknown size field {field!r} (one of {', '.join(size)})")
        size[field] = int(value)
    rows = run(a.models.split(","), a.targets.split(","), size, a.repeats, off)
    md = markdown(rows, size)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = {"size": size, "size_name": a.size, "overrides": a.set, "jax": jax.__version__,
                    "machine": platform.machine(), "cpus": os.cpu_count(),
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        with open(os.path.join(a.out, a.stem + ".json"), "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
        with open(os.path.join(a.out, a.stem + ".md"), "w") as fh:
            fh.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
