"""The LM head's cross-entropy, whole vs a chunk of tokens at a time
(:func:`jaxmem.losses.chunked_softmax_cross_entropy`), on XLA:CPU and on XLA:GPU's plan.

Cases (compiled bytes = temp + output + argument - alias of ``value_and_grad``):

* ``head``: the head alone at GPT-2 small's size (8 x 1024 tokens, d 768, vocab 50257, f32;
  gradients w.r.t. features and weight): ``optax.softmax_cross_entropy_with_integer_labels(
  h @ W, y).mean()`` against the chunked head (chunks of 1024 and 4096 tokens);
* ``gpt_wide``: a whole GPT step (4 x 128, ctx 128, vocab 2048, batch 8: the plan benchmark's
  ``gpt_wide``, whose logits are its largest array), the model's own tied head + optax vs
  ``features=True`` + the chunked head (chunks of 128 tokens), stored and with uniform
  ``jax.checkpoint(nothing_saveable)`` per block (``bench_plan.uniform_steps``);
* CPU step time of both ``gpt_wide`` steps and of a smaller head (4 x 256 tokens, d 256, vocab
  8192), as a ratio to the whole head (median of interleaved runs);
* residuals kept for the backward pass of that smaller head (level 1: ``jaxmem.measure.
  residual_bytes``), beside PyTorch's saved tensors (``torch_ref.measure.saved_bytes``) for
  ``F.cross_entropy`` on the whole logits and the reference ``torch_ref.losses.
  chunked_cross_entropy`` (``torch.utils.checkpoint`` per chunk), when torch is installed.

    .venv/bin/python benchmarks/losses/bench_chunked_head.py [--target h100] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmem.losses import chunked_softmax_cross_entropy
from jaxmem.measure import compiled_memory

HERE = pathlib.Path(__file__).resolve()
OUT = HERE.parents[1] / "results" / "losses"
sys.path.insert(0, str(HERE.parents[1] / "plan"))
# the plan benchmark's gpt_wide model, its uniform remat per block and its step timing
from bench_plan import gpt_wide_model, times, uniform_steps

MIB = 2.0**20


def head_losses(chunk):
    """``(h, W, y) -> mean loss``: optax on the whole logits (``chunk=None``) or chunked."""
    if chunk is None:
        return lambda h, w, y: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ w, y))
    return lambda h, w, y: jnp.mean(chunked_softmax_cross_entropy(h, w, y, chunk_size=chunk))


def gpt_wide_losses():
    """The ``gpt_wide`` model's arguments and the two losses (next-token prediction)."""
    m, tok, params = gpt_wide_model()
    tgt = jnp.roll(tok, -1, axis=1)

    def whole(p, t, y):
        lg = m.apply({"params": p}, t)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(lg, y))

    def chunked(p, t, y):
        h = m.apply({"params": p}, t, features=True)
        w = p["wte"]["embedding"].T
        return jnp.mean(chunked_softmax_cross_entropy(h, w, y, chunk_size=128))

    return (params, tok, tgt), {"whole head": whole, "chunked head (128 tokens)": chunked}


def total(fn, args, target, argnums=0):
    cm = compiled_memory(jax.value_and_grad(fn, argnums), *args, target=target)
    return cm.total_bytes, cm.temp_bytes


def median_times(fns, args, reps, argnums=0):
    """Median seconds of each ``value_and_grad`` step, interleaved (``bench_plan.times``)."""
    return times([jax.value_and_grad(f, argnums) for f in fns], args, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    targets = ["cpu", a.target]
    t0 = time.time()
    rows = []
    sd = jax.ShapeDtypeStruct
    big = (sd((8 * 1024, 768), jnp.float32), sd((768, 50257), jnp.float32),
           sd((8 * 1024,), jnp.int32))
    for label, chunk in (("whole head", None), ("chunked head (1024 tokens)", 1024),
                         ("chunked head (4096 tokens)", 4096)):
        for tg in targets:
            tot, tmp = total(head_losses(chunk), big, tg, (0, 1))
            rows.append({"case": "head (8x1024 tokens, d 768, vocab 50257)", "step": label,
                         "target": tg, "total_mib": tot / MIB, "temp_mib": tmp / MIB})
            print(rows[-1], flush=True)

    args, losses = gpt_wide_losses()
    for label, fn in losses.items():
        for variant, step in (("stored", fn),
                              ("nothing_saveable per block",
                               uniform_steps(fn, args)["nothing_saveable per block"])):
            for tg in targets:
                tot, tmp = total(step, args, tg)
                rows.append({"case": "gpt_wide (4x128, ctx 128, vocab 2048, b8)",
                             "step": f"{label}, {variant}", "target": tg,
                             "total_mib": tot / MIB, "temp_mib": tmp / MIB})
                print(rows[-1], flush=True)

    time_ratio = {}
    t_gpt = median_times(list(losses.values()), args, a.reps)
    time_ratio["gpt_wide (4x128, ctx 128, vocab 2048, b8)"] = t_gpt[1] / t_gpt[0]
    k = jax.random.split(jax.random.key(5), 3)
    small = (jax.random.normal(k[0], (4 * 256, 256)), jax.random.normal(k[1], (256, 8192)) / 16,
             jax.random.randint(k[2], (4 * 256,), 0, 8192))
    t_head = median_times([head_losses(None), head_losses(256)], small, a.reps, (0, 1))
    time_ratio["head (4x256 tokens, d 256, vocab 8192), chunks of 256"] = t_head[1] / t_head[0]
    print(time_ratio, flush=True)
    residuals = residual_rows(small)
    print(residuals, flush=True)
    res = {"jax": jax.__version__, "targets": targets, "rows": rows, "cpu_time_ratio": time_ratio,
           "residual_mib": residuals, "seconds": time.time() - t0}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_head.json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out / "chunked_head.md", a.target)


def residual_rows(args, chunk=256):
    """Residual MiB of the smaller head's backward pass: JAX (``residual_bytes``, gradients
    w.r.t. features and weight) and, when torch is installed, PyTorch (saved tensors)."""
    from jaxmem.measure import residual_bytes

    out = {}
    for label, c in (("whole head", None), (f"chunked head ({chunk} tokens)", chunk)):
        rep = residual_bytes(head_losses(c), *args, argnums=(0, 1))
        out[f"jax, {label}"] = rep.activation_bytes / MIB
    try:
        import torch
    except ImportError:
        return out
    from torch_ref.losses import chunked_cross_entropy
    from torch_ref.measure import saved_bytes

    h, w = (torch.tensor(np.asarray(a), requires_grad=True) for a in args[:2])
    y = torch.tensor(np.asarray(args[2], np.int64))
    fns = {"torch, whole head (F.cross_entropy)":
           lambda h, w: torch.nn.functional.cross_entropy(h @ w, y),
           f"torch, chunked head ({chunk} tokens, torch.utils.checkpoint)":
           lambda h, w: chunked_cross_entropy(h, w, y, chunk_size=chunk).mean()}
    for label, f in fns.items():
        out[label] = saved_bytes(f, h, w).activation_bytes / MIB
    return out


def write_md(res, path, target):
    by = {(r["case"], r["step"], r["target"]): r for r in res["rows"]}
    cases = list(dict.fromkeys(r["case"] for r in res["rows"]))
    L = ["# LM head cross-entropy: whole vs chunked (`jaxmem.losses`)", "",
         (f"`.venv/bin/python benchmarks/losses/bench_chunked_head.py --target {target}` "
         f"(jax {res['jax']}, {res['seconds']:.0f} s on 2 shared CPU cores). Compiled bytes "
         f"(total = temp + output + argument - alias) of `value_and_grad`; the {target} "
         "columns are XLA:GPU's plan compiled without a GPU (no autotuning: a lower bound). "
         "XLA:CPU compiles the per-block `jax.checkpoint` steps to the stored steps' bytes "
         "(it merges plain recomputation back; `jaxmem.plan` fences it there)."), ""]
    for case in cases:
        steps = list(dict.fromkeys(r["step"] for r in res["rows"] if r["case"] == case))
        base = {t: by[(case, steps[0], t)]["total_mib"] for t in res["targets"]}
        L += [f"## {case}", "", "| step | " + " | ".join(
            f"{t} total MiB (x first row) | {t} temp MiB" for t in res["targets"]) + " |",
            "|---|" + "---|---|" * len(res["targets"])]
        for s in steps:
            cells = []
            for t in res["targets"]:
                r = by[(case, s, t)]
                cells += [f"{r['total_mib']:.2f} ({r['total_mib'] / base[t]:.2f}x)",
                          f"{r['temp_mib']:.2f}"]
            L.append(f"| {s} | " + " | ".join(cells) + " |")
        L.append("")
    L += ["## CPU step time, chunked / whole (median of interleaved runs)", ""]
    L += [f"- {k}: {v:.2f}x" for k, v in res["cpu_time_ratio"].items()]
    if res.get("residual_mib"):
        L += ["", ("## Residuals kept for the backward pass (level 1), head 4x256 tokens, "
                   "d 256, vocab 8192 (one f32 logits array: 32 MiB)"), "",
              "| step | MiB |", "|---|---|"]
        L += [f"| {k} | {v:.2f} |" for k, v in res["residual_mib"].items()]
        L += ["", ("JAX's chunked residual is the features split into chunks (the scan's input: "
              "level 1 counts the reshaped array, which the compiled step does not copy); "
              "PyTorch's chunks are views of the features, an argument.")]
    path.write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
