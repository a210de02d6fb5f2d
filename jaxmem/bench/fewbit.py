"""`jaxmem bench` section for few-bit activation residuals (jaxmem.fewbit).

Measures, for the default activations and the few-bit ones (1-4 bits):

* frozen-weight GELU MLP: compiled bytes per added layer per hidden element (slope of two
  depths, gradient w.r.t. the input only) — target ``<= bits/8 B * 1.05``;
* GPT-2-style decoder (``jaxmem.models.GPT``, inline ``nn.gelu`` switched with
  ``jaxmem.scope(selective=False, fewbit=bits)``) and a tiny ViT (full training gradient
  w.r.t. all parameters): compiled bytes total and per layer, residual bytes, step-time
  ratio -- for the few-bit GELU alone, with the exact :func:`jaxmem.selective.attention`
  (``attention=True``; "fewbit only") and additionally with the selective layers
  (``jaxmem.linen.convert(model, fewbit=3)``; "combined");
* (full mode) PyTorch twins: bytes saved for backward, default vs ``torch_ref.fewbit``.

Memory is deterministic; times are ratios measured side by side (interleaved, median).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem import fewbit
from jaxmem.bench import Section
from jaxmem.bench.targets import (
    GemmLog,
    check_targets,
    grouped_columns,
    prefix,
    resolve_preset,
    target_meta,
    target_notes,
)
from jaxmem.measure import residual_bytes

COLUMNS = ["model", "method", "compiled_total", "compiled_per_layer", "per_layer_vs_default",
           "per_elem_per_layer", "residual", "step_time_ratio"]
#: the compiled-bytes columns, once per target (``h100_compiled_total``, ...)
COMPILED = ["compiled_total", "compiled_per_layer", "per_layer_vs_default", "per_elem_per_layer"]


def columns_for(targets=("cpu",)) -> list[str]:
    """:data:`COLUMNS` with the compiled columns once per target (GPU plans first) and the
    GEMM backend of each GPU plan (``h100_gemm``)."""
    targets = check_targets(targets)
    gemm = [f"{t}_gemm" for t in targets if t != "cpu"]
    return (["model", "method"] + grouped_columns(targets, COMPILED) + gemm
            + ["residual", "step_time_ratio"])


def _mlp(depth: int, h: int, act: Callable):
    ws = [jnp.asarray(np.random.default_rng(i).normal(size=(h, h)) / np.sqrt(h), jnp.float32)
          for i in range(depth)]

    def loss(x):
        for w in ws:
            x = act(x @ w)
        return jnp.sum(x)

    return loss


def mlp_rows(bits_list, b=128, h=512, depth=2, targets=("cpu",),
             log: GemmLog | None = None) -> list[dict]:
    """Frozen-weight GELU MLP: compiled bytes per added layer, per hidden element, on every
    target of ``targets``."""
    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    x = jnp.ones((b, h), jnp.float32)
    acts = {"jax default": lambda x: jax.nn.gelu(x, approximate=False)}
    for bits in bits_list:
        acts[f"fewbit {bits}-bit"] = (lambda k: lambda x: fewbit.gelu(x, bits=k))(bits)
    rows, base = [], {}
    for name, act in acts.items():
        row = {"model": f"GELU MLP frozen {b}x{h}", "method": name}
        for tgt in targets:
            pre, gemms = prefix(tgt), set()
            tot = {}
            for d in (depth, 2 * depth):
                cm = log.compiled(jax.grad(_mlp(d, h, act)), x, target=tgt,
                                  what=f"MLP depth {d} {name}")
                tot[d] = cm.total_bytes
                gemms.add(cm.gemm_backend)
            per = (tot[2 * depth] - tot[depth]) / depth
            base.setdefault(tgt, per)
            row.update({f"{pre}compiled_total": tot[2 * depth],
                        f"{pre}compiled_per_layer": per,
                        f"{pre}per_layer_vs_default": per / base[tgt],
                        f"{pre}per_elem_per_layer": per / (b * h)})
            if tgt != "cpu":
                row[f"{tgt}_gemm"] = "+".join(sorted(gemms))
        rows.append(row)
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


def _gpt(n_layer, quick, convert=None):
    from jaxmem.models import GPT, GPTConfig
    if quick:
        cfg = GPTConfig(vocab=128, ctx=64, d_model=64, n_head=2, n_layer=n_layer)
        batch = 4
    else:
        cfg = GPTConfig(vocab=256, ctx=128, d_model=128, n_head=4, n_layer=n_layer)
        batch = 8
    model = GPT(cfg)
    if convert is not None:  # options of jaxmem.linen.convert
        model = jaxmem.linen.convert(model, **convert)
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, cfg.ctx)))
    params = model.init(jax.random.PRNGKey(0), tok)

    def loss(p, tok):
        logits = model.apply(p, tok[:, :-1])
        lp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(lp, tok[:, 1:, None], -1))

    hidden = batch * (cfg.ctx - 1) * cfg.mlp_ratio * cfg.d_model
    return loss, params, tok, hidden


def _vit(n_layer, quick, convert=None):
    from jaxmem.models import ViT, ViTConfig
    cfg = ViTConfig(image_size=32, patch_size=4, d_model=64 if quick else 96, n_head=2,
                    n_layer=n_layer, num_classes=10)
    model = ViT(cfg)
    if convert is not None:  # options of jaxmem.linen.convert
        model = jaxmem.linen.convert(model, **convert)
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


#: (label, GELU bits or None, exact attention, selective layers (jaxmem.linen.convert))
def methods(bits_list, quick: bool = False, attention_row: bool | None = None
            ) -> list[tuple[str, int | None, bool, bool]]:
    out = [("jax default", None, False, False)]
    out += [(f"fewbit {b}-bit GELU", b, False, False) for b in bits_list]
    if (not quick) if attention_row is None else attention_row:
        out += [("jax default + selective.attention", None, True, False)]
    out += [("fewbit only: 3-bit GELU + selective.attention", 3, True, False),
            ("combined: 3-bit GELU + selective.attention + linen.convert", 3, True, True)]
    return out


def _patched(bits, attn):
    """Few-bit GELU (the models' one smooth activation) and / or exact attention."""
    from jaxmem._glue import options as _options
    from jaxmem.linen import scope_options  # the Linen calls traced inside, converted

    return scope_options(_options.Options(selective=False, fewbit=bits, attention=attn),
                         label="jaxmem bench fewbit")


def _total_bytes(compiled) -> int:
    """temp + output + argument - alias of a compiled function (as ``compiled_memory``)."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
               - m.alias_size_in_bytes)


def model_rows(name: str, make, depth: int, bits_list, quick: bool, reps: int,
               targets=("cpu",), log: GemmLog | None = None,
               attention_row: bool | None = None) -> list[dict]:
    """Full training gradient (all parameters) of a transformer with inline nn.gelu; compiled
    bytes on every target of ``targets``, residual bytes and the CPU step-time ratio once.
    ``quick`` picks the small model config (and, unless ``attention_row`` says otherwise,
    leaves out the "jax default + selective.attention" row)."""
    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    rows, fns, args = [], {}, {}
    base: dict[str, float] = {}
    for label, bits, attn, sel in methods(bits_list, quick, attention_row):
        meas: dict[tuple[str, int], int] = {}
        resid, gemms = {}, {t: set() for t in targets}
        for L in (depth, 2 * depth):
            conv = {"fewbit": bits, "attention": attn} if sel else None
            loss, params, data, hidden = make(L, quick, convert=conv)
            grad = jax.grad(loss)
            with _patched(bits, attn):
                for tgt in targets:
                    if tgt == "cpu" and L == 2 * depth:
                        # one compile serves the memory figure and the timing
                        fns[label] = jax.jit(grad).lower(params, data).compile()
                        args[label] = (params, data)
                        meas[(tgt, L)] = _total_bytes(fns[label])
                    else:
                        cm = log.compiled(grad, params, data, target=tgt,
                                          what=f"{name} L={L} {label}")
                        meas[(tgt, L)] = cm.total_bytes
                        gemms[tgt].add(cm.gemm_backend)
                resid[L] = residual_bytes(loss, params, data).activation_bytes
        row = {"model": f"{name} L={2 * depth}", "method": label, "residual": resid[2 * depth]}
        for tgt in targets:
            pre = prefix(tgt)
            per = (meas[(tgt, 2 * depth)] - meas[(tgt, depth)]) / depth
            base.setdefault(tgt, per)
            row.update({f"{pre}compiled_total": meas[(tgt, 2 * depth)],
                        f"{pre}compiled_per_layer": per,
                        f"{pre}per_layer_vs_default": per / base[tgt],
                        f"{pre}per_elem_per_layer": per / hidden})
            if tgt != "cpu":
                row[f"{tgt}_gemm"] = "+".join(sorted(gemms[tgt]))
        rows.append(row)
    if fns:
        ratios = _time_ratio(fns, args, reps)
        for r in rows:
            r["step_time_ratio"] = ratios[r["method"]]
    return rows


def torch_rows(kind: str = "gpt", bits: int = 3, reps: int = 15) -> list[dict]:
    """PyTorch twin (GPT or ViT): bytes saved for backward, default vs torch_ref.fewbit."""
    import torch

    import torch_ref.fewbit as tfb
    from torch_ref import models as tm
    from torch_ref.measure import saved_bytes

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


#: per preset: parts run, GELU bits, MLP (batch, hidden), small transformer configs, depth
#: (the slope is taken between ``depth`` and ``2 * depth`` layers), the "jax default +
#: selective.attention" row, timing repeats
PRESET_SIZES = {
    "quick": {"parts": ("mlp", "gpt"), "bits": (3,), "mlp": (64, 256), "small": True,
              "depth": 1, "attention_row": False, "reps": 5},
    "default": {"parts": ("mlp", "gpt"), "bits": (3,), "mlp": (128, 512), "small": False,
                "depth": 1, "attention_row": False, "reps": 5},
    "full": {"parts": ("mlp", "gpt", "vit", "torch"), "bits": (1, 2, 3, 4), "mlp": (128, 512),
             "small": False, "depth": 2, "attention_row": True, "reps": 15},
}


def run(quick: bool = False, models: list[str] | None = None,
        progress: Callable[[str], None] | None = None, *, preset: str | None = None,
        targets=("cpu",)) -> Section:
    """Few-bit section, compiled bytes on every target of ``targets``.

    ``models``: subset of ``["mlp", "gpt", "vit", "torch"]``. ``preset`` (default:
    ``"quick"`` if ``quick`` else ``"full"``; :data:`PRESET_SIZES`):

    * ``"quick"``: MLP 64x256 and a small GPT (d=64, ctx 64, L=1/2) at 3 bits;
    * ``"default"`` (``jaxmem bench``): MLP 128x512 and the GPT of the full run (d=128,
      ctx 128, batch 8) at 1 and 2 layers, 3 bits;
    * ``"full"`` (``jaxmem bench --full``): 1-4 bits, GPT, ViT and the PyTorch twins.
    """
    say = progress or (lambda s: None)
    preset = resolve_preset(quick, preset)
    targets = check_targets(targets)
    P = PRESET_SIZES[preset]
    log = GemmLog()
    want = set(models or P["parts"])
    bits_list = list(P["bits"])
    small, depth = P["small"], P["depth"]
    rows: list[dict] = []
    if "mlp" in want:
        say("fewbit: frozen GELU MLP slope")
        rows += mlp_rows(bits_list, b=P["mlp"][0], h=P["mlp"][1], targets=targets, log=log)
    if "gpt" in want:
        say("fewbit: GPT")
        rows += model_rows("GPT", _gpt, depth, bits_list, small, P["reps"], targets=targets,
                           log=log, attention_row=P["attention_row"])
    if "vit" in want:
        say("fewbit: ViT")
        rows += model_rows("ViT", _vit, depth, bits_list, small, P["reps"], targets=targets,
                           log=log, attention_row=P["attention_row"])
    if "torch" in want:
        say("fewbit: torch twin")
        try:
            rows += torch_rows("gpt") + torch_rows("vit")
        except ImportError as e:  # torch is optional
            say(f"fewbit: torch rows skipped ({e})")
    columns = columns_for(targets)
    units = {"residual": "B", "step_time_ratio": "x"}
    for t in targets:
        units.update({f"{prefix(t)}compiled_total": "B", f"{prefix(t)}compiled_per_layer": "B",
                      f"{prefix(t)}per_layer_vs_default": "x"})
    flag = {"quick": " --quick", "default": "", "full": " --full"}[preset]
    return Section(
        name="fewbit",
        title="Few-bit activation residuals (jaxmem.fewbit)",
        columns=columns,
        rows=rows,
        units=units,
        notes=[
            "compiled_* = XLA memory_analysis temp+output+argument-alias of jit(grad); "
            "per_layer = slope between depth L/2 and L.",
            "MLP: frozen weights, gradient w.r.t. the input only; per_elem_per_layer in bytes "
            "per hidden element (target <= bits/8 * 1.05).",
            "GPT/ViT: gradient w.r.t. all parameters; inline nn.gelu switched by "
            "jaxmem.scope(selective=False, fewbit=bits); residual = activation residual "
            "bytes (jaxmem.measure.residual_bytes) at depth L.",
            "selective.attention (jaxmem.scope(attention=True)): exact, "
            "flash-style backward (stores q, k, v and a log-sum-exp, recomputes the "
            "probabilities); linen.convert: jaxmem.linen.convert(model, fewbit=3) (the "
            "selective layers too; LayerNorm keeps its input + statistics). Only the GELU "
            "derivative is approximate in every row.",
            "step_time_ratio: median of interleaved per-step ratios vs the default, CPU.",
            "torch rows: bytes saved for backward (torch_ref.measure.saved_bytes); "
            "per_layer_vs_default from depths 2 and 4.",
            f"preset {preset}: {', '.join(p for p in P['parts'] if p in want)}; bits "
            f"{', '.join(map(str, bits_list))}; MLP {P['mlp'][0]}x{P['mlp'][1]}; "
            + ("small GPT (d=64, ctx 64, batch 4)" if small
               else "GPT d=128, ctx 128, 4 heads, batch 8")
            + f", {depth} and {2 * depth} layers; {P['reps']} timing repeats.",
            *target_notes(targets, log, cpu_only="step-time ratios"),
            *([f"{t}_gemm: GEMM backend of that row's {t} plan compiles (gemm='auto': "
               "XLA's Triton GEMMs, cuBLAS where XLA finds no Triton tiling without "
               "autotuning, as for the zoo GPT)." for t in targets if t != "cpu"]),
        ],
        meta={"quick": preset == "quick", "preset": preset, "bits": bits_list,
              "command": f"jaxmem bench --sections fewbit{flag} --target {','.join(targets)}",
              **target_meta(targets, log)},
    )
