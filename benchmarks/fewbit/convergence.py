"""Convergence with few-bit backward: exact vs 1-4 bit activation gradients, several seeds.

    .venv/bin/python benchmarks/fewbit/convergence.py --seed S [--steps N]   # one chunk
    .venv/bin/python benchmarks/fewbit/convergence.py --merge                # tables + plot

Each ``--seed S`` invocation trains every method (exact, 1-4 bit) on both tasks with seed S
(initialisation and batch order; identical for every method of that seed) and writes
``benchmarks/results/fewbit/convergence_seed{S}.json``; ``--merge`` reads all seed files and
writes ``convergence.{json,md,png}``: per method the mean and spread over seeds of the final
losses and the per-seed *paired* difference vs exact.  The committed runs: seeds 0, 1, 2,
500 steps, Adam with 50 warm-up steps then cosine decay to 3 % of the peak learning rate and
global-norm clipping at 1.0 (one seed at a constant learning rate cannot resolve a 2 % target:
the seed-to-seed spread is 13-20 %).

Tasks:

* character-level LM: ``jaxmem.models.GPT`` (inline ``nn.gelu``, tanh form) on
  ``benchmarks/fewbit/data/fables.txt`` (40 KB, composed for this repo), byte vocabulary;
  held-out = last 10 % of the text;
* synthetic image task: 16x16 grey images of a noisy oriented bar (4 orientations,
  random position/width/contrast), a small conv net with inline ``jax.nn.silu``.

Few-bit runs switch the activations with ``jaxmem.scope(selective=False, fewbit=bits,
attention=False)`` around tracing.
Writes benchmarks/results/fewbit/convergence.{json,md,png}.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmem
from jaxmem.models import GPT, GPTConfig

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "fewbit"
METHODS = ["exact", 1, 2, 3, 4]


WARMUP = 50
FINAL_LR_FRACTION = 0.03


def schedule(lr: float, steps: int):
    """Linear warm-up over WARMUP steps, cosine decay to ``FINAL_LR_FRACTION * lr``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, WARMUP, steps, lr * FINAL_LR_FRACTION)


def train(loss_fn, params, batches, evaluate, bits, lr):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule(lr, len(batches))))

    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    if bits == "exact":
        step_c = jax.jit(step)
        step_c(params, opt.init(params), batches[0])  # compile
    else:
        with jaxmem.scope(selective=False, fewbit=bits, attention=False):
            step_c = jax.jit(step)
            step_c(params, opt.init(params), batches[0])  # trace + compile inside the patch
    state = opt.init(params)
    losses = []
    for b in batches:
        params, state, loss = step_c(params, state, b)
        losses.append(float(loss))
    return losses, float(evaluate(params))


def char_lm(steps: int, seed: int = 0):
    text = (HERE / "data" / "fables.txt").read_bytes()
    data = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    split = int(0.9 * len(data))
    tr, te = data[:split], data[split:]
    cfg = GPTConfig(vocab=256, ctx=64, d_model=96, n_head=4, n_layer=3)
    model = GPT(cfg)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        idx = rng.integers(0, len(tr) - cfg.ctx - 1, 32)
        batches.append(jnp.asarray(np.stack([tr[i:i + cfg.ctx + 1] for i in idx])))
    ev_idx = np.arange(0, len(te) - cfg.ctx - 1, cfg.ctx)
    ev = jnp.asarray(np.stack([te[i:i + cfg.ctx + 1] for i in ev_idx]))
    params = model.init(jax.random.PRNGKey(seed), batches[0][:, :-1])

    def loss_fn(p, b):
        lp = jax.nn.log_softmax(model.apply(p, b[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(lp, b[:, 1:, None], -1))

    evaluate = jax.jit(lambda p: loss_fn(p, ev))
    return loss_fn, params, batches, evaluate, 3e-3


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.silu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = jax.nn.silu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = jax.nn.silu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(x)


def bars(n, rng):
    yy, xx = np.mgrid[0:16, 0:16].astype(np.float32) - 7.5
    labels = rng.integers(0, 4, n)
    imgs = np.empty((n, 16, 16, 1), np.float32)
    for i, c in enumerate(labels):
        ang = c * np.pi / 4 + rng.normal(0, 0.2)
        off = rng.uniform(-4, 4)
        width = rng.uniform(0.8, 2.0)
        d = np.abs(np.cos(ang) * yy - np.sin(ang) * xx - off)
        img = rng.uniform(0.5, 1.5) * np.exp(-(d / width) ** 2)
        imgs[i, ..., 0] = img + rng.normal(0, 0.7, img.shape)
    return imgs, labels


def image_task(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1)
    batches = []
    for _ in range(steps):
        x, y = bars(64, rng)
        batches.append((jnp.asarray(x), jnp.asarray(y)))
    xe, ye = bars(1000, np.random.default_rng(999))
    model = ConvNet()
    params = model.init(jax.random.PRNGKey(seed), batches[0][0])

    def loss_fn(p, b):
        lp = jax.nn.log_softmax(model.apply(p, b[0]))
        return -jnp.mean(jnp.take_along_axis(lp, b[1][:, None], -1))

    evaluate = jax.jit(lambda p: loss_fn(p, (jnp.asarray(xe), jnp.asarray(ye))))
    return loss_fn, params, batches, evaluate, 2e-3


STEPS = 500
SEEDS = (0, 1, 2)
LAST = 50  # final train loss = mean of the last LAST steps
TASKS = (("char_lm_gpt_gelu", char_lm), ("bars_convnet_silu", image_task))


def _label(m) -> str:
    return "exact" if str(m) == "exact" else f"{m}-bit"


def run_seed(seed: int, steps: int) -> None:
    out = {"seed": seed, "steps": steps, "warmup": WARMUP,
           "final_lr_fraction": FINAL_LR_FRACTION, "results": {}}
    t0 = time.time()
    for task, make in TASKS:
        loss_fn, params, batches, evaluate, lr = make(steps, seed=seed)
        out["results"][task] = {"lr": lr}
        for m in METHODS:
            t = time.time()
            losses, ev = train(loss_fn, params, batches, evaluate, m, lr)
            out["results"][task][str(m)] = {"train": losses, "eval": ev}
            print(f"seed {seed} {task} {_label(m)}: train(last {LAST}) "
                  f"{np.mean(losses[-LAST:]):.4f} eval {ev:.4f} ({time.time() - t:.1f} s)",
                  flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"convergence_seed{seed}.json").write_text(json.dumps(out) + "\n")


def _stats(values) -> str:
    v = np.asarray(values, dtype=np.float64)
    se = v.std(ddof=1) / np.sqrt(v.size) if v.size > 1 else float("nan")
    return f"{v.mean():+.2f}% ± {se:.2f} [{v.min():+.2f}, {v.max():+.2f}]"


def merge() -> None:
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("convergence_seed*.json"))]
    if not runs:
        raise SystemExit("no convergence_seed*.json: run --seed S first")
    steps = runs[0]["steps"]
    seeds = [r["seed"] for r in runs]
    secs = sum(r.get("seconds", 0) for r in runs)
    lines = ["## Few-bit convergence (exact vs 1-4 bit activation gradients)", "",
             (f"{len(seeds)} seeds ({', '.join(map(str, seeds))}) x {steps} steps per run; "
             f"Adam, {WARMUP} warm-up steps, cosine decay to {FINAL_LR_FRACTION:g} x peak LR, "
             "clip 1.0. Within a seed every method sees the same initialisation and batches, "
             "so the *paired* difference (few-bit / exact - 1, per seed) isolates the effect of "
             "the approximate gradient; the seed-to-seed spread of the exact runs is the "
             "noise yardstick."), "",
             (f"Final train loss = mean of the last {LAST} steps; held-out loss = full "
             "held-out set after the last step. Paired columns: mean ± standard error "
              "[min, max] over seeds."),
             "", ("| task | method | final train loss, mean ± std over seeds | paired vs exact "
             "(train) | held-out loss, mean ± std | paired vs exact (held-out) |"),
             "|---|---|---|---|---|---|"]
    summary = {}
    for task, _ in TASKS:
        ex_tr = np.array([np.mean(r["results"][task]["exact"]["train"][-LAST:]) for r in runs])
        ex_ev = np.array([r["results"][task]["exact"]["eval"] for r in runs])
        summary[task] = {}
        for m in METHODS:
            tr = np.array([np.mean(r["results"][task][str(m)]["train"][-LAST:]) for r in runs])
            ev = np.array([r["results"][task][str(m)]["eval"] for r in runs])
            d_tr, d_ev = 100 * (tr / ex_tr - 1), 100 * (ev / ex_ev - 1)
            summary[task][str(m)] = {
                "train_final": tr.tolist(), "eval": ev.tolist(),
                "paired_train_pct": d_tr.tolist(), "paired_eval_pct": d_ev.tolist(),
                "paired_train_pct_mean": float(d_tr.mean()),
                "paired_eval_pct_mean": float(d_ev.mean())}
            lines.append(f"| {task} | {_label(m)} | {tr.mean():.4f} ± {tr.std(ddof=1):.4f} | "
                         f"{_stats(d_tr)} | {ev.mean():.4f} ± {ev.std(ddof=1):.4f} | "
                         f"{_stats(d_ev)} |")
        spread_tr = 100 * (ex_tr.max() - ex_tr.min()) / ex_tr.mean()
        spread_ev = 100 * (ex_ev.max() - ex_ev.min()) / ex_ev.mean()
        summary[task]["exact_seed_spread_pct"] = {"train": spread_tr, "eval": spread_ev}
        lines.append(f"| {task} | (exact: seed-to-seed range) | {spread_tr:.2f}% of mean | | "
                     f"{spread_ev:.2f}% of mean | |")
    cmd = ("`for s in 0 1 2; do flock /tmp/jaxmem-cpu.lock .venv/bin/python "
           "benchmarks/fewbit/convergence.py --seed $s; done; "
           ".venv/bin/python benchmarks/fewbit/convergence.py --merge`")
    lines += ["", ("A single-seed comparison (400 steps at a constant learning rate, seed 0 only: "
              "char-LM 3-bit +2.24 % / 4-bit -0.59 % (train), bars +0.23 % / +0.05 %) cannot "
              "resolve 2 %: the exact runs of seeds 1-2 differ from seed 0 by 13-20 % (char-LM). "
              "Hence this design: decayed learning rate, 3 seeds, paired differences."),
              "", f"Total {secs:.0f} s of training on 2 CPU cores.", "",
              "![convergence](convergence.png)", "", f"Regenerate: {cmd}"]
    (OUT / "convergence.md").write_text("\n".join(lines) + "\n")
    (OUT / "convergence.json").write_text(json.dumps(
        {"command": cmd, "steps": steps, "seeds": seeds, "warmup": WARMUP,
         "final_lr_fraction": FINAL_LR_FRACTION, "last": LAST, "summary": summary},
        indent=1) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    k = 20
    for ax, (task, _) in zip(axes, TASKS):
        for m in METHODS:
            ys = np.array([np.convolve(r["results"][task][str(m)]["train"], np.ones(k) / k,
                                       mode="valid") for r in runs])
            x = np.arange(ys.shape[1]) + k
            line, = ax.plot(x, ys.mean(0), label=_label(m), lw=1.2)
            ax.fill_between(x, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(f"{task} ({len(runs)} seeds: mean, band = min..max)")
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss (moving avg {k})")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "convergence.png", dpi=110)


def main() -> None:
    argv = sys.argv[1:]
    if "--merge" in argv:
        merge()
        return
    if "--seed" not in argv:
        raise SystemExit("usage: convergence.py --seed S [--steps N] | --merge")
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else STEPS
    run_seed(int(argv[argv.index("--seed") + 1]), steps)


if __name__ == "__main__":
    main()
