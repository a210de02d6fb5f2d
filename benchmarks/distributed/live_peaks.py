"""What is live at the peak of each distributed step's temp allocation, on the 8 x H100 plan.

For the models and layouts of ``bench_distributed.py`` (GPT and ResNet-50 at their default
sizes; DP, FSDP, TP; JAX default and ``jaxmem.linen.convert``), each step is lowered on 8
compile-only H100s and read with :func:`jaxmem.measure.live_peak_of_lowered`: the temp
allocation, the bytes live together at its peak (the address union of the values live at one
instruction), the allocation's packing loss, and the largest values live there.

    .venv/bin/python benchmarks/distributed/live_peaks.py [--models gpt,resnet50]

writes ``benchmarks/results/distributed/live_peaks.md``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_distributed as B  # re-runs this script with 8 host devices (XLA_FLAGS)
import jax
import optax

import jaxmem.linen
from jaxmem import distributed as jd
from jaxmem.measure import live_peak_of_lowered

MIB = 2.0**20
CASES = {"gpt": B.gpt_case, "resnet50": B.resnet_case}
LAYOUTS = ("dp", "fsdp", "tp")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,resnet50")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--top", type=int, default=4)
    a = ap.parse_args(argv)
    t0 = time.time()
    devs = B.target_devices(a.target)
    lines = [f"# Live at the peak of the distributed steps, 8 x {a.target} plan", "",
             (f"Command: `.venv/bin/python benchmarks/distributed/live_peaks.py` (jax "
              f"{jax.__version__}; {{secs}} s). The steps of `bench_distributed.py` at its "
              "default sizes (global batch 16, SGD), each lowered on 8 compile-only devices and "
              "read with `jaxmem.measure.live_peak_of_lowered`: temp = the per-device temp "
              "allocation, live = the bytes of temp values live together at its peak "
              "(the address union of XLA's buffer assignment over its live ranges), packing = "
              "temp - live. Arguments and outputs are not in temp."), "",
             ("| model | layout | variant | temp MiB | live at peak MiB | packing MiB | "
              "peak instruction | largest values live there (MiB) |"),
             "|---|---|---|---|---|---|---|---|"]
    for key in a.models.split(","):
        name, model, params, batch, make_loss = CASES[key](False)
        opt = optax.sgd(0.1)
        ostate = jax.eval_shape(opt.init, params)
        for layout in LAYOUTS:
            mode, su = B.STEP[layout]
            for variant in ("default", "jaxmem"):
                m = model if variant == "default" else jaxmem.linen.convert(model, fewbit=None)
                step = jd.train_step(make_loss(m), opt, jd.mesh(**B.MODES[layout], devices=devs),
                                     mode, shard_update=su)
                p = live_peak_of_lowered(step.lower(params, ostate, batch), a.target)
                top = "; ".join(f"{b.bytes / MIB:.2f} {b.shape.split('{')[0]} "
                                f"{_short(b.op_name or b.name)}" for b in p.buffers[:a.top])
                lines.append(f"| {name} | {layout.upper()} | {variant} | {p.temp_bytes / MIB:.2f} "
                             f"| {p.live_bytes / MIB:.2f} | {p.packing_bytes / MIB:.2f} | "
                             f"{p.instruction}:{p.instruction_name} | {top} |")
                print(lines[-1], flush=True)
    lines[2] = lines[2].replace("{secs}", f"{time.time() - t0:.0f}")
    out = B.OUT / "live_peaks.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


def _short(op: str) -> str:
    """An op name without its ``jit(...)/`` prefix and with ``|`` escaped for tables."""
    parts = op.split("/")
    op = "/".join(parts[1:] if parts[0].startswith("jit(") else parts).replace("|", "/")
    return op if len(op) <= 80 else op[:77] + "..."


if __name__ == "__main__":
    main()
