"""What the tensor parallel benchmarks share: one SGD step on a 4 x 2 ``('data', 'model')``
mesh compiled (never run) for a target, its per-device bytes and collectives, the
``--target`` / ``--out`` arguments and the results files. Import it before JAX: it
re-executes the script with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 host
devices for ``cpu``; the device count is fixed when JAX starts)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

NDEV = 8
_FLAG = f"--xla_force_host_platform_device_count={NDEV}"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.execv(sys.executable, [sys.executable, *sys.argv])

import jax
import optax

from jaxmem import distributed as jd
from jaxmem.measure import TARGETS, target_mesh
from jaxmem.measure.target import compile_lowered

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "distributed"
LIMITS = ("H100 plan: XLA:GPU's plan for 8 x H100 compiled without a GPU (no autotuning: "
          "`temp` is a lower bound). CPU: XLA:CPU on 8 host devices.")


def measure(loss, params, batch, target, **step_options):
    """Per-device ``temp`` / ``argument`` bytes and collectives of
    ``train_step(loss, sgd, mesh(data=4, model=2), "tp", **step_options)`` on ``target``."""
    devs = None if target == "cpu" else list(target_mesh(target, (NDEV,), ("data",)).devices.flat)
    opt = optax.sgd(0.1)
    step = jd.train_step(loss, opt, jd.mesh(data=NDEV // 2, model=2, devices=devs), "tp",
                         **step_options)
    lowered = step.lower(params, jax.eval_shape(opt.init, params), batch)
    compiled, _ = compile_lowered(lowered, target, "auto")
    m = compiled.memory_analysis()
    c = jd.collectives(compiled.as_text())
    return {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
            "collectives": c.counts, "collective_bytes": c.bytes}


def arguments(doc: str) -> tuple[list[str], Path]:
    """``(targets, out)`` from the command line."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--target", default="h100,cpu",
                    help=f"comma-separated compile targets ({', '.join(TARGETS)})")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    targets = [t for t in args.target.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"--target: {t!r} is not one of {TARGETS}")
    return targets, args.out


def command(script: str, targets: list[str]) -> str:
    return (f".venv/bin/python benchmarks/distributed/{script}"
            + (f" --target {','.join(targets)}" if targets != ["h100", "cpu"] else ""))


def write(out: Path, name: str, meta: dict, rows: list, md: str) -> None:
    """``<out>/<name>.json`` (meta and rows) and ``<out>/<name>.md``; prints the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(md + "\n")
    print(md)


def heading(target: str) -> str:
    return f"## {'8 x H100 plan' if target != 'cpu' else '8 host CPU devices'}"


def collective_cells(m: dict) -> str:
    """``count | MB`` of a :func:`measure` result's collectives (table cells)."""
    return f"{sum(m['collectives'].values())} | {sum(m['collective_bytes'].values()) / 1e6:.2f}"
