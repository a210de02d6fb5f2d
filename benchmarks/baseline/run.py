"""JAX default vs PyTorch default on the twin model zoo (the `baseline` bench section).

    .venv/bin/python benchmarks/baseline/run.py                 # all models, full sizes
    .venv/bin/python benchmarks/baseline/run.py --quick         # the `jaxmem bench --quick` set
    .venv/bin/python benchmarks/baseline/run.py --models gpt,vit

Writes baseline.json, baseline.md, baseline_residuals.png and baseline_peak.png to --out
(default benchmarks/results/baseline/), each stating the command that regenerates it.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default=None, help="comma-separated (default: all)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "baseline"))
    args = p.parse_args(argv)

    from jaxmem.bench import baseline
    from jaxmem.bench.report import write_section

    models = [m.strip() for m in args.models.split(",")] if args.models else None
    t0 = time.perf_counter()
    section = baseline.run(quick=args.quick, models=models,
                           progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}",
                                                    flush=True))
    seconds = time.perf_counter() - t0
    command = ".venv/bin/python benchmarks/baseline/run.py" + (
        " " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    section.notes.append(f"Regenerate: `{command}` (took {seconds:.0f} s on "
                         f"{os.cpu_count()} CPUs, {platform.machine()}; machine shared with "
                         "other jobs, so only the deterministic byte columns are exact).")
    section.meta["command"] = command
    os.makedirs(args.out, exist_ok=True)
    write_section(section, args.out, extra={"command": command, "seconds": seconds})
    print(section.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
