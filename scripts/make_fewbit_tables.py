"""Regenerate jaxmem/fewbit/tables/*.json (few-bit derivative tables, 1-4 bits).

    .venv/bin/python scripts/make_fewbit_tables.py [names...]

For every activation in ``jaxmem.fewbit.activations.TABLE_ACTIVATIONS``: derivative by JAX
autodiff in float64, ``jaxmem.fewbit.fit`` with the defaults (uniform weight on [-10, 10],
grid 4096, DP + eq.-5 refinement; symmetric for even derivatives).  Deterministic.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

from jaxmem.fewbit.activations import TABLE_ACTIVATIONS, numpy_derivative
from jaxmem.fewbit.fit import fit

SETTINGS = dict(interval=(-10.0, 10.0), weight="uniform", grid=4096, refine=True)
OUT = pathlib.Path(__file__).resolve().parents[1] / "jaxmem" / "fewbit" / "tables"


def make(name: str) -> dict:
    act = TABLE_ACTIVATIONS[name]
    d = numpy_derivative(act.fn)
    doc = {
        "name": name,
        "generator": "scripts/make_fewbit_tables.py",
        "interval": list(SETTINGS["interval"]),
        "weight": SETTINGS["weight"],
        "grid": SETTINGS["grid"],
        "refine": SETTINGS["refine"],
        "symmetric": act.symmetric,
        "bits": {},
    }
    for bits in range(1, 5):
        f = fit(d, bits, interval=SETTINGS["interval"], weight=None, grid=SETTINGS["grid"],
                symmetric=act.symmetric, refine=SETTINGS["refine"])
        doc["bits"][str(bits)] = {
            "borders": [float(v) for v in f.borders],
            "levels": [float(v) for v in f.levels],
            "error": f.error,
        }
    return doc


def main(argv: list[str]) -> None:
    names = argv or sorted(TABLE_ACTIVATIONS)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        t = time.time()
        doc = make(name)
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        errs = ", ".join(f"{doc['bits'][str(b)]['error']:.5f}" for b in range(1, 5))
        print(f"{name:12s} errors 1-4 bit: {errs}  ({time.time() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
