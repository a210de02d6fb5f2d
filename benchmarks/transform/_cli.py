"""The command line shared by the transform benchmarks: ``--targets`` (comma-separated plans,
GPU plans only where the plugin loads) and ``--out`` (a folder for ``<stem>.json`` and
``<stem>.md``)."""
from __future__ import annotations

import argparse
import json
import os

import jax

from jaxmem.measure import gpu_plan_available


def main(doc: str, run, markdown, stem: str, argv=None) -> int:
    """Parse ``argv``, ``rows = run(targets)``, print ``markdown(rows, targets)`` and write
    both to ``--out`` when given."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t and (t == "cpu" or gpu_plan_available())]
    rows = run(targets)
    md = markdown(rows, targets)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{stem}.json"), "w") as fh:
            json.dump({"jax": jax.__version__, "rows": rows}, fh, indent=1)
        with open(os.path.join(a.out, f"{stem}.md"), "w") as fh:
            fh.write(md)
    return 0
