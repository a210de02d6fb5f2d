"""Regenerate benchmarks/results/selective/: the paper's Figure 1 and CNN cases.

Command: .venv/bin/python benchmarks/selective/run_all.py [--models resnet18,resnet50,vgg11_bn]
    [--part main|per_image|all]
``main`` (default ``all`` runs both) writes selective.json, selective.md, figure1.png,
cases.png (publishes step-time ratios: run it under the shared CPU lock). ``per_image``
writes per_image.json / per_image.md: compiled / residual / saved bytes and the measured
process peak at batch 8 and 32 for the Input and All cases of ResNet-18 / ResNet-50, and the
slope in bytes per image (one fresh subprocess per measured peak).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

OUT = os.path.join(os.path.dirname(__file__), "..", "results", "selective")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=("main", "per_image", "all"), default="all")
    a = ap.parse_args()
    from jaxmem.bench import selective as B
    models = a.models.split(",") if a.models else None
    cmd = "python benchmarks/selective/run_all.py " + " ".join(sys.argv[1:])
    os.makedirs(OUT, exist_ok=True)
    if a.part in ("per_image", "all"):
        t0 = time.time()
        rows = B.slope_rows(models_=tuple(models or ("resnet18", "resnet50")),
                            progress=lambda m: print(m, flush=True))
        sec = B.slope_section(rows, meta={"command": cmd.strip(),
                                          "seconds": round(time.time() - t0, 1)})
        with open(os.path.join(OUT, "per_image.json"), "w") as f:
            f.write(sec.to_json())
        with open(os.path.join(OUT, "per_image.md"), "w") as f:
            f.write(f"Regenerate with `{cmd.strip()}` (CPU, jax "
                    f"{__import__('jax').__version__}).\n\n")
            f.write(sec.to_markdown())
        print(sec.to_markdown())
    if a.part == "per_image":
        return
    t0 = time.time()
    sec = B.run(quick=a.quick, models=models, progress=lambda m: print(m, flush=True))
    sec.meta["command"] = cmd.strip()
    sec.meta["seconds"] = round(time.time() - t0, 1)
    plots = _plots(sec)
    sec.plots = [os.path.basename(p) for p in plots]
    with open(os.path.join(OUT, "selective.json"), "w") as f:
        f.write(sec.to_json())
    with open(os.path.join(OUT, "selective.md"), "w") as f:
        f.write(f"Regenerate with `{cmd.strip()}` (CPU, jax {__import__('jax').__version__}).\n\n")
        f.write(sec.to_markdown())
    print(sec.to_markdown())


def _plots(sec):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    fig = [r for r in sec.rows if r["table"] == "figure1"]
    if fig:
        f, ax = plt.subplots(1, 4, figsize=(16, 3.5), sharey=True)
        for i, case in enumerate(("all", "none", "layer4", "layers4+")):
            rs = sorted([r for r in fig if r["case"] == case], key=lambda r: r["depth"])
            d = [r["depth"] for r in rs]
            for key, lab in (("jax_residual", "JAX default (residual)"),
                             ("jaxmem_residual", "jaxmem (residual)"),
                             ("torch_saved", "PyTorch default (saved)"),
                             ("memsave_saved", "torch_ref.memsave (saved)")):
                if rs and rs[0].get(key) is not None:
                    ax[i].plot(d, [r[key] / r["layer_input_bytes"] for r in rs], "o-", label=lab)
            ax[i].set_title(case)
            ax[i].set_xlabel("depth")
        ax[0].set_ylabel("bytes / layer input")
        ax[0].legend(fontsize=7)
        p = os.path.join(OUT, "figure1.png")
        f.tight_layout(); f.savefig(p, dpi=100); plt.close(f)
        out.append(p)
    cnn = [r for r in sec.rows if r["table"] == "cnn"]
    if cnn:
        models = sorted({r["model"] for r in cnn})
        f, ax = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
        for i, m in enumerate(models):
            rs = [r for r in cnn if r["model"] == m]
            ax[0][i].bar(range(len(rs)), [r["ratio"] for r in rs])
            ax[0][i].set_xticks(range(len(rs)), [r["case"] for r in rs], rotation=45)
            ax[0][i].axhline(1.0, color="k", lw=0.5)
            ax[0][i].set_title(f"{m}: jaxmem / JAX compiled bytes")
        p = os.path.join(OUT, "cases.png")
        f.tight_layout(); f.savefig(p, dpi=100); plt.close(f)
        out.append(p)
    return out


if __name__ == "__main__":
    main()
