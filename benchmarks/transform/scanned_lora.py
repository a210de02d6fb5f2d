"""LoRA fine-tuning of a Linen MLP stack, unrolled and under ``nn.scan``, with
``jaxmem.transform``: stored residuals, compiled temp on XLA:CPU and the H100 plan, CPU step
time.

The stack: ``L = 4`` pre-norm blocks ``x + LoRADense(d)(gelu(LoRADense(4d)(LN(x))))``, d 256,
rank 4, 512 tokens; a ``LoRADense`` merges its adapter into the frozen kernel where it is
called, ``x @ (W + A @ B / r)``, as Linen LoRA code usually does. Only the adapters are
differentiated (``jax.value_and_grad`` w.r.t. ``A, B``; ``W``, the norms and the batch are
frozen arguments). Unrolled, the merged weight is computed from the function's inputs and
``transform`` recomputes it in the backward pass (``computed_weights``); under ``nn.scan`` it
is made in the body from the layer's slices, and the converted body runs under the scan policy
(:mod:`jaxmem.transform.scan_policy`), which recomputes it instead of stacking it. Untouched,
autodiff keeps every merged weight (stacked under the scan).

Step time: median over ``REPEATS`` (7) interleaved rounds of the jitted step, as a ratio to the
untouched step of the same form (XLA:CPU; no GPU here).

Run:  .venv/bin/python benchmarks/transform/scanned_lora.py [--out benchmarks/results/transform]
"""
from __future__ import annotations

import sys

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.bench.fewbit import _time_ratio
from jaxmem.measure import compiled_memory, residual_bytes

D, FF, RANK, LAYERS, TOKENS, REPEATS = 256, 1024, 4, 4, 512, 7
MiB = 2.0 ** 20


class LoRADense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        a = self.param("lora_a", nn.initializers.normal(0.02), (x.shape[-1], RANK))
        b = self.param("lora_b", nn.initializers.normal(0.02), (RANK, self.features))
        return x @ (w + a @ b / RANK)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = LoRADense(D)(nn.gelu(LoRADense(FF)(nn.LayerNorm()(h))))
        return h + y, None


class Stack(nn.Module):
    scan: bool

    @nn.compact
    def __call__(self, x):
        if self.scan:
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=LAYERS)()(x, None)
        else:
            for _ in range(LAYERS):
                x, _ = Block()(x, None)
        return x


def _case(scan: bool):
    """``(loss(adapters, frozen, x), adapters, frozen, x)`` for the stack."""
    model = Stack(scan)
    x = jax.random.normal(jax.random.key(1), (TOKENS, D))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        model.init(jax.random.key(0), x)["params"])
    is_adapter = ["lora_" in jax.tree_util.keystr(k) for k, _ in leaves]
    adapters = [v for (_, v), a in zip(leaves, is_adapter) if a]
    frozen = [v for (_, v), a in zip(leaves, is_adapter) if not a]

    def loss(adapters, frozen, x):
        ia, jf = iter(adapters), iter(frozen)
        params = treedef.unflatten([next(ia) if a else next(jf) for a in is_adapter])
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    return loss, adapters, frozen, x


def run(targets):
    rows = []
    for scan in (False, True):
        loss, adapters, frozen, x = _case(scan)
        variants = {"default": loss, "transform": jaxmem.transform(loss)}
        steps = {k: jax.value_and_grad(f) for k, f in variants.items()}
        for name, f in variants.items():
            row = {"form": "nn.scan" if scan else "unrolled", "variant": name,
                   "residual_mib": residual_bytes(f, adapters, frozen, x).activation_bytes / MiB}
            for target in targets:
                row[f"temp_{target}_mib"] = compiled_memory(
                    steps[name], adapters, frozen, x, target=target).temp_bytes / MiB
            rows.append(row)
        rows[-1]["cpu_step_ratio"] = _time_ratio(
            {k: jax.jit(s) for k, s in steps.items()}, (adapters, frozen, x), REPEATS)["transform"]
    return rows


def markdown(rows, targets):
    head = (["form", "variant", "residuals MiB"]
            + [f"compiled temp {t} MiB (x default)" for t in targets] + ["CPU step (x default)"])
    out = ["# LoRA on a Linen stack, unrolled and under `nn.scan`, with `jaxmem.transform`", "",
           ("Regenerate: `.venv/bin/python benchmarks/transform/scanned_lora.py --out "
            "benchmarks/results/transform`."), "",
           (f"{LAYERS} blocks, d {D}, MLP {FF}, rank {RANK}, {TOKENS} tokens; "
            "`value_and_grad` w.r.t. the adapters only; each merged weight is 1 MiB. Step "
            f"time: XLA:CPU, median of {REPEATS} interleaved rounds."), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = next(b for b in rows if b["form"] == r["form"] and b["variant"] == "default")
        temps = [f"{r[f'temp_{t}_mib']:.2f} ({r[f'temp_{t}_mib'] / base[f'temp_{t}_mib']:.2f}x)"
                 for t in targets]
        step = f"{r['cpu_step_ratio']:.2f}x" if "cpu_step_ratio" in r else "1.00x"
        out.append(f"| {r['form']} | {r['variant']} | {r['residual_mib']:.2f} | "
                   + " | ".join(temps) + f" | {step} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    return _cli.main(__doc__, run, markdown, "scanned_lora", argv)


if __name__ == "__main__":
    sys.exit(main())
