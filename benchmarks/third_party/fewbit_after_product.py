"""``fewbit=3`` on an activation whose output feeds a product: the exact op or the code?

When a smooth activation's output is the input of a converted ``dot_general`` /
convolution that keeps ``f(x)`` for its kernel gradient, a few-bit code cannot reproduce
``f(x)``: the coded op keeps ``f(x)`` (32 bits) *and* a ``b``-bit code, the exact op
(``x`` kept, ``f(x)`` and ``f'(x)`` recomputed in the backward pass) ``x`` alone (32 bits).
Per layer, the exact op keeps ``b`` bits per element fewer, and its gradient is exact.

The compiled step's peak also holds the backward's working set, and there the coded op wins
once: the exact op keeps ``x`` until ``f'(x) * g`` is formed, so the last layer's backward
holds ``x``, the recomputed ``f(x)`` and the cotangents together, while the coded op frees
``f(x)`` after the kernel gradient. At small depth that difference is the larger one, so
``jaxmem.transform(f, fewbit=b)`` counts the sites of the whole program and codes them when
``sum(E b / 8) < 0.75 max(E s)`` (``jaxmem.transform.fewbit_sites``).

This script measures both on the models where the rule applies (``linen_lm``: the MLP's
Dense -> GELU -> Dense; ``nnx_vit``: the same in NNX), full jitted train step (gradient and
adamw update), compiled total bytes, at depths 2 / 4 / 8 / 12: ``default`` (untouched),
``exact`` (``jaxmem.transform``), ``fewbit3`` (``jaxmem.transform(fewbit=3)``: its own
choice), ``fewbit3_exact`` and ``fewbit3_coded`` (each choice forced, for the measurement
only; coded is what a name-based conversion did). The batch sizes are those of
``flax_models_transform.py``.

Run (about 10 minutes on 2 shared cores):

    .venv/bin/python benchmarks/third_party/fewbit_after_product.py [--models linen_lm,nnx_vit]
        [--targets cpu,h100] [--depths 2,4,8,12] [--out benchmarks/results/third_party]

Writes ``fewbit_after_product.json`` and ``fewbit_after_product.md`` in ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flax_models_transform as FMT  # noqa: E402

import jaxmem.transform.match_elementwise as match_elementwise  # noqa: E402
from jaxmem.bench import flax_models as FM  # noqa: E402
from jaxmem.measure import compiled_memory  # noqa: E402
from jaxmem.transform import fewbit_sites

MIB = 2.0**20
VARIANTS = ("default", "exact", "fewbit3", "fewbit3_exact", "fewbit3_coded")


@contextlib.contextmanager
def _coded_after_products():
    """The transform's "exact after a product" rule off (for this measurement only)."""
    rule = match_elementwise._product_keeps_output
    match_elementwise._product_keeps_output = lambda *a, **k: False
    try:
        yield
    finally:
        match_elementwise._product_keeps_output = rule


@contextlib.contextmanager
def _exact_after_products():
    """The exact op after every product, whatever the count (for this measurement only)."""
    ws = fewbit_sites.WORKING_SET
    fewbit_sites.WORKING_SET = 0.0
    try:
        yield
    finally:
        fewbit_sites.WORKING_SET = ws


def total_bytes(name: str, variant: str, depth: int, target: str) -> int:
    case = FM.STEPS[name](batch_size=FMT.BATCH[name], depth=depth)
    if variant == "default":
        step = case.pure_step
    else:
        fewbit = None if variant == "exact" else 3
        step = FMT._step(case, FMT._transformer(fewbit))
    ctx = {"fewbit3_coded": _coded_after_products,
           "fewbit3_exact": _exact_after_products}.get(variant, contextlib.nullcontext)()
    with ctx:   # the transform traces (and applies its rules) inside the compile
        return compiled_memory(jax.jit(step), *case.pure_args, target=target).total_bytes


def measure(models, targets, depths) -> list[dict]:
    rows = []
    for target in targets:
        for name in models:
            for depth in depths:
                row = {"model": name, "target": target, "depth": depth}
                for v in VARIANTS:
                    row[v] = total_bytes(name, v, depth, target)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def markdown(rows, env) -> str:
    out = ["# `fewbit=3` after a product: exact op vs few-bit code", "",
           "Regenerate with `.venv/bin/python benchmarks/third_party/fewbit_after_product.py`.",
           "",
           f"jax {env['jax']}, {env['date']}. Full jitted train step (gradient and adamw "
           "update), compiled total bytes (temp + output + argument - alias), MiB, ratio to "
           "`default`. `exact`: `jaxmem.transform`; `fewbit3`: `jaxmem.transform(fewbit=3)` "
           "(its own choice for the GELU feeding a Dense, `jaxmem.transform.fewbit_sites`); "
           "`fewbit3_exact` / `fewbit3_coded`: the exact op (x kept, the Dense recomputes "
           "`f(x)`) / a 3-bit code beside the `f(x)` the Dense keeps, forced. `choice`: "
           "which one `fewbit3` took, and whether it is the smaller (`best`; ties count).", ""]
    for target in sorted({r["target"] for r in rows}, key=("cpu", "h100").index):
        out += [f"## {'XLA:CPU' if target == 'cpu' else 'H100 plan'}", "",
                "| model | depth | default MiB | exact | fewbit3 | fewbit3_exact | fewbit3_coded | "
                "coded - exact KiB | choice |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["target"] != target:
                continue
            d = r["default"]
            cells = [f"{r[v] / MIB:.3f} ({r[v] / d:.4f}x)" for v in VARIANTS[1:]]
            took = ("either (same bytes)" if r["fewbit3_coded"] == r["fewbit3_exact"] else
                    "coded" if r["fewbit3"] == r["fewbit3_coded"] else "exact")
            best = r["fewbit3"] <= min(r["fewbit3_coded"], r["fewbit3_exact"])
            out.append(f"| {r['model']} | {r['depth']} | {d / MIB:.3f} | " + " | ".join(cells)
                       + f" | {(r['fewbit3_coded'] - r['fewbit3_exact']) / 1024:+.1f} | "
                       f"{took}{' (best)' if best else ''} |")
        out.append("")
    out += ["Per layer the exact op keeps 3 bits per GELU element fewer; the coded op saves "
            "one recomputed `f(x)` in the last layer's backward working set. Where the "
            "coded column is lower (small depth), that working-set term is larger than the "
            "layers' code bytes; as depth grows the per-layer term wins and the exact op "
            "keeps fewer bytes with an exact gradient. `fewbit3` codes when the sites' "
            "codes, `sum(E * 3 / 8)`, are under 0.75 of the largest site's `f(x)` bytes.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="linen_lm,nnx_vit")
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--depths", default="2,4,8,12")
    ap.add_argument("--out", default=FMT.OUT)
    a = ap.parse_args(argv)
    rows = measure(a.models.split(","), a.targets.split(","),
                   [int(d) for d in a.depths.split(",")])
    env = {"jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fewbit_after_product.json"), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)
    with open(os.path.join(a.out, "fewbit_after_product.md"), "w") as fh:
        fh.write(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
