"""Convergence with few-bit backward: exact vs 1-4 bit activation gradients.

    .venv/bin/python benchmarks/fewbit/convergence.py [--steps N]

Two short real training runs, identical seeds and batches for every method:

* character-level LM: ``jaxmem.models.GPT`` (inline ``nn.gelu``, tanh form) on
  ``benchmarks/fewbit/data/fables.txt`` (40 KB, composed for this repo), byte vocabulary;
  held-out = last 10 % of the text;
* synthetic image task: 16x16 grey images of a noisy oriented bar (4 orientations,
  random position/width/contrast), a small conv net with inline ``jax.nn.silu``.

Few-bit runs switch the activations with ``jaxmem.fewbit.patch_activations`` around tracing.
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

from jaxmem import fewbit
from jaxmem.models import GPT, GPTConfig

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "fewbit"
METHODS = ["exact", 1, 2, 3, 4]


def train(loss_fn, params, batches, evaluate, bits, lr):
    opt = optax.adam(lr)

    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    if bits == "exact":
        step_c = jax.jit(step)
        step_c(params, opt.init(params), batches[0])  # compile
    else:
        with fewbit.patch_activations(bits=bits):
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


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 400
    results = {}
    t0 = time.time()
    for task, make in (("char_lm_gpt_gelu", char_lm), ("bars_convnet_silu", image_task)):
        loss_fn, params, batches, evaluate, lr = make(steps)
        results[task] = {}
        for m in METHODS:
            t = time.time()
            losses, ev = train(loss_fn, params, batches, evaluate, m, lr)
            results[task][str(m)] = {"train": losses, "eval": ev}
            print(f"{task} {m}: final train(avg last 50) {np.mean(losses[-50:]):.4f} "
                  f"eval {ev:.4f} ({time.time() - t:.1f} s)", flush=True)
    # summary
    lines = ["## Few-bit convergence (exact vs 1-4 bit activation gradients)", "",
             "| task | method | train loss (mean of last 50 steps) | vs exact | held-out loss | "
             "vs exact |", "|---|---|---|---|---|---|"]
    for task, r in results.items():
        ex_tr = np.mean(r["exact"]["train"][-50:])
        ex_ev = r["exact"]["eval"]
        for m in METHODS:
            tr = np.mean(r[str(m)]["train"][-50:])
            ev = r[str(m)]["eval"]
            label = "exact" if m == "exact" else f"{m}-bit"
            lines.append(f"| {task} | {label} | {tr:.4f} | {100 * (tr / ex_tr - 1):+.2f}% | "
                         f"{ev:.4f} | {100 * (ev / ex_ev - 1):+.2f}% |")
    cmd = "`.venv/bin/python benchmarks/fewbit/convergence.py" + (
        f" --steps {steps}`" if steps != 400 else "`")
    lines += ["", f"{steps} Adam steps per run, same seed and batches for every method; "
              f"total {time.time() - t0:.0f} s on CPU.", "", "![convergence](convergence.png)",
              "", f"Regenerate: {cmd}"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "convergence.md").write_text("\n".join(lines) + "\n")
    (OUT / "convergence.json").write_text(json.dumps({"command": cmd, "steps": steps,
                                                      "results": results}) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (task, r) in zip(axes, results.items()):
        for m in METHODS:
            y = np.asarray(r[str(m)]["train"])
            k = 20
            ys = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(len(ys)) + k, ys, label="exact" if m == "exact" else f"{m}-bit",
                    lw=1.2)
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (moving avg 20)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "convergence.png", dpi=110)


if __name__ == "__main__":
    main()
