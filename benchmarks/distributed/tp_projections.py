"""Tensor parallel steps: ``q, k, v`` recomputed from the norm's residuals, per device.

``jaxmem.transform(..., projections=True)`` (the default) lets an attention keep its
LayerNorm's residuals and the projection weights instead of ``q, k, v``, and recompute the
projections in its backward pass. Under tensor parallelism (a 4 x 2 ``('data', 'model')``
mesh, Megatron rules: query / key / value kernels split by output features) each device
holds its heads' columns, so the recomputation needs no collective -- unless the projection
is one fused product split three ways (GPT-2's ``c_attn``), whose split moves columns
between devices: that one is kept unless the step allows the collectives to run again
(``train_step(..., repeat_collectives=True)``).

For each model, one SGD step compiled (never run) per variant: JAX default (the model as
written), ``transform(loss, projections=False)``, ``transform(loss)`` and ``transform(loss)``
with ``repeat_collectives=True``; per-device ``temp`` (MiB, XLA ``memory_analysis``) and the
collectives of the compiled step (count, result bytes per device).

    .venv/bin/python benchmarks/distributed/tp_projections.py [--target h100,cpu]

Targets: ``h100`` = XLA:GPU's plan for 8 x H100 compiled here without a GPU (no autotuning:
``temp`` is a lower bound), ``cpu`` = XLA:CPU on 8 host devices. Results:
``benchmarks/results/distributed/tp_projections.{md,json}``.
"""
from __future__ import annotations

import time

import _tp_step  # first: re-executes this script with 8 host CPU devices
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmem
from jaxmem.models import gpt

BATCH = 16
#: variant -> (transform the loss?, projections, repeat_collectives)
VARIANTS = {"default": (False, True, False), "projections=False": (True, False, False),
            "jaxmem": (True, True, False), "jaxmem, repeat_collectives": (True, True, True)}


class Attention(nn.Module):
    """LayerNorm, attention over ``q, k, v`` projections of it (three Dense layers, or one
    fused Dense split three ways), output Dense, residual add."""

    d: int
    heads: int
    fused: bool

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        if self.fused:
            q, k, v = jnp.split(nn.Dense(3 * self.d, use_bias=False, name="c_attn")(h), 3, -1)
        else:
            q, k, v = (nn.Dense(self.d, use_bias=False, name=n)(h)
                       for n in ("query", "key", "value"))
        q, k, v = (a.reshape(*a.shape[:-1], self.heads, -1) for a in (q, k, v))
        o = jax.nn.dot_product_attention(q, k, v).reshape(x.shape)
        return x + nn.Dense(self.d, use_bias=False, name="out")(o)


class FlaxBlock(nn.Module):
    """A pre-LN transformer block written with Flax's ``MultiHeadDotProductAttention``
    (separate ``query`` / ``key`` / ``value`` DenseGeneral projections) and a GELU MLP."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h)
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * self.d, name="fc1")(h))
        return x + nn.Dense(self.d, name="fc2")(h)


def _regression(model, tokens, d):
    x = jax.ShapeDtypeStruct((BATCH, tokens, d), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    return loss, params, (x, x)


def _gpt():
    model = gpt(vocab=512, ctx=128, d_model=256, n_head=4, n_layer=4)
    tok = jax.ShapeDtypeStruct((BATCH, 128), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tok)["params"]

    def loss(p, batch):
        logits = model.apply({"params": p}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return loss, params, (tok, tok)


CASES = {
    "Flax MHA + MLP blocks (4L, d256, 16x128 tokens)":
        lambda: _regression(nn.Sequential([FlaxBlock(256, 4) for _ in range(4)]), 128, 256),
    "attention blocks, three projections (4L, d128, 16x128 tokens)":
        lambda: _regression(nn.Sequential([Attention(128, 4, False) for _ in range(4)]),
                            128, 128),
    "attention blocks, three projections (3L, d128, 16x256 tokens)":
        lambda: _regression(nn.Sequential([Attention(128, 4, False) for _ in range(3)]),
                            256, 128),
    "GPT zoo, fused c_attn (4L, d256, 16x128 tokens)": _gpt,
}


def measure(loss, params, batch, target, variant):
    transformed, projections, repeat = VARIANTS[variant]
    fn = jaxmem.transform(loss, projections=projections) if transformed else loss
    return _tp_step.measure(fn, params, batch, target, repeat_collectives=repeat)


def markdown(rows, meta):
    out = ["# Tensor parallel steps: q, k, v recomputed from the norm's residuals", "",
           (f"Regenerate with `{meta['command']}` (jax {meta['jax']}; compiled only, never "
           f"run; {meta['seconds']:.0f} s)."), "",
           ("One SGD step under TP (4 x 2 `('data', 'model')` mesh, Megatron rules: `query` / "
           "`key` / `value` / `c_attn` kernels split by output features, `out` / `fc2` by "
           "input features), per-device `temp` MiB and saving against JAX default; "
           "collectives per device (count, MB of results). `projections=False`: "
           "`jaxmem.transform(loss, projections=False)` (`q, k, v` kept); `jaxmem`: "
           "`jaxmem.transform(loss)` (`q, k, v` recomputed where each device holds its "
           "heads' projection columns); `repeat_collectives`: the same with "
           "`train_step(..., repeat_collectives=True)` (a fused projection split three ways "
           "recomputed too, its split's collective-permutes run again)."), "",
           ("H100 plan: XLA:GPU's plan for 8 x H100 compiled without a GPU (no autotuning: "
           "`temp` is a lower bound). CPU: XLA:CPU on 8 host devices."), ""]
    for target in meta["targets"]:
        out += [f"## {'8 x H100 plan' if target != 'cpu' else '8 host CPU devices'}", "",
                ("| model | variant | temp MiB (saving) | collectives | collective MB | "
                "collective-permutes |"), "|---|---|---|---|---|---|"]
        for r in rows:
            res = r["targets"][target]
            base = res["default"]["temp"]
            for v in VARIANTS:
                m = res[v]
                sv = "" if v == "default" else f" ({100 * (1 - m['temp'] / base):.1f}%)"
                out.append(f"| {r['model']} | {v} | {m['temp'] / 2**20:.2f}{sv} | "
                           f"{_tp_step.collective_cells(m)} | "
                           f"{m['collectives']['collective-permute']} |")
        out.append("")
    return "\n".join(out)


def main():
    targets, out = _tp_step.arguments(__doc__.split("\n\n")[0])
    t0 = time.time()
    rows = []
    for name, case in CASES.items():
        loss, params, batch = case()
        row = {"model": name, "targets": {}}
        for target in targets:
            row["targets"][target] = {v: measure(loss, params, batch, target, v)
                                      for v in VARIANTS}
            print(name, target, {v: round(m["temp"] / 2**20, 2)
                                 for v, m in row["targets"][target].items()}, flush=True)
        rows.append(row)
    meta = {"jax": jax.__version__, "targets": targets, "seconds": time.time() - t0,
            "command": _tp_step.command("tp_projections.py", targets)}
    _tp_step.write(out, "tp_projections", meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
