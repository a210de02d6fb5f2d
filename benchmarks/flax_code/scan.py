"""Selective conversion of a Linen transformer whose blocks are unrolled, ``nn.scan``-ed, or
``nn.scan(nn.remat(...))``-ed: residual and compiled bytes per layer, default vs jaxmem.

Per form and activation: the slope (bytes per added layer, depths L and 2L) of

* residual bytes of the loss (``jaxmem.measure.residual_bytes``, activations only), and
* compiled bytes of the jitted gradient step (temp + output + argument - alias), with the
  parameters donated (``donate``) and without,

for the unconverted model ("default") and ``jaxmem.linen.convert(model, attention=False)``
(selective only), plus the step-time ratio jaxmem/default (median of repeated runs measured
side by side). ``scan_remat_names`` is ``nn.remat`` with the policy
``save_only_these_names`` over jaxmem's residual names (``jaxmem.selective.*``).

Run: ``python benchmarks/flax_code/scan.py`` (writes ``benchmarks/results/flax_code/scan.md``
and ``scan.json``); ``--quick`` measures fewer forms.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmem.measure import compiled_memory, residual_bytes
from jaxmem.models.transformer import SelfAttention, layer_norm

try:
    from jaxmem.linen import convert as _linen_convert

    def convert(model):
        return _linen_convert(model, selective=True, fewbit=None, attention=False)
    ENTRY = "jaxmem.linen.convert(model, fewbit=None, attention=False)"
except ImportError:  # pragma: no cover
    from jaxmem.selective.linen import convert
    ENTRY = "jaxmem.selective.linen.convert(model)"

V, T, D, H, B = 64, 32, 64, 4, 8
NAMES = ("jaxmem.selective.norm.input", "jaxmem.selective.dense.input",
         "jaxmem.selective.relu.mask")
OUT = Path(__file__).resolve().parents[1] / "results" / "flax_code"


class Block(nn.Module):
    """Pre-LN block: ``x + attn(LN(x))``, then ``x + c_proj(act(c_fc(LN(x))))``."""
    act: str = "gelu"

    @nn.compact
    def __call__(self, x, _):
        x = x + SelfAttention(H, True, name="attn")(layer_norm("ln_1")(x))
        h = nn.Dense(4 * D, name="c_fc")(layer_norm("ln_2")(x))
        h = nn.relu(h) if self.act == "relu" else nn.gelu(h, approximate=True)
        return x + nn.Dense(D, name="c_proj")(h), None


class Net(nn.Module):
    form: str
    depth: int
    act: str = "gelu"

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(V, D, name="wte")(tok)
        if self.form == "unrolled":
            for i in range(self.depth):
                x, _ = Block(self.act, name=f"h_{i}")(x, None)
        else:
            blk = Block
            if self.form == "scan_remat":
                blk = nn.remat(Block, prevent_cse=False)
            elif self.form == "scan_remat_names":
                blk = nn.remat(Block, prevent_cse=False,
                               policy=jax.checkpoint_policies.save_only_these_names(*NAMES))
            x, _ = nn.scan(blk, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.depth)(self.act, name="h")(x, None)
        return nn.Dense(V, name="head")(layer_norm("ln_f")(x))


def _loss_fn(model):
    def loss(params, tok, tgt):
        logits = model.apply({"params": params}, tok)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1))
    return loss


def _setup(form, depth, act, conv):
    model = Net(form, depth, act)
    tok = jax.random.randint(jax.random.key(0), (B, T), 0, V)
    tgt = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    params = model.init(jax.random.key(2), tok)["params"]
    return _loss_fn(convert(model) if conv else model), params, tok, tgt


def _measure(form, depth, act, conv):
    loss, params, tok, tgt = _setup(form, depth, act, conv)
    g = jax.grad(loss)
    c = compiled_memory(g, params, tok, tgt).total_bytes
    cd = compiled_memory(g, params, tok, tgt, donate_argnums=(0,)).total_bytes
    r = residual_bytes(loss, params, tok, tgt).activation_bytes
    return {"compiled": c, "compiled_donated": cd, "residual": r}


def _time_ratio(form, depth, act, reps):
    fns = []
    for conv in (False, True):
        loss, params, tok, tgt = _setup(form, depth, act, conv)
        f = jax.jit(jax.grad(loss))
        jax.block_until_ready(f(params, tok, tgt))
        fns.append((f, (params, tok, tgt)))
    ts = {0: [], 1: []}
    for _ in range(reps):
        for i, (f, a) in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts[i].append(time.perf_counter() - t0)
    return statistics.median(ts[1]) / statistics.median(ts[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2, help="L (slope from L and 2L)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per variant")
    ap.add_argument("--quick", action="store_true", help="relu only; no remat_names form")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    forms = ["unrolled", "scan", "scan_remat"] + ([] if args.quick else ["scan_remat_names"])
    acts = ["relu"] if args.quick else ["relu", "gelu"]
    L = args.depth
    rows = []
    for act in acts:
        for form in forms:
            row = {"act": act, "form": form}
            for conv, who in ((False, "default"), (True, "jaxmem")):
                lo, hi = _measure(form, L, act, conv), _measure(form, 2 * L, act, conv)
                row[who] = {k: (hi[k] - lo[k]) / L for k in lo}
            row["ratio"] = {k: row["jaxmem"][k] / row["default"][k] if row["default"][k]
                            else None for k in row["default"]}
            row["time_ratio"] = _time_ratio(form, 2 * L, act, args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
           "python": sys.version.split()[0], "machine": platform.machine(),
           "cpus": __import__("os").cpu_count()}
    cmd = "python benchmarks/flax_code/scan.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])
    result = {"command": cmd.strip(), "entry": ENTRY, "env": env,
              "shape": {"batch": B, "time": T, "d_model": D, "heads": H, "vocab": V},
              "depths": [L, 2 * L], "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scan.json").write_text(json.dumps(result, indent=1) + "\n")
    kib = lambda v: f"{v / 1024:.0f}"
    lines = [
        "# Selective conversion under nn.scan / nn.remat (Linen transformer)", "",
        f"Command: `{result['command']}`  ",
        f"Converted with `{ENTRY}`.  ",
        f"Environment: jax {env['jax']}, flax {env['flax']}, backend {env['backend']}, "
        f"python {env['python']}, {env['machine']}, {env['cpus']} CPUs.  ",
        f"Model: Embed -> blocks (LN, causal self-attention, LN, Dense 4d, act, Dense d) -> LN "
        f"-> head; batch {B}, time {T}, d_model {D}, heads {H}. Slope from depths {L} and "
        f"{2 * L}: KiB per added layer. Compiled = temp + output + argument - alias of the "
        "jitted gradient (\"donated\": parameters donated). Time ratio: jaxmem/default, "
        "median step time, side by side.", "",
        "| act | form | residual default | residual jaxmem | ratio | compiled default | "
        "compiled jaxmem | ratio | donated default | donated jaxmem | ratio | time ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, j, q = r["default"], r["jaxmem"], r["ratio"]
        f = lambda k: f"{kib(d[k])} | {kib(j[k])} | " + (f"{q[k]:.3f}" if q[k] else "-")
        lines.append(f"| {r['act']} | {r['form']} | {f('residual')} | {f('compiled')} | "
                     f"{f('compiled_donated')} | {r['time_ratio']:.2f} |")
    (OUT / "scan.md").write_text("\n".join(lines) + "\n")
    print("wrote", OUT / "scan.md")


if __name__ == "__main__":
    main()
