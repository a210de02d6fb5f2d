"""Step time and allocator peak of JAX default vs each jaxmem technique on a real GPU.

Command (on a machine with a GPU; see benchmarks/gpu/run_suite.sh, stage STEPS=1):
    python benchmarks/gpu/step_times.py all OUTDIR [--small] [--groups a,b] [--jobs 6]
        [--dump a,b]   # also XLA's buffer assignment / live ranges of those groups
    python benchmarks/gpu/step_times.py plan OUT.json [--small] [--target h200]  # no GPU
    python benchmarks/gpu/step_times.py md RESULT.json [PLAN.json] > OUT.md

A *group* is one comparison: the same arguments, a baseline (what a user writes without
jaxmem) and one or more jaxmem variants of the same computation. ``all`` runs every group in
two stages:

1. compile (one process per group, ``--jobs`` at a time): every variant is compiled, with
   autotuning, into JAX's persistent compilation cache; XLA's memory plan of the real device
   (temp / output / argument / alias bytes) is recorded;
2. run (one process per group, one group at a time, nothing else on the GPU): the variants are
   loaded from the cache (no autotuning, so no autotuner scratch in the allocator's counters),
   in increasing order of planned bytes. For each variant: ``bytes_in_use`` before the step,
   one step, then the allocator's ``peak_bytes_in_use``; the step's peak above what was live
   before it (its arguments and the earlier variants' kept arguments) is reported when the
   step raised the high-water mark, else as an upper bound ("<="). Then ``--rounds`` rounds of
   one step of each variant in turn (after two warm-up steps each); the median per variant and
   its ratio to the baseline's median.

``plan`` compiles the same variants for XLA:GPU's plan of ``--target`` (default ``h100``)
without a GPU (``jaxmem.measure.compiled_memory(..., target=...)``; cuDNN attention
variants included), to set the compile-only plan beside the real device's plan and its
allocator peak.

Groups (``--small``: tiny sizes, for checking the script on a CPU):

* ``sel_r50_{input,norm,all}``: ResNet-50 (width 1, 1000 classes), batch 32, 224x224, BatchNorm
  in train mode; gradient of what the case trains (``jaxmem.bench.selective.make_step``);
  baseline JAX default, variants ``jaxmem.linen.convert(model, attention=False)`` and the same
  with ``conv_recompute=False`` ("conv kept": less recomputation, more bytes).
* ``gpt_block_{bf16,f32}``: four GPT-2 blocks in plain JAX (batch 8, ctx 1024, d 768, 12
  heads; ``benchmarks/fewbit/gpt_block_gpu_plan.py``), gradient of all parameters; einsum
  attention untouched (baseline), under ``jaxmem.transform`` (exact) and
  ``jaxmem.transform(fewbit=3)``; bf16 adds cuDNN flash attention
  (``jax.nn.dot_product_attention(implementation="cudnn")``), untouched and with fewbit=3.
* ``gpt_linen``: ``jaxmem.models.GPT`` (4 layers, d 768, ctx 1024, vocab 8192, batch 8), jitted
  AdamW step with parameters and optimizer state donated; baseline untouched,
  ``jaxmem.linen.convert`` exact and with ``fewbit=3``.
* ``rowconv_vgg16``: VGG-16 trunk at 1024x1024 (width 0.125, batch 1), gradient of the
  parameters; untiled (baseline), OverL-H with N=8 and N=16 row tiles per segment.
* ``rowconv_vgg16_w1``: the same trunk at full width; untiled vs OverL-H N=16.
* ``flax_{linen_lm,linen_resnet,nnx_vit}``: Flax code as users write it
  (``jaxmem.bench.flax_models``), batch 8x ``benchmarks/third_party``'s, jitted full train
  step (gradient and optax update, train state donated); baseline untouched, variants the
  training loss under ``jaxmem.transform`` exact and with ``fewbit=3``
  (``benchmarks/third_party/flax_models_transform.py``'s steps).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MiB = 2.0 ** 20
GROUPS = ("sel_r50_input", "sel_r50_norm", "sel_r50_all", "gpt_block_bf16", "gpt_block_f32",
          "gpt_linen", "rowconv_vgg16", "rowconv_vgg16_w1", "flax_linen_lm", "flax_linen_resnet",
          "flax_nnx_vit")
#: batch multiple of ``flax_*`` groups over ``benchmarks/third_party``'s CPU-sized batches
FLAX_BATCH_SCALE = 8
#: set by the ``plan`` stage: build GPU-only variants (cuDNN attention) for a compile-only plan
_FOR_GPU_PLAN = False


# --------------------------------------------------------------------------- the groups
def _selective(case, small):
    import jax

    import jaxmem
    from jaxmem import models as zoo
    from jaxmem.bench.selective import make_step
    width, classes, batch, side = (0.125, 10, 2, 64) if small else (1.0, 1000, 32, 224)
    model = zoo.resnet50(width=width, num_classes=classes)
    x = jax.random.normal(jax.random.key(0), (batch, side, side, 3))
    # initialised on one image: the same variables, and no batch-32 forward pass to raise the
    # allocator's high-water mark above what a variant's step reaches (run 12 lost the
    # jaxmem variants' peaks to it)
    v = model.init(jax.random.key(1), x[:1], train=False)
    conv = jaxmem.linen.convert(model, attention=False)
    # the 1x1 convolution after a norm kept instead of recomputed in the backward pass
    kept = jaxmem.linen.convert(model, attention=False, conv_recompute=False)
    return {"args": (v["params"], x), "baseline": "jax",
            "variants": {"jax": make_step(model, v, case),
                         "jaxmem": make_step(conv, v, case),
                         "jaxmem conv kept": make_step(kept, v, case)},
            "shape": f"ResNet-50 width {width}, batch {batch}, {side}x{side}"}


def _gpt_block(dtype, small):
    import jax
    import jax.numpy as jnp

    import jaxmem
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "fewbit"))
    from gpt_block_gpu_plan import _as_on_an_h100, _loss_fn, _params
    batch, ctx, d, heads, depth = (2, 64, 64, 2, 2) if small else (8, 1024, 768, 12, 4)
    dt = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.key(1), (batch, ctx, d)).astype(dt)
    params = _params(depth, d, dt)
    ein = _loss_fn(heads, "einsum")
    variants = {"einsum": jax.grad(ein),
                "einsum+transform": jax.grad(jaxmem.transform(ein)),
                "einsum+transform(fewbit=3)": jax.grad(jaxmem.transform(ein, fewbit=3))}
    if dt == jnp.bfloat16 and (jax.default_backend() == "gpu" or _FOR_GPU_PLAN):
        if jax.default_backend() != "gpu":
            _as_on_an_h100()          # JAX's cuDNN checks answered as on a GPU machine
        cud = _loss_fn(heads, "jax_cudnn")
        variants["cudnn"] = jax.grad(cud)
        variants["cudnn+transform(fewbit=3)"] = jax.grad(jaxmem.transform(cud, fewbit=3))
    return {"args": (params, x), "baseline": "einsum", "variants": variants,
            "reports": {"einsum+transform": jaxmem.transform(ein),
                        "einsum+transform(fewbit=3)": jaxmem.transform(ein, fewbit=3)},
            "shape": f"{depth} GPT-2 blocks, {dtype}, batch {batch}, ctx {ctx}, d {d}, "
                     f"{heads} heads"}


def _gpt_linen(small):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxmem
    from jaxmem.models import GPT, GPTConfig
    if small:
        cfg, batch = GPTConfig(vocab=128, ctx=64, d_model=64, n_head=2, n_layer=2), 2
    else:
        cfg, batch = GPTConfig(vocab=8192, ctx=1024, d_model=768, n_head=12, n_layer=4), 8
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, cfg.ctx)))
    base = GPT(cfg)
    params = base.init(jax.random.key(0), tok[:, :-1])
    opt = optax.adamw(1e-4)

    def train_step(model):
        def loss(p, tok):
            lp = jax.nn.log_softmax(model.apply(p, tok[:, :-1]).astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(lp, tok[:, 1:, None], -1))

        def step(p, s, tok):
            g = jax.grad(loss)(p, tok)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return step

    return {"args": (params, opt.init(params), tok), "baseline": "jax", "carry": 2,
            "donate": (0, 1),
            "variants": {"jax": train_step(base),
                         "linen.convert": train_step(jaxmem.linen.convert(base)),
                         "linen.convert(fewbit=3)":
                             train_step(jaxmem.linen.convert(base, fewbit=3))},
            "shape": f"GPT {cfg.n_layer} layers, d {cfg.d_model}, ctx {cfg.ctx}, vocab "
                     f"{cfg.vocab}, batch {batch}, AdamW, donated"}


def _rowconv(width, ns, small):
    import jax

    from jaxmem import rowconv as rc
    from jaxmem.bench import rowconv as B
    side = 128 if small else 1024
    shape = (1, side, side, 3)
    layers = rc.trunks.vgg_layers(width=width)
    hybrid = rc.trunks.vgg_layers(width=width, checkpoints_at_pools=True)
    params = rc.init(layers, jax.random.PRNGKey(0), shape)
    hparams = rc.init(hybrid, jax.random.PRNGKey(0), shape)
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    variants = {"untiled": B.make_step(layers, 1, "overlap")}
    for n in ns:
        variants[f"OverL-H N={n}"] = B.make_step(
            hybrid, rc.segment_rows(hybrid, shape, n, "overlap"), "overlap")
    # the hybrid trunk (checkpoint markers between segments) has its own parameter tree
    return {"args": (params, x), "baseline": "untiled", "variants": variants,
            "variant_args": {n: (hparams, x) for n in variants if n != "untiled"},
            "shape": f"VGG-16 trunk width {width}, batch 1, {side}x{side}"}


def _flax(name, small):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "third_party"))
    import flax_models_transform as T

    from jaxmem.bench import flax_models as FM
    batch = T.BATCH[name] * (1 if small else FLAX_BATCH_SCALE)
    case = FM.STEPS[name](batch_size=batch)
    return {"args": case.pure_args, "baseline": "default", "carry": 1, "donate": (0,),
            "variants": {"default": case.pure_step,
                         "transform": T._step(case, T._transformer(None)),
                         "transform(fewbit=3)": T._step(case, T._transformer(3))},
            "shape": f"{name} (jaxmem.bench.flax_models), batch {batch}, full train step"}


def build(group, small):
    if group.startswith("sel_r50_"):
        return _selective(group[len("sel_r50_"):], small)
    if group == "gpt_block_bf16":
        return _gpt_block("bfloat16", small)
    if group == "gpt_block_f32":
        return _gpt_block("float32", small)
    if group == "gpt_linen":
        return _gpt_linen(small)
    if group == "rowconv_vgg16":
        return _rowconv(0.125, (8, 16), small)
    if group == "rowconv_vgg16_w1":
        return _rowconv(1.0, (16,), small)
    if group.startswith("flax_"):
        return _flax(group[len("flax_"):], small)
    raise ValueError(f"unknown group {group!r}; known: {', '.join(GROUPS)}")


# --------------------------------------------------------------------------- measuring
def _setup_cache(cache_dir):
    import jax
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _plan(compiled):
    m = compiled.memory_analysis()
    return {"temp": int(m.temp_size_in_bytes), "output": int(m.output_size_in_bytes),
            "argument": int(m.argument_size_in_bytes), "alias": int(m.alias_size_in_bytes)}


def _jit(g, fn):
    import jax
    return jax.jit(fn, donate_argnums=g.get("donate", ()))


def _fresh_args(g, name):
    """``name``'s arguments for one call: donated leaves copied so each call has its own."""
    import jax
    import jax.numpy as jnp
    args = g.get("variant_args", {}).get(name, g["args"])
    if not g.get("donate"):
        return args
    return tuple(jax.tree.map(jnp.copy, a) if i in g["donate"] else a
                 for i, a in enumerate(args))


def compile_group(group, small, cache_dir):
    """Stage 1: compile every variant (autotuned, into the cache); the device's plan."""
    import jax
    _setup_cache(cache_dir)
    g = build(group, small)
    out = {"group": group, "shape": g["shape"], "baseline": g["baseline"], "variants": {}}
    for name, fn in g["variants"].items():
        t0 = time.perf_counter()
        try:
            c = _jit(g, fn).lower(*_fresh_args(g, name)).compile()
            out["variants"][name] = {"device_plan": _plan(c),
                                     "compile_s": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a row
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(group, name, out["variants"][name], flush=True)
    for name, fn in g.get("reports", {}).items():   # what the transformation did, per row
        try:
            print(f"report of {group} {name}:\n{fn.report(*g['args']).table()}", flush=True)
        except Exception as e:  # noqa: BLE001 -- a diagnostic only
            print(f"report of {group} {name} failed: {type(e).__name__}: {e}", flush=True)
    out["device"] = str(jax.devices()[0].device_kind)
    return out


def _block(x):
    import jax
    return jax.block_until_ready(x)


def run_group(group, small, cache_dir, planned, rounds):
    """Stage 2: allocator peak per variant (increasing planned bytes), then timed rounds."""
    import jax
    _setup_cache(cache_dir)
    dev = jax.devices()[0]
    g = build(group, small)
    carry = g.get("carry", 0)
    order = sorted((n for n in g["variants"] if "error" not in planned.get(n, {})),
                   key=lambda n: planned.get(n, {}).get("device_plan", {}).get("temp", 0))
    _block(g["args"])
    jitted, res = {}, {}
    for name in order:
        t0 = time.perf_counter()
        args = _fresh_args(g, name)
        c = _jit(g, g["variants"][name]).lower(*args).compile()   # a cache hit: no autotuning
        load_s = time.perf_counter() - t0
        st = dev.memory_stats() or {}
        before, hw = st.get("bytes_in_use", 0), st.get("peak_bytes_in_use", 0)
        out = _block(c(*args))
        st = dev.memory_stats() or {}
        peak = st.get("peak_bytes_in_use", 0)
        del out
        res[name] = {"load_s": round(load_s, 2), "in_use_before": before,
                     "peak_above_before": peak - before if peak > hw else None,
                     "peak_above_before_at_most": hw - before,
                     "device_plan": _plan(c)}
        jitted[name] = c
    # timed rounds: one step of each variant in turn
    times = {n: [] for n in order}
    state = {n: _fresh_args(g, n) for n in order}
    for n in order:                       # two warm-up steps each
        for _ in range(2):
            o = _block(jitted[n](*state[n]))
            if carry:
                state[n] = tuple(o[:carry]) + tuple(state[n][carry:])
    for _ in range(rounds):
        for n in order:
            t0 = time.perf_counter()
            o = _block(jitted[n](*state[n]))
            times[n].append(time.perf_counter() - t0)
            if carry:
                state[n] = tuple(o[:carry]) + tuple(state[n][carry:])
    base = statistics.median(times[g["baseline"]]) if g["baseline"] in times else None
    for n in order:
        med = statistics.median(times[n])
        res[n]["step_ms"] = round(1e3 * med, 3)
        res[n]["time_ratio"] = round(med / base, 3) if base else None
    return {"group": group, "shape": g["shape"], "baseline": g["baseline"],
            "device": str(dev.device_kind), "rounds": rounds, "variants": res}


def plan_group(group, small, target="h100"):
    """The same variants compiled for ``target``'s XLA:GPU plan without a GPU."""
    global _FOR_GPU_PLAN
    from jaxmem.measure import compiled_memory
    _FOR_GPU_PLAN = True
    g = build(group, small)
    out = {"group": group, "shape": g["shape"], "target": target, "variants": {}}
    for name, fn in g["variants"].items():
        try:
            c = compiled_memory(fn, *g.get("variant_args", {}).get(name, g["args"]),
                                donate_argnums=g.get("donate", ()),
                                target=target)
            out["variants"][name] = {"gpu_plan": {"temp": c.temp_bytes,
                                                   "output": c.output_bytes,
                                                   "argument": c.argument_bytes,
                                                   "alias": c.alias_bytes}}
        except Exception as e:  # noqa: BLE001
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(group, name, out["variants"][name], flush=True)
    return out


# --------------------------------------------------------------------------- driver
def _child(stage, group, small, cache_dir, extra, timeout, dump=None):
    cmd = [sys.executable, __file__, stage, group, cache_dir, json.dumps(extra)]
    if small:
        cmd.append("--small")
    env = dict(os.environ)
    if dump:   # XLA's buffer assignment and live ranges of every module this child compiles
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
    # the child's output file stays open until _collect reads and closes it
    fh = open(os.path.join("/tmp", f"step_times_{stage}_{group}.txt"), "w+")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env), fh, timeout


def _collect(p, group, log):
    proc, fh, _ = p
    proc.wait()
    fh.seek(0)
    text = fh.read()
    fh.close()
    log.write(f"===== {group} rc={proc.returncode}\n{text}\n")
    log.flush()
    last = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return json.loads(last[-1][len("RESULT "):]) if last else {
        "group": group, "error": f"rc={proc.returncode}: {text[-600:]}"}


def _pack_dumps(dump_root, outdir):
    """The memory reports of the XLA dumps (``*memory-usage-report.txt``,
    ``*buffer-assignment.txt``, ``*live-range.txt``) as ``outdir/xla_dumps.tgz``."""
    import tarfile
    keep = ("memory-usage-report.txt", "buffer-assignment.txt", "live-range.txt")
    with tarfile.open(os.path.join(outdir, "xla_dumps.tgz"), "w:gz") as tar:
        for d, _, files in os.walk(dump_root):
            # the steps' modules only: a buffer assignment of 16 KiB or more (not the small
            # programs that building the arguments compiles)
            big = {f.split(".")[0] for f in files if f.endswith("buffer-assignment.txt")
                   and os.path.getsize(os.path.join(d, f)) >= 16384}
            for f in files:
                if f.endswith(keep) and f.split(".")[0] in big:
                    p = os.path.join(d, f)
                    tar.add(p, arcname=os.path.relpath(p, dump_root))


def run_all(outdir, groups, small, jobs, rounds, compile_timeout, run_timeout, dump=()):
    os.makedirs(outdir, exist_ok=True)
    dump_root = os.path.join("/tmp", "step_times_xla_dumps")
    cache = os.path.join("/tmp", "jaxmem-step-times-cache")
    log = open(os.path.join(outdir, "step_times.log"), "w")  # noqa: SIM115 -- closed below
    compiled, pending = {}, list(groups)
    running, started = [], {}
    t_start = time.time()
    while pending or running:          # stage 1: `jobs` compile processes at a time
        while pending and len(running) < jobs:
            gname = pending.pop(0)
            started[gname] = time.time()
            running.append((gname, _child(
                "compile", gname, small, cache, {}, compile_timeout,
                os.path.join(dump_root, gname) if gname in dump else None)))
        time.sleep(0.5)
        for gname, p in list(running):
            proc, _, tmo = p
            if proc.poll() is not None or time.time() - started[gname] > tmo:
                if proc.poll() is None:
                    proc.kill()
                compiled[gname] = _collect(p, gname, log)
                running.remove((gname, p))
    print(f"compile stage {time.time() - t_start:.0f} s", flush=True)
    if dump:
        _pack_dumps(dump_root, outdir)
    results = []
    for gname in groups:               # stage 2: one group at a time, alone on the GPU
        planned = compiled.get(gname, {}).get("variants", {})
        p = _child("run", gname, small, cache, {"planned": planned, "rounds": rounds},
                   run_timeout)
        try:
            p[0].wait(timeout=run_timeout)
        except subprocess.TimeoutExpired:
            p[0].kill()
        r = _collect(p, gname, log)
        for n, v in r.get("variants", {}).items():
            v["compile_s"] = planned.get(n, {}).get("compile_s")
        for n, v in planned.items():
            if "error" in v:
                r.setdefault("variants", {})[n] = v
        results.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(outdir, "step_times.json"), "w") as fh:
            json.dump({"results": results}, fh, indent=1)
    print(f"total {time.time() - t_start:.0f} s", flush=True)
    log.close()


def _mib(b):
    return "—" if b is None else f"{b / MiB:.1f}"


def _cell(b, base, bound=False):
    """``MiB (ratio)``; ``<= MiB`` where only an upper bound is known."""
    if b is None:
        return "—"
    ratio = f" ({b / base:.2f}x)" if base else ""
    return ("<= " if bound else "") + _mib(b) + ratio


def markdown(result, plan=None):
    """The results as a table; ratios against each group's baseline."""
    with open(result) as fh:
        res = json.load(fh)["results"]
    plans, target = {}, "GPU"
    if plan:
        with open(plan) as fh:
            for r in json.load(fh)["results"]:
                plans[r["group"]] = r.get("variants", {})
                target = r.get("target", target)
    dev = next((r.get("device") for r in res if r.get("device")), "?")
    lines = [("| group | variant | step ms | time ratio | device plan temp+out MiB | "
              f"allocator peak above arguments MiB | {target} plan, compile-only, temp+out MiB |"),
             "|---|---|---|---|---|---|---|"]

    def plan_bytes(v, key):
        return v[key]["temp"] + v[key]["output"] if key in v else None

    for r in res:
        if "variants" not in r:
            lines.append(f"| {r['group']} | error: {r.get('error', '')[:120]} | | | | | |")
            continue
        base = r["variants"].get(r["baseline"], {})
        hbase = plans.get(r["group"], {}).get(r["baseline"], {})
        for n, v in r["variants"].items():
            if "error" in v:
                lines.append(f"| {r['group']} | {n}: {v['error'][:100]} | | | | | |")
                continue
            peak, bound = v["peak_above_before"], False
            if peak is None:
                peak, bound = v["peak_above_before_at_most"], True
            h = plans.get(r["group"], {}).get(n, {})
            lines.append(
                f"| {r['group']} | {n} | {v['step_ms']:.2f} | {v['time_ratio']:.2f}x | "
                f"{_cell(plan_bytes(v, 'device_plan'), plan_bytes(base, 'device_plan'))} | "
                f"{_cell(peak, base.get('peak_above_before'), bound)} | "
                f"{_cell(plan_bytes(h, 'gpu_plan'), plan_bytes(hbase, 'gpu_plan'))} |")
    return f"Device: {dev}\n\n" + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=("all", "compile", "run", "plan", "md"))
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--target", default="h100", help="plan stage: the GPU whose plan")
    ap.add_argument("--dump", default="", help="all: groups whose XLA memory reports to keep "
                    "(OUTDIR/xla_dumps.tgz; programs compiled in this run: a cache hit "
                    "writes none)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--compile-timeout", type=float, default=240)
    ap.add_argument("--run-timeout", type=float, default=90)
    a = ap.parse_args()
    groups = [g for g in a.groups.split(",") if g]
    if a.stage == "all":
        run_all(a.rest[0], groups, a.small, a.jobs, a.rounds, a.compile_timeout,
                a.run_timeout, tuple(g for g in a.dump.split(",") if g))
    elif a.stage == "compile":
        print("RESULT " + json.dumps(compile_group(a.rest[0], a.small, a.rest[1])), flush=True)
    elif a.stage == "run":
        extra = json.loads(a.rest[2])
        print("RESULT " + json.dumps(run_group(a.rest[0], a.small, a.rest[1],
                                                extra["planned"], extra["rounds"])), flush=True)
    elif a.stage == "plan":
        out = {"results": [plan_group(g, a.small, a.target) for g in groups]}
        with open(a.rest[0], "w") as fh:
            json.dump(out, fh, indent=1)
    else:
        sys.stdout.write(markdown(a.rest[0], a.rest[1] if len(a.rest) > 1 else None))


if __name__ == "__main__":
    main()
