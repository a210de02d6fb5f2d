"""Where do the bytes per GPT layer go?  Default vs few-bit vs few-bit + exact attention.

    .venv/bin/python benchmarks/fewbit/accounting.py

For each configuration, compiles ``jit(grad(loss))`` of the benchmark GPT (d 128, ctx 128,
batch 8, as in memory.py) at depths 2 and 4 with XLA's buffer dumps switched on (one
subprocess per compile: ``XLA_FLAGS=--xla_dump_to``), reads what is live at the peak of the
temp allocation (``jaxmem.measure.read_live_peak``) and lists those arrays per added layer (count at depth 4 minus count at
depth 2, divided by 2), labelled by the op that produced them, in units of
``E = batch * (ctx-1) * d_model * 4 B = 0.496 MiB`` (one float32 activation of the residual
stream).  Also prints the compiled-bytes slope and the jaxpr-level residual entries per layer.
Writes benchmarks/results/fewbit/accounting.md.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "fewbit"
E = 8 * 127 * 128 * 4
CONFIGS = {
    "jax default": {"bits": None, "attn": False, "sel": False},
    "fewbit 3-bit GELU": {"bits": 3, "attn": False, "sel": False},
    "fewbit only: 3-bit GELU + selective.attention": {"bits": 3, "attn": True, "sel": False},
    "combined: + linen.convert": {"bits": 3, "attn": True, "sel": True},
}

CHILD = r'''
import json, sys
import jax
import jaxmem
from jaxmem.bench.fewbit import _gpt
from jaxmem.measure import residual_bytes
cfg = json.loads(sys.argv[1]); L = int(sys.argv[2])
conv = {"fewbit": cfg["bits"], "attention": cfg["attn"]} if cfg["sel"] else None
loss, params, tok, _ = _gpt(L, False, convert=conv)
with jaxmem.scope(selective=False, fewbit=cfg["bits"], attention=cfg["attn"]):
    c = jax.jit(jax.grad(loss)).lower(params, tok).compile()
    m = c.memory_analysis()
    res = residual_bytes(loss, params, tok)
ents = [[str(e.dtype), list(e.shape), e.primitive, e.nbytes] for e in res.by_kind("activation")]
print(json.dumps({"total": m.temp_size_in_bytes + m.output_size_in_bytes
                  + m.argument_size_in_bytes - m.alias_size_in_bytes,
                  "temp": m.temp_size_in_bytes, "residuals": ents}))
'''


def _label(op_name: str) -> str:
    """``jit(loss)/jvp(GPT)/h_3/mlp/mul`` -> ``fwd mlp/mul`` (layer index dropped)."""
    kind = "bwd" if "transpose(" in op_name else "fwd"
    path = re.sub(r"^.*?\(GPT\)\)?/", "", op_name)
    path = re.sub(r"h_\d+/", "", path)
    return f"{kind} {path}"


def _peak_buffers(dump: pathlib.Path) -> collections.Counter:
    """Bytes per (producing op, shape) of the temp values live at the peak of the dumped
    ``jit(grad(loss))`` (:func:`jaxmem.measure.read_live_peak`)."""
    from jaxmem.measure import read_live_peak

    out = collections.Counter()
    for b in read_live_peak(str(dump), "jit_loss").buffers:
        label = _label(b.op_name) if b.op_name else b.name
        out[(label, re.sub(r"\{.*", "", b.shape))] += b.bytes
    return out


def measure(cfg: dict, L: int) -> tuple[dict, collections.Counter]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp}")
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(L)], env=env,
                           capture_output=True, text=True, check=True)
        info = json.loads(r.stdout.strip().splitlines()[-1])
        return info, _peak_buffers(pathlib.Path(tmp))


def main() -> None:
    md = ["## Bytes per GPT layer, accounted (values of XLA's temp allocation live at its peak)", "",
          ("GPT d 128, ctx 128 (127 used), batch 8, 4 heads; full training gradient. "
          f"Unit E = 8*127*128*4 B = {E / 2**20:.3f} MiB (one float32 residual-stream "
          "activation; the MLP hidden is 4E, the attention matrix 3.97E). Per layer = "
          "(depth 4 - depth 2) / 2. Parameters + their gradients: 1.5 MiB = 3.0E per layer "
          "(argument + output, not temp)."), ""]
    for label, cfg in CONFIGS.items():
        (i2, p2), (i4, p4) = measure(cfg, 2), measure(cfg, 4)
        per_total = (i4["total"] - i2["total"]) / 2
        per_temp = (i4["temp"] - i2["temp"]) / 2
        md += [f"### {label}", "",
               (f"compiled bytes per layer {per_total / 2**20:.2f} MiB = {per_total / E:.2f}E "
               f"(temp {per_temp / E:.2f}E + parameters/gradients)"), "",
               "| live at the peak, per layer | shape | E |", "|---|---|---|"]
        keys = sorted(set(p2) | set(p4), key=lambda k: -(p4[k] - p2[k]))
        acc = 0.0
        for k in keys:
            d = (p4[k] - p2[k]) / 2 / E
            if abs(d) >= 0.01:
                md.append(f"| {k[0]} | {k[1]} | {d:.3f} |")
                acc += d
        md += [f"| **sum** | | **{acc:.2f}** |", ""]
        res = collections.Counter()
        for L, info in ((2, i2), (4, i4)):
            for dt, shape, prim, nb in info["residuals"]:
                res[(dt, tuple(shape), prim)] += nb if L == 4 else -nb
        md += ["jaxpr-level activation residuals per layer (what autodiff hands to XLA): "
               + ", ".join(f"{dt}{list(s)} from {p}: {v / 2 / E:.2f}E"
                           for (dt, s, p), v in sorted(res.items(), key=lambda kv: -kv[1])
                           if abs(v) / 2 / E >= 0.01), ""]
        print("\n".join(md[-(len(keys) + 8):]), flush=True)
    md += ["Regenerate: `.venv/bin/python benchmarks/fewbit/accounting.py`"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "accounting.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
