"""Language-model heads under ``jaxmem.transform``: the ``tokens x vocab`` logits chunked
automatically, in the user's own loss, on XLA:CPU and XLA:GPU's H100 plan.

1. The GPT-2 small head alone (8 x 1024 tokens, d 768, vocab 50257, f32): optax's
   ``softmax_cross_entropy_with_integer_labels(h @ W, y)`` untouched, written with
   ``jaxmem.losses.chunked_softmax_cross_entropy`` by hand, and ``jaxmem.transform`` of the
   untouched loss; compiled bytes of ``value_and_grad``.
2. Hugging Face's Flax GPT-2 (``FlaxGPT2LMHeadModel`` from a config, random weights, train
   mode with dropout; hidden 256, 4 layers, 4 heads, MLP 1024, vocab 50257, batch 8,
   sequence 512) with ``run_clm_flax``'s loss (logits and labels shifted by one token,
   ``optax.softmax_cross_entropy`` of one-hot labels): the full train step (adamw, params and
   optimizer state donated) untouched, ``jaxmem.transform(loss, logits_chunk=None)`` (every
   other conversion, the head as written) and ``jaxmem.transform(loss)`` (default: chunks of
   1024 rows).
3. The slope over tokens: compiled temp of case 1's ``value_and_grad`` at 2048 and 4096
   tokens (d 256, vocab 8192), untouched and ``transform(logits_chunk=512)``: MiB per 1024
   tokens more (two logits arrays: 64 MiB untouched).
4. CPU step time of case 2's step at batch 2 (1022 rows, chunks of 256): the head's product
   runs again in the backward pass. Median of interleaved rounds (``bench_hf``).

Run:  .venv/bin/python benchmarks/third_party/bench_lm_head.py [--targets cpu,h100]
      [--repeats 7] [--out benchmarks/results/third_party]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

warnings.filterwarnings("ignore", category=FutureWarning)
HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1] / "losses")]
from bench_chunked_head import head_losses as chunked_head_losses
from bench_hf import _init, _time_side_by_side, train_step

import jaxmem
from jaxmem.measure import compiled_memory

MIB = 2.0 ** 20
VOCAB = 50257
HF = {"hidden": 256, "layers": 4, "heads": 4, "ff": 1024, "batch": 8, "seq": 512}


def head_losses():
    """The chunked-head benchmark's two losses (whole logits; 1024-token chunks by hand) and
    ``jaxmem.transform`` of the whole-logits one."""
    untouched = chunked_head_losses(None)
    return {"untouched": untouched, "jaxmem.losses (by hand)": chunked_head_losses(1024),
            "jaxmem.transform": jaxmem.transform(untouched)}


def hf_gpt2(batch: int):
    """``(loss(params, ids, rng), params, ids)``: run_clm_flax's next-token loss."""
    import transformers as tr

    rng = np.random.default_rng(0)
    cfg = tr.GPT2Config(vocab_size=VOCAB, n_positions=HF["seq"], n_embd=HF["hidden"],
                        n_layer=HF["layers"], n_head=HF["heads"], n_inner=HF["ff"])
    m, params = _init(tr.FlaxGPT2LMHeadModel, cfg, rng)
    ids = jnp.asarray(rng.integers(0, VOCAB, (batch, HF["seq"])), jnp.int32)

    def loss(p, ids, r):
        logits = m(ids, params=p, dropout_rng=r, train=True)[0]
        shifted, labels = logits[..., :-1, :], ids[..., 1:]
        return optax.softmax_cross_entropy(shifted, jax.nn.one_hot(labels, VOCAB)).mean()

    return loss, params, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(HERE.parents[1] / "results" / "third_party"))
    a = ap.parse_args()
    targets = a.targets.split(",")
    t0 = time.time()
    rows = []
    sd = jax.ShapeDtypeStruct
    head = (sd((8 * 1024, 768), jnp.float32), sd((768, VOCAB), jnp.float32),
            sd((8 * 1024,), jnp.int32))
    for name, fn in head_losses().items():
        for tg in targets:
            cm = compiled_memory(jax.value_and_grad(fn, (0, 1)), *head, target=tg)
            rows.append({"case": "GPT-2 small head (8x1024 tokens, d 768, vocab 50257), "
                         "value_and_grad", "variant": name, "target": tg,
                         "total_mib": cm.total_bytes / MIB, "temp_mib": cm.temp_bytes / MIB})
            print(rows[-1], flush=True)

    slope = []
    for name, fn in (("untouched", head_losses()["untouched"]),
                     ("jaxmem.transform(logits_chunk=512)",
                      jaxmem.transform(head_losses()["untouched"], logits_chunk=512))):
        for tg in targets:
            temps = [compiled_memory(jax.value_and_grad(fn, (0, 1)), sd((n, 256), jnp.float32),
                                     sd((256, 8192), jnp.float32), sd((n,), jnp.int32),
                                     target=tg).temp_bytes / MIB for n in (2048, 4096)]
            slope.append({"variant": name, "target": tg, "temp_mib_2048": temps[0],
                          "temp_mib_4096": temps[1],
                          "mib_per_1024_tokens": (temps[1] - temps[0]) / 2})
            print(slope[-1], flush=True)

    loss, params, ids = hf_gpt2(HF["batch"])
    r = jax.random.key(1)
    variants = {"untouched": loss,
                "jaxmem.transform(logits_chunk=None)": jaxmem.transform(loss, logits_chunk=None),
                "jaxmem.transform (logits_chunk=1024)": jaxmem.transform(loss)}
    report = [{"kind": x.kind, "converted": x.converted, "became": x.became, "reason": x.reason}
              for x in variants["jaxmem.transform (logits_chunk=1024)"].report(
                  params, ids, r).by_kind("logits")]
    for name, fn in variants.items():
        opt, step = train_step(fn)
        opt_state = jax.eval_shape(opt.init, params)
        for tg in targets:
            cm = compiled_memory(step, params, opt_state, ids, r, target=tg,
                                 donate_argnums=(0, 1))
            rows.append({"case": "Hugging Face FlaxGPT2LMHeadModel (hidden 256, 4 layers, "
                         "vocab 50257, batch 8, seq 512), train step", "variant": name,
                         "target": tg, "total_mib": cm.total_bytes / MIB,
                         "temp_mib": cm.temp_bytes / MIB})
            print(rows[-1], flush=True)

    times = {}
    if "cpu" in targets and a.repeats:
        loss, params, ids = hf_gpt2(2)
        steps = {}
        for name, fn in (("default", loss),
                         ("jaxmem.transform(logits_chunk=None)",
                          jaxmem.transform(loss, logits_chunk=None)),
                         ("jaxmem.transform(logits_chunk=256)",
                          jaxmem.transform(loss, logits_chunk=256))):
            opt, steps[name] = train_step(fn)
        opt_state = opt.init(params)
        times = _time_side_by_side(steps, (params, opt_state, ids, r), a.repeats)
        print(times, flush=True)
    res = {"jax": jax.__version__, "targets": targets, "rows": rows, "slope": slope,
           "report": report,
           "cpu_times_batch2": times, "seconds": round(time.time() - t0, 1)}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_head.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "lm_head.md").write_text(markdown(res))


def markdown(res) -> str:
    lines = ["<!-- generated by `.venv/bin/python benchmarks/third_party/bench_lm_head.py` -->",
             "# Language-model heads chunked by `jaxmem.transform`", "",
             (f"jax {res['jax']}; {res['seconds']:.0f} s on 2 shared CPU cores. Compiled bytes "
             "(temp + output + argument - alias, MiB) on XLA:CPU and XLA:GPU's H100 plan "
             "(compiled without a GPU: no autotuning, cuBLAS/cuDNN workspaces not counted); "
             "ratio to the untouched row of the same case and plan. See the script's docstring "
             "for the cases."), "",
             "| case | variant | plan | total MiB | ratio | temp MiB |", "|---|---|---|---|---|---|"]
    base = {(r["case"], r["target"]): r["total_mib"] for r in res["rows"]
            if r["variant"] == "untouched"}
    for r in res["rows"]:
        ratio = r["total_mib"] / base[(r["case"], r["target"])]
        lines.append(f"| {r['case']} | {r['variant']} | {r['target']} | {r['total_mib']:.1f} | "
                     f"{ratio:.2f}x | {r['temp_mib']:.1f} |")
    lines += ["", "Compiled temp over tokens (the head alone, d 256, vocab 8192):", "",
              "| variant | plan | temp MiB, 2048 tokens | 4096 tokens | MiB per 1024 tokens |",
              "|---|---|---|---|---|"]
    for x in res["slope"]:
        lines.append(f"| {x['variant']} | {x['target']} | {x['temp_mib_2048']:.2f} | "
                     f"{x['temp_mib_4096']:.2f} | {x['mib_per_1024_tokens']:.2f} |")
    lines += ["", "The report's `logits` row for the Hugging Face loss:", ""]
    for x in res["report"]:
        lines.append(f"- converted={x['converted']}: {x['became'] or x['reason']}")
    if res["cpu_times_batch2"]:
        lines += ["", ("CPU train step at batch 2 (1022 rows; `logits_chunk=256`: 4 chunks), "
                  "median of interleaved rounds:"), "",
                  "| variant | step s | ratio to untouched | CPU-s of work | ratio |",
                  "|---|---|---|---|---|"]
        for k, t in res["cpu_times_batch2"].items():
            k = "untouched" if k == "default" else k    # bench_hf's name of the baseline
            lines.append(f"| {k} | {t['step_s']:.3f} | {t['step_ratio']:.2f}x | "
                         f"{t['step_cpu_s']:.3f} | {t['step_cpu_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
