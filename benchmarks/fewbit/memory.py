"""Few-bit memory + step-time benchmark (JAX default vs fewbit 1-4 bit vs PyTorch twins).

    .venv/bin/python benchmarks/fewbit/memory.py [--quick]

Writes benchmarks/results/fewbit/memory.{json,md}.  Runs the `jaxmem bench` section
(jaxmem.bench.fewbit.run) in full mode: frozen GELU MLP slope, GPT decoder and tiny ViT
(compiled bytes total + per layer, residual bytes, step-time ratio), PyTorch GPT twin
(saved bytes, step-time ratio).
"""
from __future__ import annotations

import pathlib
import sys
import time

from jaxmem.bench import fewbit

OUT = pathlib.Path(__file__).resolve().parents[1] / "results" / "fewbit"


def main() -> None:
    quick = "--quick" in sys.argv
    t = time.time()
    sec = fewbit.run(quick=quick, progress=lambda s: print(s, flush=True))
    cmd = "`.venv/bin/python benchmarks/fewbit/memory.py" + (" --quick`" if quick else "`")
    sec.meta["command"] = cmd
    sec.meta["seconds"] = round(time.time() - t, 1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "memory.json").write_text(sec.to_json() + "\n")
    (OUT / "memory.md").write_text(sec.to_markdown() + f"\nRegenerate: {cmd}\n")
    print(sec.to_markdown())


if __name__ == "__main__":
    main()
