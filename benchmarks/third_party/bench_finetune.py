"""Fine-tuning regimes of Hugging Face Flax models: ``jaxmem.transform`` on the H100 plan and CPU.

The models, sizes and loss of ``bench_hf.py`` (hidden 256, 4 layers, batch 8 x 128 tokens /
176² images; train mode with dropout), trained in the ways people fine-tune them:

* ``full``: every parameter;
* ``lora``: rank-8 adapters on every 2-D kernel of the layers (``W + A B / 8``, merged into
  the weight before the model runs, as a JAX LoRA is usually written), the model frozen;
* ``norm``: the layer-norm / RMS-norm scales and biases only;
* ``bitfit``: the biases only (no row for Llama: it has none);
* ``last``: the last layer only, the rest frozen.

The step is the one a careful user writes: ``value_and_grad`` with respect to the trained
parameters only (frozen ones are an argument, not differentiated) and AdamW on them, trained
parameters and optimizer state donated -- what ``optax.multi_transform`` with
``set_to_zero`` on the frozen part compiles to once XLA drops the unused gradients.
``transform`` is ``jaxmem.transform`` of that loss (nothing else changed). Compiled bytes on
each plan; CPU step time side by side (``--repeats`` rounds).

Regenerate:
    .venv/bin/python benchmarks/third_party/bench_finetune.py \\
        --out benchmarks/results/third_party
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf

REGIMES = ("full", "lora", "norm", "bitfit", "last")
RANK = 8


def _layer(path: str):
    """The layer index in a parameter path (``h/3``, ``layer/3``, ``layers/3``), or None."""
    m = re.search(r"\['(?:h|layer|layers)'\]\['(\d+)'\]", path)
    return None if m is None else int(m.group(1))


def trained(regime: str, path: str, leaf, layers: int) -> bool:
    """Whether ``regime`` trains the parameter at ``path`` (``full``: all of them)."""
    p = path.lower()
    if regime == "full":
        return True
    if regime == "norm":
        return "norm" in p or "ln_" in p
    if regime == "bitfit":
        return p.endswith("['bias']")
    if regime == "last":
        return _layer(path) == layers - 1
    raise ValueError(regime)


def _adapted(path: str, leaf) -> bool:
    return path.endswith("['kernel']") and leaf.ndim == 2 and _layer(path) is not None


def split(loss, params, regime: str, layers: int, rng):
    """``(loss_split(trained, frozen, batch, r), trained, frozen)``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(k) for k, _ in leaves]
    values = [v for _, v in leaves]
    if regime == "lora":
        where = [i for i, (p, v) in enumerate(zip(paths, values)) if _adapted(p, v)]
        adapters = [(jnp.asarray(rng.standard_normal((values[i].shape[0], RANK)) * 0.02,
                                 values[i].dtype),
                     jnp.asarray(rng.standard_normal((RANK, values[i].shape[1])) * 0.02,
                                 values[i].dtype)) for i in where]

        def loss_lora(tr, fr, batch, r):
            merged = list(fr)
            for i, (a, b) in zip(where, tr):
                merged[i] = fr[i] + (a @ b) / RANK
            return loss(jax.tree_util.tree_unflatten(treedef, merged), batch, r)

        return loss_lora, adapters, values
    mask = [trained(regime, p, v, layers) for p, v in zip(paths, values)]
    tr = [v for v, m in zip(values, mask) if m]
    fr = [v for v, m in zip(values, mask) if not m]

    def loss_split(tr, fr, batch, r):
        it, jf = iter(tr), iter(fr)
        return loss(jax.tree_util.tree_unflatten(treedef, [next(it) if m else next(jf)
                                                           for m in mask]), batch, r)

    return loss_split, tr, fr


def train_step(loss):
    """AdamW on the trained parameters; the frozen ones are read, not differentiated."""
    import optax

    opt = optax.adamw(1e-4)

    def step(tr, fr, opt_state, batch, r):
        value, grads = jax.value_and_grad(loss)(tr, fr, batch, r)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, value

    return opt, step


def run(models, regimes, targets, z, repeats):
    import jaxmem
    from jaxmem.measure import compiled_memory

    rows = []
    for name in models:
        loss, params, batch = bench_hf.build(name, z, np.random.default_rng(0))
        r = jax.random.key(1)
        for regime in regimes:
            fn, tr, fr = split(loss, params, regime, z["layers"], np.random.default_rng(1))
            if not tr:
                print(f"{name} {regime}: nothing to train, skipped", flush=True)
                continue
            n_tr = int(sum(np.size(a) for a in jax.tree.leaves(tr)))
            n_all = int(sum(np.size(a) for a in jax.tree.leaves(params)))
            steps, opt_state = {}, None
            for vname, f in (("default", fn), ("transform", jaxmem.transform(fn))):
                opt, step = train_step(f)
                opt_state = opt.init(tr)
                steps[vname] = step
                for target in targets:
                    cm = compiled_memory(step, tr, fr, opt_state, batch, r, target=target,
                                         donate_argnums=(0, 2))
                    row = {"model": name, "regime": regime, "variant": vname,
                           "target": target, "trained": n_tr, "params": n_all,
                           "temp": cm.temp_bytes, "total": cm.total_bytes}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if "cpu" in targets and repeats:
                times = bench_hf._time_side_by_side(steps, (tr, fr, opt_state, batch, r),
                                                    repeats)
                for row in rows:
                    if (row["model"], row["regime"], row["target"]) == (name, regime, "cpu"):
                        row.update(times[row["variant"]])
    return rows


def markdown(rows, z, cmd) -> str:
    mib = 2 ** 20
    base = {(r["model"], r["regime"], r["target"]): r for r in rows if r["variant"] == "default"}
    out = [f"Command: `{cmd}` (jax {jax.__version__}).", "",
           (f"Fine-tuning train step: `value_and_grad` with respect to the trained parameters "
            f"only, AdamW on them (trained parameters and optimizer state donated), random "
            f"weights, train mode with dropout. Size: hidden {z['hidden']}, {z['layers']} "
            f"layers, {z['heads']} heads, MLP {z['ff']}, batch {z['batch']}, sequence "
            f"{z['seq']} (ViT: {z['image']}^2 images, patch {z['patch']}). `lora`: rank-{RANK} "
            "adapters on every 2-D layer kernel, merged into the weight before the model "
            "runs. `transform` = `jaxmem.transform` of the same loss. Ratios: against the "
            "untouched step on the same plan; H100 plan = XLA:GPU compiled without a GPU (no "
            "autotuning, no timing)."), "",
           ("| model | regime | trained params | plan | default temp MiB | transform temp MiB "
            "| temp ratio | total ratio | CPU step ratio |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["variant"] != "transform":
            continue
        b = base[(r["model"], r["regime"], r["target"])]
        step = f"{r['step_ratio']:.2f}x" if "step_ratio" in r else ""
        out.append(f"| {r['model']} | {r['regime']} | {r['trained'] / r['params']:.2%} | "
                   f"{r['target']} | {b['temp'] / mib:.1f} | {r['temp'] / mib:.1f} | "
                   f"{r['temp'] / b['temp']:.2f}x | {r['total'] / b['total']:.2f}x | {step} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2,bert,vit,llama")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--targets", default="h100,cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--stem", default="hf_finetune")
    a = ap.parse_args(argv)
    regimes = a.regimes.split(",")
    for g in regimes:
        if g not in REGIMES:
            ap.error(f"--regimes: unknown regime {g!r} (known: {', '.join(REGIMES)})")
    z = dict(bench_hf.SIZES["moderate"])
    t0 = time.time()
    rows = run(a.models.split(","), regimes, a.targets.split(","), z, a.repeats)
    cmd = "python benchmarks/third_party/bench_finetune.py " + " ".join(argv or sys.argv[1:])
    md = markdown(rows, z, cmd.strip())
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, a.stem + ".json"), "w") as fh:
            json.dump({"size": z, "jax": jax.__version__, "wall_s": round(time.time() - t0),
                       "rows": rows}, fh, indent=1)
        with open(os.path.join(a.out, a.stem + ".md"), "w") as fh:
            fh.write(md)


if __name__ == "__main__":
    main()
