"""`jaxmem bench` section for few-bit activation residuals (jaxmem.fewbit).

Measures, for the default activations and the few-bit ones (1-4 bits):

* frozen-weight GELU MLP: compiled bytes per added layer per hidden element (slope of two
  depths, gradient w.r.t. the input only) — target ``<= bits/8 B * 1.05``;
* GPT-2-style decoder (``jaxmem.models.GPT``, inline ``nn.gelu`` switched with
  :func:`jaxmem.fewbit.patch_activations`) and a tiny ViT (full training gradient w.r.t. all
  parameters): compiled bytes total and per layer, residual bytes, step-time ratio -- for the
  few-bit GELU alone, with the exact :func:`jaxmem.fewbit.attention` (``patch_attention``;
  "fewbit only") and additionally with ``jaxmem.selective.linen.convert`` ("combined");
* (full mode) PyTorch twins: bytes saved for backward, default vs ``torch_ref.fewbit``.

Memory is deterministic; times are ratios measured side by side (interleaved, median).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import fewbit
from jaxmem.bench import Section
from jaxmem.measure import compiled_memory, residual_bytes

COLUMNS = ["model", "method", "compiled_total", "compiled_per_layer", "per_layer_vs_default",
           "per_elem_per_layer", "residual", "step_time_ratio"]


def _mlp(depth: int, h: int, act: Callable):
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h), jnp.float32)
          for i in range(depth)]

    def loss(x):
        for w in ws:
            x = act(x @ w)
        return jnp.sum(x)

    return loss


def mlp_rows(bits_list, b=128, h=512, depth=2) -> list[dict]:
    """Frozen-weight GELU MLP: compiled bytes per added layer, per hidden element."""
    x = jnp.ones((b, h), jnp.float32)
    acts = {"jax default": lambda x: jax.nn.gelu(x, approximate=False)}
    for bits in bits_list:
        acts[f"fewbit {bits}-bit"] = (lambda k: lambda x: fewbit.gelu(x, bits=k))(bits)
    rows, base = [], None
    for name, act in acts.items():
        lo = compiled_memory(jax.grad(_mlp(depth, h, act)), x).total_bytes
        hi = compiled_memory(jax.grad(_mlp(2 * depth, h, act)), x).total_bytes
        per = (hi - lo) / depth
        base = per if base is None else base
        rows.append({"model": f"GELU MLP frozen {b}x{h}", "method": name, "compiled_total": hi,
                     "compiled_per_layer": per, "per_layer_vs_default": per / base,
                     "per_elem_per_layer": per / (b * h)})
    return rows


def _time_ratio(fns: dict[str, Callable], args, reps: int) -> dict[str, float]:
    """Median over interleaved repetitions of t(fn) / t(first fn).

    ``args``: one argument tuple for all, or a dict ``name -> tuple``.
    """
    def a(k):
        return args[k] if isinstance(args, dict) else args

    for k, f in fns.items():
        jax.block_until_ready(f(*a(k)))
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*a(k)))
            times[k].append(time.perf_counter() - t)
    first = next(iter(fns))
    ratios = {}
    for k in fns:
        r = np.array(times[k]) / np.array(times[first])
        ratios[k] = float(np.median(r))
    return ratios


def _gpt(n_layer, quick, selective=False):
    from jaxmem.models import GPT, GPTConfig
    if quick:
        cfg = GPTConfig(vocab=128, ctx=64, d_model=64, n_head=2, n_layer=n_layer)
        batch = 4
    else:
        cfg = GPTConfig(vocab=256, ctx=128, d_model=128, n_head=4, n_layer=n_layer)
        batch = 8
    model = GPT(cfg)
    if selective:
        from jaxmem.selective import linen as sel_linen
        model = sel_linen.convert(model)
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, cfg.ctx)))
    params = model.init(jax.random.PRNGKey(0), tok)

    def loss(p, tok):
        logits = model.apply(p, tok[:, :-1])
        lp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(lp, tok[:, 1:, None], -1))

    hidden = batch * (cfg.ctx - 1) * cfg.mlp_ratio * cfg.d_model
    return loss, params, tok, hidden


def _vit(n_layer, quick, selective=False):
    from jaxmem.models import ViT, ViTConfig
    cfg = ViTConfig(image_size=32, patch_size=4, d_model=64 if quick else 96, n_head=2,
                    n_layer=n_layer, num_classes=10)
    model = ViT(cfg)
    if selective:
        from jaxmem.selective import linen as sel_linen
        model = sel_linen.convert(model)
    batch = 4 if quick else 16
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 32, 32, 3)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).integers(0, 10, (batch,)))
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p, data):
        x, y = data
        lp = jax.nn.log_softmax(model.apply(p, x))
        return -jnp.mean(jnp.take_along_axis(lp, y[:, None], -1))

    hidden = batch * (cfg.n_patches + 1) * cfg.mlp_ratio * cfg.d_model
    return loss, params, (x, y), hidden


#: (label, GELU bits or None, exact fewbit.attention, jaxmem.selective.linen.convert)
def methods(bits_list, quick: bool = False) -> list[tuple[str, int | None, bool, bool]]:
    out = [("jax default", None, False, False)]
    out += [(f"fewbit {b}-bit GELU", b, False, False) for b in bits_list]
    if not quick:
        out += [("jax default + fewbit.attention", None, True, False)]
    out += [("fewbit only: 3-bit GELU + fewbit.attention", 3, True, False),
            ("combined: 3-bit GELU + fewbit.attention + selective.convert", 3, True, True)]
    return out


@contextlib.contextmanager
def _patched(bits, attn):
    with contextlib.ExitStack() as st:
        if bits is not None:
            st.enter_context(fewbit.patch_activations(bits=bits, activations=["gelu"]))
        if attn:
            st.enter_context(fewbit.patch_attention())
        yield


def _total_bytes(compiled) -> int:
    """temp + output + argument - alias of a compiled function (as ``compiled_memory``)."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
               - m.alias_size_in_bytes)


def model_rows(name: str, make, depth: int, bits_list, quick: bool, reps: int) -> list[dict]:
    """Full training gradient (all parameters) of a transformer with inline nn.gelu."""
    rows, fns, args = [], {}, {}
    base = None
    for label, bits, attn, sel in methods(bits_list, quick):
        meas = {}
        for L in (depth, 2 * depth):
            loss, params, data, hidden = make(L, quick, selective=sel)
            grad = jax.grad(loss)
            with _patched(bits, attn):
                if L == 2 * depth:  # one compile serves the memory figure and the timing
                    fns[label] = jax.jit(grad).lower(params, data).compile()
                    args[label] = (params, data)
                    total = _total_bytes(fns[label])
                else:
                    total = compiled_memory(grad, params, data).total_bytes
                meas[L] = (total, residual_bytes(loss, params, data).activation_bytes)
        per = (meas[2 * depth][0] - meas[depth][0]) / depth
        base = per if base is None else base
        rows.append({"model": f"{name} L={2 * depth}", "method": label,
                     "compiled_total": meas[2 * depth][0], "compiled_per_layer": per,
                     "per_layer_vs_default": per / base,
                     "per_elem_per_layer": per / hidden,
                     "residual": meas[2 * depth][1]})
    ratios = _time_ratio(fns, args, reps)
    for r in rows:
        r["step_time_ratio"] = ratios[r["method"]]
    return rows


def torch_rows(kind: str = "gpt", bits: int = 3, reps: int = 15) -> list[dict]:
    """PyTorch twin (GPT or ViT): bytes saved for backward, default vs torch_ref.fewbit."""
    import torch

    import torch_ref.fewbit as tfb
    from torch_ref.measure import saved_bytes
    from torch_ref import models as tm

    def build(L, convert):
        torch.manual_seed(0)
        if kind == "gpt":
            m = tm.GPT(tm.GPTConfig(vocab=256, ctx=128, d_model=128, n_head=4, n_layer=L))
        else:
            m = tm.ViT(tm.ViTConfig(image_size=32, patch_size=4, d_model=96, n_head=2,
                                    n_layer=L, num_classes=10))
        if convert:
            tfb.convert(m, bits=bits)
        return m

    if kind == "gpt":
        tok = torch.randint(0, 256, (8, 127))

        def loss(m):
            return torch.nn.functional.cross_entropy(m(tok).flatten(0, 1), tok.flatten())
    else:
        img, lab = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

        def loss(m):
            return torch.nn.functional.cross_entropy(m(img), lab)

    rows, base = [], None
    title = "GPT" if kind == "gpt" else "ViT"
    for label, conv in (("torch default", False), (f"torch_ref.fewbit {bits}-bit", True)):
        s = {L: saved_bytes(lambda L=L, conv=conv: loss(build(L, conv))).total_bytes
             for L in (2, 4)}
        per = (s[4] - s[2]) / 2
        base = per if base is None else base
        rows.append({"model": f"{title} (torch twin) L=4", "method": label, "residual": s[4],
                     "compiled_per_layer": None, "per_layer_vs_default": per / base,
                     "saved_per_layer": per})
    m0, m1 = build(4, False), build(4, True)
    ts = {0: [], 1: []}
    for _ in range(reps):
        for k, m in ((0, m0), (1, m1)):
            t = time.perf_counter()
            loss(m).backward()
            ts[k].append(time.perf_counter() - t)
    ratio = float(np.median(np.array(ts[1]) / np.array(ts[0])))
    rows[0]["step_time_ratio"], rows[1]["step_time_ratio"] = 1.0, ratio
    return rows


def run(quick: bool = False, models: list[str] | None = None,
        progress: Callable[[str], None] | None = None) -> Section:
    """Few-bit section. ``models``: subset of ``["mlp", "gpt", "vit", "torch"]``."""
    say = progress or (lambda s: None)
    want = set(models or (["mlp", "gpt"] if quick else ["mlp", "gpt", "vit", "torch"]))
    bits_list = [3] if quick else [1, 2, 3, 4]
    rows: list[dict] = []
    if "mlp" in want:
        say("fewbit: frozen GELU MLP slope")
        rows += mlp_rows([3] if quick else [1, 2, 3, 4], b=64 if quick else 128,
                         h=256 if quick else 512)
    if "gpt" in want:
        say("fewbit: GPT")
        rows += model_rows("GPT", _gpt, 1 if quick else 2, bits_list, quick, 5 if quick else 15)
    if "vit" in want:
        say("fewbit: ViT")
        rows += model_rows("ViT", _vit, 1 if quick else 2, bits_list, quick, 5 if quick else 15)
    if "torch" in want:
        say("fewbit: torch twin")
        try:
            rows += torch_rows("gpt") + torch_rows("vit")
        except ImportError as e:  # torch is optional
            say(f"fewbit: torch rows skipped ({e})")
    return Section(
        name="fewbit",
        title="Few-bit activation residuals (jaxmem.fewbit)",
        columns=COLUMNS,
        rows=rows,
        units={"compiled_total": "B", "compiled_per_layer": "B", "residual": "B",
               "per_layer_vs_default": "x", "step_time_ratio": "x"},
        notes=[
            "compiled_* = XLA memory_analysis temp+output+argument-alias of jit(grad); "
            "per_layer = slope between depth L/2 and L.",
            "MLP: frozen weights, gradient w.r.t. the input only; per_elem_per_layer in bytes "
            "per hidden element (target <= bits/8 * 1.05).",
            "GPT/ViT: gradient w.r.t. all parameters; inline nn.gelu switched by "
            "fewbit.patch_activations(activations=['gelu']); residual = activation residual "
            "bytes (jaxmem.measure.residual_bytes) at depth L.",
            "fewbit.attention (via fewbit.patch_attention): exact attention, flash-style "
            "backward (stores q, k, v and a log-sum-exp, recomputes the probabilities); "
            "selective.convert: jaxmem.selective's Linen drop-in (LayerNorm keeps its input "
            "+ statistics). Only the GELU derivative is approximate in every row.",
            "step_time_ratio: median of interleaved per-step ratios vs the default, CPU.",
            "torch rows: bytes saved for backward (torch_ref.measure.saved_bytes); "
            "per_layer_vs_default from depths 2 and 4.",
        ],
        meta={"quick": quick, "bits": bits_list, "jax": jax.__version__,
              "command": "jaxmem bench --sections fewbit" + (" --quick" if quick else "")},
    )
