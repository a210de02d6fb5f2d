"""Selective conversion of layer stacks unrolled and scanned: residual and compiled bytes per
layer, default vs jaxmem.

Stacks: a Linen transformer (LN, causal self-attention, LN, MLP) unrolled, ``nn.scan``-ed,
``nn.scan(nn.remat(...))``-ed; an NNX residual MLP stack (LN, Linear 4d, act, Linear d)
unrolled (``nnx.List``) and under ``nnx.vmap``/``nnx.scan``; the same Linen MLP block applied
with stacked parameters in a Python loop and in ``jax.lax.scan`` inside ``jaxmem.scope``.

Per form and activation: the slope (bytes per added layer, depths L and 2L) of

* residual bytes of the loss (``jaxmem.measure.residual_bytes``, activations only), and
* compiled bytes of the jitted gradient step (temp + output + argument - alias), with the
  parameters donated (``donate``) and without,

for the unconverted model ("default") and the converted one (``jaxmem.linen.convert`` /
``jaxmem.nnx.convert`` / ``jaxmem.scope`` with ``fewbit=None, attention=False``: selective
only), plus the step-time ratio jaxmem/default (median of repeated runs measured
side by side). ``scan_remat_names`` is ``nn.remat`` with the policy
``save_only_these_names`` over jaxmem's residual names (``jaxmem.selective.*``).

Run: ``python benchmarks/flax_code/scan.py`` (writes ``benchmarks/results/flax_code/scan.md``
and ``scan.json``); ``--quick`` skips the donated figures and the ``scan_remat_names`` form.
``total 2L``: compiled bytes of the whole step at the larger depth (for remat forms the
saving is the recomputed block's working set, which does not grow with depth).
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
from flax import nnx

import jaxmem

from jaxmem.measure import compiled_memory, residual_bytes
from jaxmem.models.transformer import SelfAttention, layer_norm


def convert(model):
    return jaxmem.linen.convert(model, selective=True, fewbit=None, attention=False)


ENTRY = ("jaxmem.linen.convert(model, fewbit=None, attention=False) / jaxmem.nnx.convert("
         "module, fewbit=None, attention=False) / jaxmem.scope(fewbit=None, attention=False)")

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


class MlpBlock(nn.Module):
    """``x + Dense d(act(Dense 4d(LN(x))))`` (Linen)."""
    act: str = "gelu"

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * D, name="fc1")(nn.LayerNorm(name="ln")(x))
        h = nn.relu(h) if self.act == "relu" else nn.gelu(h, approximate=True)
        return x + nn.Dense(D, name="fc2")(h)


class NnxBlock(nnx.Module):
    """``x + Linear d(act(Linear 4d(LN(x))))`` (NNX)."""

    def __init__(self, act, *, rngs):
        self.act = act
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        h = self.fc1(self.ln(x))
        h = nnx.relu(h) if self.act == "relu" else nnx.gelu(h, approximate=True)
        return x + self.fc2(h)


class NnxStack(nnx.Module):
    """Linear -> L blocks (``nnx.List`` or ``nnx.vmap``-created and ``nnx.scan``-ned) -> Linear."""

    def __init__(self, depth, act, scan, *, rngs):
        self.scan = scan
        self.embed = nnx.Linear(D, D, rngs=rngs)
        if scan:
            @nnx.vmap(in_axes=0, out_axes=0)
            def create(key):
                return NnxBlock(act, rngs=nnx.Rngs(key))
            self.blocks = create(jax.random.split(rngs.params(), depth))
        else:
            self.blocks = nnx.List([NnxBlock(act, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        if self.scan:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(h, blk):
                return blk(h)
            x = forward(x, self.blocks)
        else:
            for blk in self.blocks:
                x = blk(x)
        return self.head(x)


def _ce(logits, tgt):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1))


def _setup_nnx(form, depth, act, conv):
    model = NnxStack(depth, act, form == "nnx_scan", rngs=nnx.Rngs(2))
    if conv:
        model = jaxmem.nnx.convert(model, fewbit=None, attention=False)
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    tgt = jax.random.randint(jax.random.key(1), (B, T), 0, V)

    def loss(params, x, tgt):
        return _ce(nnx.merge(graphdef, params)(x), tgt)
    return loss, params, x, tgt


def _setup_lax(form, depth, act, conv):
    blk = MlpBlock(act)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    tgt = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    keys = jax.random.split(jax.random.key(2), depth)
    stacked = jax.vmap(lambda k: blk.init(k, x)["params"])(keys)
    head = jax.random.normal(jax.random.key(3), (D, V)) / D ** 0.5
    if form == "lax_unrolled":  # one tree per layer: no slicing inside the step
        params = {"blocks": [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(depth)],
                  "head": head}
    else:
        params = {"blocks": stacked, "head": head}

    def body(params, x):
        if form == "lax_scan":
            x, _ = jax.lax.scan(lambda h, p: (blk.apply({"params": p}, h), None), x,
                                params["blocks"])
        else:
            for p in params["blocks"]:
                x = blk.apply({"params": p}, x)
        return x @ params["head"]

    def loss(params, x, tgt):
        if conv:
            with jaxmem.scope(fewbit=None, attention=False):
                return _ce(body(params, x), tgt)
        return _ce(body(params, x), tgt)
    return loss, params, x, tgt


def _loss_fn(model):
    def loss(params, tok, tgt):
        logits = model.apply({"params": params}, tok)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1))
    return loss


def _setup(form, depth, act, conv):
    if form.startswith("nnx_"):
        return _setup_nnx(form, depth, act, conv)
    if form.startswith("lax_"):
        return _setup_lax(form, depth, act, conv)
    model = Net(form, depth, act)
    tok = jax.random.randint(jax.random.key(0), (B, T), 0, V)
    tgt = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    params = model.init(jax.random.key(2), tok)["params"]
    return _loss_fn(convert(model) if conv else model), params, tok, tgt


def _measure(form, depth, act, conv, donated=True):
    loss, params, tok, tgt = _setup(form, depth, act, conv)
    g = jax.grad(loss)
    c = compiled_memory(g, params, tok, tgt).total_bytes
    cd = (compiled_memory(g, params, tok, tgt, donate_argnums=(0,)).total_bytes if donated
          else 0)
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


FORMS = ["unrolled", "scan", "scan_remat", "nnx_unrolled", "nnx_scan", "lax_unrolled",
         "lax_scan"]
#: the unrolled twin of each scanned form (for the "scan vs unrolled" lines)
TWIN = {"scan": "unrolled", "nnx_scan": "nnx_unrolled", "lax_scan": "lax_unrolled"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2, help="L (slope from L and 2L)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per variant")
    ap.add_argument("--quick", action="store_true",
                    help="no donated figures, no scan_remat_names form")
    ap.add_argument("--acts", default="relu,gelu", help="comma-separated: relu,gelu")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    forms = FORMS + ([] if args.quick else ["scan_remat_names"])
    acts = args.acts.split(",")
    L = args.depth
    rows = []
    for act in acts:
        for form in forms:
            row = {"act": act, "form": form}
            for conv, who in ((False, "default"), (True, "jaxmem")):
                lo = _measure(form, L, act, conv, donated=not args.quick)
                hi = _measure(form, 2 * L, act, conv, donated=not args.quick)
                row[who] = {k: (hi[k] - lo[k]) / L for k in lo}
                row[who]["total_2L"] = hi["compiled"]
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
        "# Selective conversion under nn.scan / nnx.scan / lax.scan / nn.remat", "",
        f"Command: `{result['command']}`  ",
        f"Converted with `{ENTRY}`.  ",
        f"Environment: jax {env['jax']}, flax {env['flax']}, backend {env['backend']}, "
        f"python {env['python']}, {env['machine']}, {env['cpus']} CPUs.  ",
        f"Linen forms (`unrolled`, `scan`, `scan_remat`): Embed -> blocks (LN, causal "
        f"self-attention, LN, Dense 4d, act, Dense d) -> LN -> head. `nnx_*`: Linear -> blocks "
        f"(LN, Linear 4d, act, Linear d, residual) in an `nnx.List` or `nnx.vmap`-created and "
        f"`nnx.scan`-ned -> Linear. `lax_*`: the same Linen MLP block applied with per-layer "
        f"parameters in a Python loop or with stacked parameters in `jax.lax.scan`. Batch {B}, "
        f"time {T}, d_model {D}, heads {H}. Slope from depths {L} and {2 * L}: KiB per added "
        "layer. Compiled = temp + output + argument - alias of the jitted gradient "
        "(\"donated\": parameters donated; parameters and their gradients count in every "
        "slope). `total 2L`: compiled KiB at depth "
        f"{2 * L}. Time ratio: jaxmem/default, median step time, side by side.", "",
        "| act | form | residual default | residual jaxmem | ratio | compiled default | "
        "compiled jaxmem | ratio | donated default | donated jaxmem | ratio | total 2L "
        "default | total 2L jaxmem | ratio | time ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, j, q = r["default"], r["jaxmem"], r["ratio"]

        def f(k):
            if not d[k]:
                return "- | - | -"
            return f"{kib(d[k])} | {kib(j[k])} | " + (f"{q[k]:.3f}" if q[k] else "-")
        tot = (f"{kib(d['total_2L'])} | {kib(j['total_2L'])} | "
               f"{j['total_2L'] / d['total_2L']:.3f}")
        lines.append(f"| {r['act']} | {r['form']} | {f('residual')} | {f('compiled')} | "
                     f"{f('compiled_donated')} | {tot} | {r['time_ratio']:.2f} |")
    by = {(r["act"], r["form"]): r for r in rows}
    cmp = []
    for (act, form), r in by.items():
        twin = by.get((act, TWIN.get(form)))
        if twin is not None:
            a, b = twin["ratio"]["compiled"], r["ratio"]["compiled"]
            cmp.append(f"- {act} {form}: compiled slope ratio {b:.3f} vs {TWIN[form]} {a:.3f} "
                       f"({100 * (b - a):+.1f} points; target <= +5)")
    if cmp:
        lines += ["", "Scanned vs unrolled (per-layer compiled slope, jaxmem/default):", ""]
        lines += cmp
    (OUT / "scan.md").write_text("\n".join(lines) + "\n")
    print("wrote", OUT / "scan.md")


if __name__ == "__main__":
    main()
