"""Hugging Face Flax models under tensor parallelism: per-device bytes and collectives.

:data:`jaxmem.distributed.TP_RULES` splits BERT-family layers (``query`` / ``key`` /
``value``, ``intermediate/dense`` column-parallel; ``attention/output/dense``,
``output/dense`` row-parallel) and GPT-2's ``FlaxConv1D`` layers, whose kernels are stored
``(out, in)`` (the split taken along the transposed axis). Beside it, the layouts a user
gets from rules that miss either: ``names only`` (GPT-2's kernels split as if stored
``(in, out)``: its column-parallel layers split their inputs) and ``MLP replicated`` (BERT
with only its ``q, k, v`` projections split); and GPT-2 with ``repeat_collectives=True``
(its fused ``c_attn``, split three ways, recomputed in the attention's backward).

One SGD step of ``FlaxGPT2LMHeadModel`` and ``FlaxBertForMaskedLM`` (hidden 256, 4 layers, 4
heads, vocab 512, 16 x 128 tokens, cross-entropy) on a 4 x 2 ``('data', 'model')`` mesh,
compiled (never run), untouched and under ``jaxmem.transform``: per-device ``temp`` and
``argument`` MiB (XLA ``memory_analysis``), collectives per device (count, MB of results).

    .venv/bin/python benchmarks/distributed/tp_hf_layouts.py [--target h100,cpu]

Targets: ``h100`` = XLA:GPU's plan for 8 x H100 compiled here without a GPU (no autotuning:
``temp`` is a lower bound), ``cpu`` = XLA:CPU on 8 host devices. Results:
``benchmarks/results/distributed/tp_hf_layouts.{md,json}``. Needs ``transformers`` 4.x
(``jaxmem[third-party]``).
"""
from __future__ import annotations

import time

import _tp_step  # first: re-executes this script with 8 host CPU devices
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jaxmem

BATCH, TOKENS = 16, 128
COL, ROW = P(None, "model"), P("model", None)
#: per model: layout name -> ``train_step`` options (``rules``: user rules; none: jaxmem's)
LAYOUTS = {
    "gpt2": {"TP_RULES": {},
             "TP_RULES, repeat_collectives": {"repeat_collectives": True},
             "names only": {"rules": ((r"(c_attn|c_fc)/kernel$", COL),
                                      (r"(c_attn|c_fc)/bias$", P("model")),
                                      (r"c_proj/kernel$", ROW))}},
    "bert": {"TP_RULES": {},
             "MLP replicated": {"rules": ((r"(intermediate|output)/dense/(kernel|bias)$",
                                           P()),)}},
}


def _model(name):
    import transformers as tr
    if name == "gpt2":
        cls, cfg = tr.FlaxGPT2LMHeadModel, tr.GPT2Config(
            n_embd=256, n_layer=4, n_head=4, vocab_size=512, n_positions=TOKENS)
    else:
        cls, cfg = tr.FlaxBertForMaskedLM, tr.BertConfig(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, vocab_size=512)
    model = cls(cfg, _do_init=False)
    params = jax.eval_shape(lambda k: model.init_weights(k, (1, TOKENS)), jax.random.key(0))

    def loss(p, batch):
        logits = model(batch[0], params=p, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return loss, params


def measure(loss, params, target, options, transformed):
    tok = jax.ShapeDtypeStruct((BATCH, TOKENS), jnp.int32)
    return _tp_step.measure(jaxmem.transform(loss) if transformed else loss, params,
                            (tok, tok), target, **options)


def markdown(rows, meta):
    out = ["# Hugging Face Flax models under tensor parallelism", "",
           (f"Regenerate with `{meta['command']}` (jax {meta['jax']}, transformers "
           f"{meta['transformers']}; compiled only, never run; {meta['seconds']:.0f} s)."), "",
           ("One SGD step of `FlaxGPT2LMHeadModel` / `FlaxBertForMaskedLM` (hidden 256, 4 "
            "layers, 4 heads, vocab 512, 16 x 128 tokens) on a 4 x 2 `('data', 'model')` "
            "mesh, per device. `TP_RULES`: `jaxmem.distributed.train_step(..., 'tp')` as is; "
            "`names only`: GPT-2's kernels split as if stored `(in, out)` (its `FlaxConv1D` "
            "stores `(out, in)`: the column-parallel layers then split their inputs); `MLP "
            "replicated`: BERT with only its `q, k, v` projections split; `repeat_collectives`: "
            "`train_step(..., repeat_collectives=True)` (GPT-2's fused `c_attn` projection "
            "recomputed, its split's collective-permutes run again). `jaxmem` = "
            "`jaxmem.transform(loss)`. Collectives: count, MB of results per device."), "",
           _tp_step.LIMITS, ""]
    for target in meta["targets"]:
        out += [_tp_step.heading(target), "",
                ("| model | layout | step | temp MiB | argument MiB | collectives | "
                 "collective MB |"), "|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["targets"][target]
            out.append(f"| {r['model']} | {r['layout']} | {r['step']} | "
                       f"{m['temp'] / 2**20:.2f} | {m['argument'] / 2**20:.2f} | "
                       f"{_tp_step.collective_cells(m)} |")
        out.append("")
    return "\n".join(out)


def main():
    targets, out = _tp_step.arguments(__doc__.split("\n\n")[0])
    import transformers
    t0 = time.time()
    rows = []
    for name, layouts in LAYOUTS.items():
        loss, params = _model(name)
        for layout, options in layouts.items():
            for transformed in (False, True):
                row = {"model": name, "layout": layout,
                       "step": "jaxmem" if transformed else "JAX default", "targets": {}}
                for target in targets:
                    row["targets"][target] = measure(loss, params, target, options,
                                                     transformed)
                print(name, layout, row["step"], {t: round(m["temp"] / 2**20, 2)
                                                  for t, m in row["targets"].items()},
                      flush=True)
                rows.append(row)
    meta = {"jax": jax.__version__, "transformers": transformers.__version__,
            "targets": targets, "seconds": time.time() - t0,
            "command": _tp_step.command("tp_hf_layouts.py", targets)}
    _tp_step.write(out, "tp_hf_layouts", meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
