"""Seed-to-seed spread of the *exact* runs of convergence.py (a noise yardstick).

    .venv/bin/python benchmarks/fewbit/convergence_noise.py

Re-runs the exact (no few-bit) training of both tasks with seeds 1 and 2 (other init and
batch order) and appends the spread to benchmarks/results/fewbit/convergence.md.
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from convergence import OUT, char_lm, image_task, train  # noqa: E402


def main() -> None:
    base = json.loads((OUT / "convergence.json").read_text())
    steps = base["steps"]
    lines = ["", "### Seed spread of the exact runs (noise yardstick)", "",
             "| task | seed | train loss (last 50) | vs seed 0 | held-out | vs seed 0 |",
             "|---|---|---|---|---|---|"]
    out = {}
    for task, make in (("char_lm_gpt_gelu", char_lm), ("bars_convnet_silu", image_task)):
        r0 = base["results"][task]["exact"]
        tr0, ev0 = np.mean(r0["train"][-50:]), r0["eval"]
        for seed in (1, 2):
            loss_fn, params, batches, evaluate, lr = make(steps, seed=seed)
            losses, ev = train(loss_fn, params, batches, evaluate, "exact", lr)
            tr = np.mean(losses[-50:])
            out[f"{task}/seed{seed}"] = {"train_last50": float(tr), "eval": ev}
            lines.append(f"| {task} | {seed} | {tr:.4f} | {100 * (tr / tr0 - 1):+.2f}% | "
                         f"{ev:.4f} | {100 * (ev / ev0 - 1):+.2f}% |")
            print(lines[-1], flush=True)
    lines += ["", "Regenerate: `.venv/bin/python benchmarks/fewbit/convergence_noise.py` "
              "(after convergence.py)"]
    (OUT / "convergence_noise.json").write_text(json.dumps(out, indent=1) + "\n")
    md = (OUT / "convergence.md").read_text().split("\n### Seed spread")[0].rstrip("\n")
    (OUT / "convergence.md").write_text(md + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
