"""PyTorch's own memory/compute trades on the twin models, beside jaxmem.plan's budgets.

Same models and shapes as ``bench_plan.py`` (GPT 4x64 ctx 64; ResNet-50 width 0.125, CIFAR
stem, 32x32), built from ``torch_ref.models``. Per model:

* torch untouched: eager ``loss.backward()``;
* ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` on every block (GPT:
  each transformer block ``h_i``; ResNet-50: each bottleneck ``layer{s}_{b}``);
* ``torch.compile(fullgraph=True)`` with ``torch._functorch.config.activation_memory_budget``
  = 1.0 (the compiled baseline), 0.5, 0.25, 0.1. The budget interpolates the min-cut
  partitioner's saved set between "save only the graph inputs" (0.0) and its
  runtime-optimised choice (1.0).

Saved bytes are what autograd keeps for backward, caught with ``saved_tensors_hooks``
(``torch_ref.measure.saved_bytes``: one count per storage, the step's arguments — parameters,
batch — apart). A compiled step saves its tensors through ``ctx.save_for_backward`` of the
AOTAutograd function, so the hooks see them; the script checks this against the partitioner's
own saved values (recorded by a partitioner that wraps ``min_cut_rematerialization_partition``)
and fails on any recompile while hooks are active. Each variant runs in a fresh subprocess and
is timed against the untouched eager step there (fwd + bwd, interleaved repeats, median of
the paired ratios,
``torch.set_num_threads(2)``, denormals flushed to zero with ``torch.set_flush_denormal`` as
XLA's CPU backend does: without it the ViT's eager step hits subnormal floats and runs ~70x
slower); gradients are compared with the untouched step's in float64.

    .venv/bin/python benchmarks/plan/torch_budget.py [--quick] [--backend inductor|partition]
        [--cases gpt,resnet,vit] [--out DIR] [--render]

``--backend inductor`` (default without ``--quick``) compiles C++ kernels: several minutes per
budget on two cores. ``--backend partition`` (default with ``--quick``) runs the same graphs
through inductor's decompositions and the same min-cut partitioner (without inductor's
joint-graph rewrites) and executes them with eager kernels: no code generation, times without
inductor's fusion.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import checkpoint

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE.parent / "results" / "plan"
MIB = 2.0**20
FRACTIONS = (0.5, 0.25, 0.1)
BACKENDS = ("inductor", "partition")
CASES = ("gpt", "resnet", "vit")
REPS = {True: 21, False: 61}  # timed pairs per variant


# ----------------------------------------------------------------------------- models

def build(case, quick):
    """``(name, loss_module, inputs, block_names)`` for ``case`` in :data:`CASES`; names and
    shapes as ``bench_plan.py``'s cases; ``inputs`` is a tuple."""
    from jaxmem.models.gpt import GPTConfig
    from jaxmem.models.vit import ViTConfig
    from torch_ref import models as tm

    torch.manual_seed(0)
    if case == "gpt":
        b = 16 if quick else 32
        model = tm.gpt(GPTConfig(n_layer=4, d_model=64, ctx=64))
        inp = (torch.randint(0, 256, (b, 64)),)
        blocks = [f"h_{i}" for i in range(4)]
        name = f"gpt (4x64, ctx 64, b{b})"
    elif case == "resnet":
        b = 4 if quick else 8
        model = tm.resnet50(width=0.125, num_classes=10, stem="cifar")
        inp = (torch.randn(b, 3, 32, 32),)
        blocks = list(model.block_names)
        name = f"resnet50 (w 0.125, 32x32, b{b})"
    elif case == "vit":
        b = 8 if quick else 16
        model = tm.ViT(ViTConfig(image_size=32, patch_size=4, d_model=64, n_head=4, n_layer=4,
                                 mlp_ratio=4, num_classes=10))
        inp = (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,)))
        blocks = [f"blocks_{i}" for i in range(4)]
        name = f"vit (4x64, patch 4, 32x32, b{b})"
    else:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    return name, Loss(model, case), inp, blocks


class Loss(torch.nn.Module):
    """The loss of ``bench_plan.py``: GPT ``-mean(log_softmax(logits)[..., 0])``; ResNet
    ``mean(y ** 2)`` with BatchNorm in training mode; ViT ``-mean_i log softmax(logits_i)
    [labels_i]``."""

    def __init__(self, model, case):
        super().__init__()
        self.model, self.case = model, case

    def forward(self, x, labels=None):
        y = self.model(x)
        if self.case == "gpt":
            return -torch.log_softmax(y, dim=-1)[..., 0].mean()
        if self.case == "vit":
            return -torch.log_softmax(y, dim=-1).gather(1, labels[:, None]).mean()
        return (y ** 2).mean()


class PerBlock(torch.nn.Module):
    """``block`` under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def _checkpointed(lm, blocks):
    """A copy of ``lm`` whose blocks run under non-reentrant ``torch.utils.checkpoint``."""
    out = copy.deepcopy(lm)
    for b in blocks:
        setattr(out.model, b, PerBlock(getattr(out.model, b)))
    return out


# ----------------------------------------------------------------------------- helpers

def _step(lm, inp):
    for p in lm.parameters():
        p.grad = None
    loss = lm(*inp)
    loss.backward()
    return loss


def _grads(lm, inp):
    loss = _step(lm, inp)
    return float(loss.detach()), [p.grad.detach().clone() for p in lm.parameters()]


def _reference(lm, inp):
    """Loss and gradients of the untouched step in float64 (a copy of ``lm``)."""
    ref = copy.deepcopy(lm).double()
    return _grads(ref, tuple(t.double() if t.is_floating_point() else t for t in inp))


def _rel_err(ref, got):
    """``||got - ref|| / ||ref||`` over all gradient tensors together (float64)."""
    num = sum(float(((g.double() - r) ** 2).sum()) for r, g in zip(ref, got))
    den = sum(float((r ** 2).sum()) for r in ref)
    return (num / den) ** 0.5


def _times(fns, reps):
    """Seconds per step: calls interleaved ``fns[0], fns[1], ...`` in each repeat. Returns
    each step's median and the median over repeats of ``t[i] / t[0]`` (paired ratios, so a
    burst of load from other processes hits both sides of a pair)."""
    for f in fns:
        f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    meds = [statistics.median(t) for t in ts]
    ratios = [statistics.median(a / b for a, b in zip(t, ts[0])) for t in ts]
    return meds, ratios


def _saved(lm, inp):
    from torch_ref.measure import saved_bytes

    r = saved_bytes(lm, *inp)
    params = {tuple(p.shape) for p in lm.parameters() if p.dim() >= 2}
    shaped = sum(e.nbytes for e in r.entries
                 if e.kind == "activation" and len(e.shape) >= 2 and tuple(e.shape) in params)
    return {"activation_bytes": r.activation_bytes, "argument_bytes": r.argument_bytes,
            "n_saved": len(r.entries), "param_shaped_activation_bytes": shaped}


class _Recorder:
    """Wraps inductor's partitioner: records the forward graph's saved values (bytes of
    saved tensors that are graph inputs vs computed), then returns its partition."""

    def __init__(self):
        self.parts = []

    def record(self, fw, num_fwd_outputs):
        out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        inputs = {n for n in fw.graph.nodes if n.op == "placeholder"}
        act = arg = 0
        for v in out[num_fwd_outputs:]:
            t = v.meta.get("val") if hasattr(v, "meta") else None
            if isinstance(t, torch.Tensor):
                nb = t.numel() * t.element_size()
                if v in inputs:
                    arg += nb
                else:
                    act += nb
        self.parts.append({"activation_bytes": act, "argument_bytes": arg,
                           "n_saved": len(out) - num_fwd_outputs})

    def partition(self, gm, joint_inputs, **kw):
        from functorch.compile import min_cut_rematerialization_partition

        kw.setdefault("compiler", "inductor")
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kw)
        self.record(fw, kw["num_fwd_outputs"])
        return fw, bw


_RECORDER = None  # the recorder of this worker process (one compile per process)


class _InductorPartitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: the min-cut partitioner, recorded. A module-level
    class so that inductor can pickle it into its cache keys."""

    def __call__(self, gm, joint_inputs, **kw):
        kw.pop("compiler", None)
        return _RECORDER.partition(gm, joint_inputs, **kw)

    def uuid(self):
        return "torch_budget-recording-min-cut"


def _compiler(backend, rec):
    """``torch.compile`` backend: inductor with a recording partitioner, or the same
    decompositions and partitioner with eager kernels (``partition``)."""
    import torch._inductor.config as ic

    if backend == "inductor":
        global _RECORDER
        _RECORDER = rec
        ic.custom_partitioner_fn = _InductorPartitioner()
        return "inductor"

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def decomps():
        from torch._inductor.compile_fx import select_decomp_table

        return select_decomp_table()

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, decompositions=decomps,
                        partition_fn=rec.partition)


# ----------------------------------------------------------------------------- workers

def worker_eager(case, quick, reps):
    name, lm, inp, blocks = build(case, quick)
    ck = _checkpointed(lm, blocks)
    _, g64 = _reference(lm, inp)
    _, g0 = _grads(lm, inp)
    _, g1 = _grads(ck, inp)
    (t0, t1), (_, r1) = _times([lambda: _step(lm, inp), lambda: _step(ck, inp)], reps)
    return {"model": name, "torch": torch.__version__,
            "untouched": {**_saved(lm, inp), "seconds": t0, "grad_rel_err": _rel_err(g64, g0)},
            "checkpoint": {**_saved(ck, inp), "seconds": t1, "time_ratio": r1,
                           "grad_rel_err": _rel_err(g64, g1),
                           "grad_diff_to_untouched": _rel_err([g.double() for g in g0], g1)}}


def worker_compile(case, quick, reps, fraction, backend):
    import torch._functorch.config as fc

    fc.activation_memory_budget = fraction
    fc.enable_autograd_cache = False  # the partitioner runs on every compile (recorded)
    rec = _Recorder()
    be = _compiler(backend, rec)
    name, lm, inp, _ = build(case, quick)
    cm = torch.compile(copy.deepcopy(lm), backend=be, fullgraph=True)
    t = time.perf_counter()
    _, g1 = _grads(cm, inp)
    compile_s = time.perf_counter() - t
    _, g64 = _reference(lm, inp)
    _, g0 = _grads(lm, inp)
    torch._dynamo.config.error_on_recompile = True  # hooks must see the compiled graph
    saved = _saved(cm, inp)
    (t0, t1), (_, r1) = _times([lambda: _step(lm, inp), lambda: _step(cm, inp)], reps)
    return {"model": name, "fraction": fraction, "backend": backend, **saved,
            "partitioner": rec.parts, "compile_seconds": compile_s, "seconds": t1,
            "eager_seconds": t0, "time_ratio": r1, "grad_rel_err": _rel_err(g64, g1),
            "eager_grad_rel_err": _rel_err(g64, g0)}


def worker_twin(case, quick):
    """Twin check: the JAX model of ``bench_plan.py`` and the torch twin, same weights
    (``torch_ref.convert``), give the same loss; JAX's residual bytes of the untouched step."""
    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    import bench_plan

    from jaxmem.measure import residual_bytes
    from torch_ref.convert import jax_to_torch, torch_to_jax

    jname, jloss, jargs = getattr(bench_plan, f"{case}_case")(quick)
    name, lm, _, _ = build(case, quick)
    if jname != name:
        raise RuntimeError(f"shapes differ from bench_plan.py: {jname!r} vs {name!r}")
    variables = {"params": jargs[0]}
    if case == "resnet":
        variables["batch_stats"] = torch_to_jax(lm.model)["batch_stats"]
    jax_to_torch(variables, lm.model)
    targs = [torch.from_numpy(np.array(a)) for a in jargs[1:]]  # writable copies
    targs = [t.long() if not t.is_floating_point() else t.permute(0, 3, 1, 2).contiguous()
             for t in targs]  # tokens / labels; NHWC images -> NCHW
    lj = float(jax.jit(jloss)(*jargs))
    lt = float(lm(*targs).detach())
    res = residual_bytes(jloss, *jargs, argnums=0)
    return {"model": name, "jax": jax.__version__, "jax_loss": lj, "torch_loss": lt,
            "jax_residual_activation_bytes": res.activation_bytes}


# ----------------------------------------------------------------------------- driver

def _spawn(args):
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", json.dumps(args)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                       check=False)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-12:]
        return {"error": "\n".join(tail)}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(quick, backend, cases):
    reps = REPS[quick]
    out = []
    for case in cases:
        rec = {"case": case}
        t = time.perf_counter()
        rec["twin"] = _spawn({"kind": "twin", "case": case, "quick": quick})
        rec["eager"] = _spawn({"kind": "eager", "case": case, "quick": quick, "reps": reps})
        print(case, json.dumps(rec["eager"])[:400], flush=True)
        rec["compile"] = []
        for f in (1.0,) + FRACTIONS:
            r = _spawn({"kind": "compile", "case": case, "quick": quick, "reps": reps,
                        "fraction": f, "backend": backend})
            r.setdefault("fraction", f)
            rec["compile"].append(r)
            print(case, f, json.dumps(r)[:400], flush=True)
        rec["seconds"] = time.perf_counter() - t
        out.append(rec)
    return out


def _header(meta):
    if meta["backend"] == "inductor":
        be = " (C++ kernels generated by inductor)."
    else:
        be = (" (inductor's decompositions and min-cut partitioner, without inductor's "
              "joint-graph rewrites, run with eager kernels: times without inductor's fusion).")
    return [
        "# PyTorch beside jaxmem.plan: checkpoint per block and compile memory budgets", "",
        f"Command: `{meta['command']}`  ",
        (f"Date: {meta['date']}; torch {meta['torch']}, jax {meta['jax']}; "
         f"{meta['machine']}; whole run {meta['seconds'] / 60:.1f} min.  "),
        f"Compile backend: `{meta['backend']}`{be}", "",
        ("Times were taken on 2 CPU cores shared with other jobs: read them as rough ratios. "
         "Each variant ran in its own process, timed against the untouched eager step in that "
         f"process: {meta['reps']} interleaved fwd+bwd pairs, median of the paired ratios. "
         "Denormals are flushed to zero (`torch.set_flush_denormal(True)`) to keep eager "
         "timings meaningful; without it the ViT's eager step runs ~70x slower on subnormal "
         "floats."),
        "",
        ("**What is counted.** torch: *saved-activation bytes*, the storages autograd keeps for "
         "backward (`saved_tensors_hooks`, one count per storage), without the step's "
         "arguments (parameters, batch); for a compiled step, the tensors its compiled forward "
         "saves for its backward; for checkpointing, the block inputs it keeps. Not counted: "
         "parameters, gradients, and the transient buffers of one op or one recomputed "
         "block. jaxmem: *XLA compiled bytes* of the whole `value_and_grad` step (temp + "
         "output + argument - alias: parameters, batch, gradients and every intermediate live "
         "at XLA's peak), read from `plan.json`. The fractions are of different totals: "
         "torch's `activation_memory_budget` f asks for a saved set of about f of the way "
         "from \"save only the graph inputs\" (0) to the partitioner's runtime-optimised "
         "set (1); jaxmem's budget f is a fraction of the untouched step's compiled total, "
         "which includes arguments and outputs that no recomputation can remove."), ""]


def _torch_table(rec):
    ev = rec["eager"]
    base = ev["untouched"]["activation_bytes"]
    ok = [c for c in rec["compile"] if "error" not in c]
    c1 = next((c for c in ok if c["fraction"] == 1.0), None)
    L = [("| torch | saved MiB | x untouched | x compile 1.0 | meets f? | time x untouched "
          "| grad err vs float64 |"), "|---|---|---|---|---|---|---|",
         (f"| untouched (eager) | {base / MIB:.2f} | 1.00 | - | - | 1.00 | "
          f"{ev['untouched']['grad_rel_err']:.1e} |")]
    ck = ev["checkpoint"]
    L.append(f"| checkpoint per block | {ck['activation_bytes'] / MIB:.2f} | "
             f"{ck['activation_bytes'] / base:.2f} | - | - | {ck['time_ratio']:.2f} | "
             f"{ck['grad_rel_err']:.1e} |")
    for c in rec["compile"]:
        f = c["fraction"]
        if "error" in c:
            err = c["error"].splitlines()[-1].replace("|", "\\|")
            L.append(f"| compile budget {f} | failed: `{err}` | | | | | |")
            continue
        a = c["activation_bytes"]
        x1 = f"{a / c1['activation_bytes']:.2f}" if c1 and c1["activation_bytes"] else "-"
        meets = "-" if f == 1.0 else ("yes" if a <= f * base else f"no ({a / base:.3f})")
        L.append(f"| compile budget {f} | {a / MIB:.2f} | {a / base:.2f} | {x1} | {meets} | "
                 f"{c['time_ratio']:.2f} | {c['grad_rel_err']:.1e} |")
    L += ["", ("`meets f?`: saved activations <= f x torch untouched. `grad err vs float64`: "
               "||g - g64|| / ||g64|| over all parameter gradients, g64 from the untouched "
               "step in float64 (the fp32 untouched step's own error is in the first row). "
               f"Checkpointed gradients equal the untouched step's to "
               f"{ck['grad_diff_to_untouched']:.1e}.")]
    return L


def _checks(rec):
    base = rec["eager"]["untouched"]["activation_bytes"]
    L = []
    tw = rec.get("twin", {})
    if "error" in tw:
        L += ["", f"Twin check failed: `{tw['error'].splitlines()[-1]}`"]
    elif tw:
        L += ["", (f"Twin check: same weights (`torch_ref.convert`), loss JAX "
                   f"{tw['jax_loss']:.6f} / torch {tw['torch_loss']:.6f}. JAX residual "
                   f"activation bytes of the untouched step (`jaxmem.measure.residual_bytes`, "
                   f"jaxpr level, before XLA's fusion; the counterpart of torch's saved "
                   f"bytes): "
                   f"{tw['jax_residual_activation_bytes'] / MIB:.2f} MiB vs torch "
                   f"{base / MIB:.2f} MiB.")]
    ok = [c for c in rec["compile"] if "error" not in c and c.get("partitioner")]
    if ok:
        def part(c, key):
            return sum(p[key] for p in c["partitioner"])

        extra = [c["activation_bytes"] + c["argument_bytes"] - part(c, "activation_bytes")
                 - part(c, "argument_bytes") for c in ok]
        own = [part(c, "argument_bytes") - c["argument_bytes"] for c in ok]
        graphs = {len(c["partitioner"]) for c in ok}
        sums = [(c["fraction"], part(c, "activation_bytes") + part(c, "argument_bytes"))
                for c in ok]
        tot = ", ".join(f"{f}: {v / MIB:.2f}" for f, v in sums)
        L += ["", (f"The partitioner's own saved values (computed + graph inputs, MiB; "
                   f"{'/'.join(map(str, sorted(graphs)))} graph(s) per step): {tot}.")]
        if not any(extra):
            L[-1] += " The hooks' totals are equal in every case."
        elif min(extra) >= 0:
            L += [(f"The hooks' totals are larger by up to {max(extra) / MIB:.2f} MiB: they "
                   "count a saved view by its whole storage (e.g. a slice of a larger tensor), "
                   "the partitioner by the view's own elements.")]
        else:
            L += ["The hooks' totals differ from these (see the JSON)."]
        if max(own) > 0:
            shaped = max(c["param_shaped_activation_bytes"] for c in ok)
            L += [(f"Up to {max(own) / MIB:.2f} MiB of what the partitioner saves as graph "
                   "inputs reaches `save_for_backward` in storages of its own, not the "
                   "inputs': copies the compiled code makes of its inputs (up to "
                   f"{shaped / MIB:.2f} MiB of saved activations have a parameter's shape). "
                   "The table counts them as activations: that memory is held for backward.")]
    return L


def _jax_table(plan, name):
    rows = [r for r in plan["rows"] if r.get("model") == name and "fraction" in r] if plan else []
    if not rows:
        return ["no rows for this model and shape in `plan.json`."]
    L = ["| jaxmem | compiled x default | met | time x default |", "|---|---|---|---|"]
    for r in rows:
        label = f"plan budget {r['fraction']}" + (
            " (allow_approximate)" if r.get("allow_approximate") else "")
        if r.get("met"):
            L.append(f"| {label} | "
                     f"{r['compiled_bytes'] / r['default_bytes']:.2f} | yes | "
                     f"{r['time_ratio']:.2f} |")
        elif r.get("smallest_bytes"):
            L.append(f"| {label} | - | no (smallest "
                     f"{r['smallest_bytes'] / r['default_bytes']:.2f}x) | - |")
        else:
            L.append(f"| {label} | - | no | - |")
    for r in plan["rows"]:
        nb = r.get("uniform_bytes", {}).get("nothing_saveable per block")
        if r.get("model") == name and nb:
            L.append(f"| `jax.checkpoint` per block (nothing_saveable) | "
                     f"{nb / r['default_bytes']:.2f} | - | - |")
    return L


def markdown(results, meta, plan):
    L = _header(meta)
    for rec in results:
        ev = rec["eager"]
        name = ev.get("model", rec["case"])
        L += [f"## {name}", ""]
        if "error" in ev:
            L += [f"torch eager failed: `{ev['error'].splitlines()[-1]}`", ""]
            continue
        L += _torch_table(rec)
        L += _checks(rec)
        L += ["", "jaxmem.plan beside it (from `plan.json`; compiled bytes of the step):", ""]
        L += _jax_table(plan, name)
        L.append("")
    L += [("Checkpointing a ResNet block re-runs its BatchNorm in training mode, so running "
           "statistics are updated twice per step (gradients are unchanged). "
           "`bench_plan.py`'s VGG-16 case (512x512) is not run here, to keep this benchmark "
           "short on two cores.")]
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", choices=BACKENDS, default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(OUT), help="folder for torch_budget.json/.md")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite torch_budget.md from torch_budget.json and plan.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    plan_path = OUT / "plan.json"  # jaxmem's side, read from the committed results
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    if a.render:
        d = json.loads((out / "torch_budget.json").read_text())
        (out / "torch_budget.md").write_text(markdown(d["results"], d["meta"], plan))
        return
    if a.worker is not None:
        torch.set_num_threads(2)
        torch.set_flush_denormal(True)  # as XLA's CPU backend does (see the module docstring)
        w = json.loads(a.worker)
        if w["kind"] == "eager":
            r = worker_eager(w["case"], w["quick"], w["reps"])
        elif w["kind"] == "compile":
            r = worker_compile(w["case"], w["quick"], w["reps"], w["fraction"], w["backend"])
        else:
            r = worker_twin(w["case"], w["quick"])
        print(json.dumps(r))
        return
    backend = a.backend or ("partition" if a.quick else "inductor")
    cases = [c for c in a.cases.split(",") if c]
    t = time.perf_counter()
    results = run(a.quick, backend, cases)
    import jax

    cmd = ".venv/bin/python benchmarks/plan/torch_budget.py" + (" --quick" if a.quick else "")
    if a.backend:
        cmd += f" --backend {a.backend}"
    if cases != list(CASES):
        cmd += f" --cases {','.join(cases)}"
    meta = {"command": cmd, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "jax": jax.__version__, "backend": backend, "quick": a.quick,
            "machine": f"{platform.machine()} CPU, 2 cores shared with other jobs",
            "plan_json_quick": plan["meta"].get("quick") if plan else None,
            "reps": REPS[a.quick], "seconds": time.perf_counter() - t}
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_budget.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1))
    md = markdown(results, meta, plan)
    (out / "torch_budget.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
