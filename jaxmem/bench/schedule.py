"""Benchmark section ``schedule``: OLLA node ordering + arena placement on the twin zoo.

For each model (JAX via :func:`jaxmem.schedule.trace` of a jitted-free training step —
forward, backward, ``optax.sgd`` update — and, when torch is installed, its
``torch_ref.models`` twin via ``torch_ref.olla``'s ``make_fx`` importer) and batch size:

* ``program_peak``: peak resident set of the program order (jaxpr equation order /
  PyTorch's eager order — the paper's baseline);
* ``opt_peak``, ``lower_bound``, ``reduction``, ``gap``: OLLA's order, the solver's proven
  bound, ``1 - opt/program`` and ``(opt - bound) / opt``;
* ``order_s``, ``place_s``: solver wall time (2 CP-SAT workers);
* ``arena``: the planned arena (``arena == opt_peak`` means zero fragmentation);
* ``bestfit_arena``, ``bestfit_frag``: an online best-fit allocator on the program order;
* ``exec_peak``: live-buffer peak measured while :func:`jaxmem.schedule.execute` runs the
  plan (JAX, graphs up to ``exec_max_nodes``);
* ``xla_bytes``: XLA's compiled memory for the whole-step ``jit`` (temp + output +
  argument - alias), for comparison.

Models are CPU-scaled (small widths and images). Memory is in bytes; times are wall
seconds on this machine (noisy; reported, never asserted).
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable

from . import Section

COLUMNS = [
    "framework", "model", "batch", "nodes", "program_peak", "opt_peak", "lower_bound",
    "reduction", "gap", "status", "order_s", "place_s", "solve_s", "arena", "bestfit_arena",
    "bestfit_frag", "exec_peak", "xla_bytes",
]
UNITS = {
    "program_peak": "B", "opt_peak": "B", "lower_bound": "B", "arena": "B",
    "bestfit_arena": "B", "exec_peak": "B", "xla_bytes": "B", "order_s": "s", "place_s": "s",
    "solve_s": "s",
}
ALL_MODELS = ["mlp", "convchain", "vgg11", "resnet18", "gpt", "vit"]
QUICK_MODELS = ["mlp", "convchain"]


# ----------------------------------------------------------------------------- JAX zoo
PAPER_MODELS = ["vgg11", "resnet18"]


def jax_step(name: str, batch: int, seed: int = 0, *, scale: str = "cpu",
             abstract: bool = False):
    """``(step, args)`` for a JAX training step of zoo model ``name`` at ``batch``.

    ``scale="cpu"``: the CPU-scaled zoo (small widths and images); ``scale="paper"``: the
    paper's sizes (:data:`PAPER_MODELS` at full width, 224x224 images, 1000 classes).
    ``abstract=True`` returns ``jax.ShapeDtypeStruct`` arguments (nothing is allocated:
    for tracing steps too big to run here).
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxmem import models as M

    if scale not in ("cpu", "paper"):
        raise ValueError(f"scale: must be 'cpu' or 'paper', got {scale!r}")
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    if scale == "paper":
        if name not in PAPER_MODELS:
            raise ValueError(f"models: {name!r} has no paper size; allowed: {PAPER_MODELS}")
        model = (M.vgg11(width=1.0, num_classes=1000) if name == "vgg11"
                 else M.resnet18(width=1.0, num_classes=1000))
        x = jax.random.normal(k1, (batch, 224, 224, 3))
        y = jax.random.randint(k2, (batch,), 0, 1000)
        kind = "ce"
    elif name == "mlp":
        model = M.MLP(features=(256, 256, 10))
        x = jax.random.normal(k1, (batch, 128))
        y = jax.random.randint(k2, (batch,), 0, 10)
        kind = "ce"
    elif name == "convchain":
        model = M.ConvChain(depth=4, channels=8)
        x = jax.random.normal(k1, (batch, 16, 16, 8))
        y = jax.random.normal(k2, (batch, 16, 16, 8))
        kind = "mse"
    elif name == "vgg11":
        model = M.vgg11(width=0.125, num_classes=10)
        x = jax.random.normal(k1, (batch, 32, 32, 3))
        y = jax.random.randint(k2, (batch,), 0, 10)
        kind = "ce"
    elif name == "resnet18":
        model = M.resnet18(width=0.125, num_classes=10, stem="cifar")
        x = jax.random.normal(k1, (batch, 32, 32, 3))
        y = jax.random.randint(k2, (batch,), 0, 10)
        kind = "ce"
    elif name == "gpt":
        from jaxmem.models.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab=256, ctx=32, d_model=64, n_head=4, n_layer=2))
        x = jax.random.randint(k1, (batch, 32), 0, 256)
        y = jax.random.randint(k2, (batch, 32), 0, 256)
        kind = "ce"
    elif name == "vit":
        from jaxmem.models.vit import ViT, ViTConfig

        model = ViT(ViTConfig(image_size=16, patch_size=4, d_model=64, n_head=4, n_layer=2))
        x = jax.random.normal(k1, (batch, 16, 16, 3))
        y = jax.random.randint(k2, (batch,), 0, 10)
        kind = "ce"
    else:
        raise ValueError(f"models: unknown model {name!r}; allowed: {ALL_MODELS}")
    takes_train = "train" in inspect.signature(type(model).__call__).parameters

    def init(k, x):
        return model.init(k, x, train=False) if takes_train else model.init(k, x)

    if abstract:
        x, y = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y))
        variables = jax.eval_shape(init, k3, x)
    else:
        variables = init(k3, x[:1])  # parameters depend on shapes only: init at batch 1
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    tx = optax.sgd(0.1)
    opt = jax.eval_shape(tx.init, params) if abstract else tx.init(params)

    def loss_fn(p, state, x, y):
        kw = {"train": True} if takes_train else {}
        if state:
            out, new_state = model.apply({"params": p, **state}, x, mutable=list(state), **kw)
        else:
            out, new_state = model.apply({"params": p}, x, **kw), state
        if kind == "ce":
            loss = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        else:
            loss = jnp.mean((out - y) ** 2)
        return loss, new_state

    def step(params, state, opt, x, y):
        (loss, new_state), g = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), new_state, opt, loss

    return step, (params, state, opt, x, y)


# ----------------------------------------------------------------------------- torch zoo
def torch_step(name: str, batch: int, seed: int = 0):
    """``(model, loss_fn, x, y)`` of the torch twin (NCHW images)."""
    import torch
    import torch.nn.functional as F

    import torch_ref.models as T

    torch.manual_seed(seed)
    if name == "mlp":
        return T.MLP(128, (256, 256, 10)), F.cross_entropy, torch.randn(batch, 128), \
            torch.randint(0, 10, (batch,))
    if name == "convchain":
        return T.ConvChain(4, 8), F.mse_loss, torch.randn(batch, 8, 16, 16), \
            torch.randn(batch, 8, 16, 16)
    if name == "vgg11":
        return T.vgg11(width=0.125, num_classes=10), F.cross_entropy, \
            torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    if name == "resnet18":
        return T.resnet18(width=0.125, num_classes=10, stem="cifar"), F.cross_entropy, \
            torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    if name == "gpt":
        from torch_ref.models.gpt import GPT, GPTConfig

        m = GPT(GPTConfig(vocab=256, ctx=32, d_model=64, n_head=4, n_layer=2))

        def lm_loss(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        return m, lm_loss, torch.randint(0, 256, (batch, 32)), torch.randint(0, 256, (batch, 32))
    if name == "vit":
        from torch_ref.models.vit import ViT, ViTConfig

        m = ViT(ViTConfig(image_size=16, patch_size=4, d_model=64, n_head=4, n_layer=2))
        return m, F.cross_entropy, torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    raise ValueError(f"models: unknown model {name!r}; allowed: {ALL_MODELS}")


# ----------------------------------------------------------------------------- rows
def _row_from_plan(framework, name, batch, graph, plan):
    from jaxmem.schedule import best_fit_online, lifetimes

    n = len(graph.program_order)
    sp = [(e.size, -1, n) for e in graph.edges.values() if e.persistent]
    lt = lifetimes(graph, graph.program_order)
    sp += [(graph.edges[k].size, *lt[k]) for k in lt]
    bf_arena, _rs, bf_frag = best_fit_online(sp)
    return {
        "framework": framework, "model": name, "batch": batch, "nodes": len(graph.nodes),
        "program_peak": plan.baseline_peak, "opt_peak": plan.peak,
        "lower_bound": plan.lower_bound,
        "reduction": round(plan.reduction or 0.0, 4), "gap": round(plan.gap, 4),
        "status": plan.status, "order_s": round(plan.order_seconds, 2),
        "place_s": round(plan.place_seconds, 2), "solve_s": round(plan.solve_seconds, 2),
        "arena": plan.arena_size,
        "bestfit_arena": bf_arena, "bestfit_frag": round(bf_frag, 4),
        "persistent": graph.persistent_bytes(), "greedy_peak": plan.greedy_peak,
        "method": plan.method, "formulation": plan.formulation,
    }


def zoo_graph(framework, name, batch):
    """The scheduling Graph of one zoo training step, built exactly as the zoo rows build it.

    JAX: the jaxpr of the step with params, model state and optimizer state donated; torch:
    the make_fx graph with the parameters donated (in-place SGD consumes the old weights).
    """
    if framework == "jax":
        from jaxmem.schedule import trace

        step, args = jax_step(name, batch)
        return trace(step, *args, donate_argnums=(0, 1, 2)).graph
    if framework != "torch":
        raise ValueError(f"framework must be 'jax' or 'torch', got {framework!r}")
    from torch_ref.olla import fx_to_graph, trace_training_step

    model, loss_fn, x, y = torch_step(name, batch)
    gm, _step, args = trace_training_step(model, loss_fn, x, y)
    return fx_to_graph(gm, donate=range(len(args) - 2)).graph


def jax_row(name, batch, time_limit, exec_max_nodes=1600, measure_xla=True, targets=("cpu",),
            log=None):
    """One JAX zoo row; ``measure_xla``: XLA's compiled bytes of the whole-step jit on every
    target of ``targets`` (``<prefix>xla_bytes``, ``<prefix>xla_temp_bytes``)."""
    import jax

    from jaxmem.schedule import execute, optimize, trace, validate_plan

    step, args = jax_step(name, batch)
    # params, model state and optimizer state are donated (the usual jit(donate_argnums)
    # training loop): the old weights are freed once updated; the batch is persistent
    ts = trace(step, *args, donate_argnums=(0, 1, 2))
    plan = optimize(ts.graph, time_limit=time_limit, placement=True)
    validate_plan(ts.graph, plan)
    row = _row_from_plan("jax", name, batch, ts.graph, plan)
    row["exec_peak"] = None
    if len(ts.graph.nodes) <= exec_max_nodes:
        ref = jax.jit(step)(*args)
        fresh = jax.tree_util.tree_map(lambda a: a.copy(), args)  # donated leaves get deleted
        out, stats = execute(ts, plan, *fresh, measure=True)
        ok = all(
            bool(jax.numpy.allclose(a, b, rtol=1e-4, atol=1e-5))
            for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref))
        )
        row["exec_peak"] = stats.peak_live_bytes
        row["exec_matches_jit"] = ok
    from jaxmem.bench.targets import GemmLog, check_targets, prefix

    log = log if log is not None else GemmLog()
    for tgt in check_targets(targets):
        pre = prefix(tgt)
        row[f"{pre}xla_bytes"] = None
        if not measure_xla:
            continue
        try:
            cm = log.compiled(step, *args, donate_argnums=(0, 1, 2), target=tgt,
                              what=f"{name} batch {batch}")
            row[f"{pre}xla_bytes"] = cm.total_bytes
            row[f"{pre}xla_temp_bytes"] = cm.temp_bytes
        except Exception as err:  # noqa: BLE001 - report, don't crash the section
            row[f"{pre}xla_error"] = repr(err)[:200]
    return row


def torch_row(name, batch, time_limit, targets=("cpu",)):
    import torch

    from jaxmem.schedule import optimize, validate_plan
    from torch_ref.olla import fx_to_graph, reorder, trace_training_step

    model, loss_fn, x, y = torch_step(name, batch)
    gm, _step, args = trace_training_step(model, loss_fn, x, y)
    n_params = len(args) - 2
    fxg = fx_to_graph(gm, donate=range(n_params))  # in-place SGD: old weights consumed
    plan = optimize(fxg.graph, time_limit=time_limit, placement=True)
    validate_plan(fxg.graph, plan)
    row = _row_from_plan("torch", name, batch, fxg.graph, plan)
    gm2 = reorder(fxg, plan.order)
    a, b = gm(*args), gm2(*args)
    row["reexec_identical"] = all(torch.equal(p, q) for p, q in zip(a, b))
    row["exec_peak"] = None
    from jaxmem.bench.targets import check_targets, prefix

    for tgt in check_targets(targets):
        row[f"{prefix(tgt)}xla_bytes"] = None
    return row


def notes_for(time_limit: float, wall: float) -> list[str]:
    """The explanatory notes printed under the table."""
    return [
        ("program_peak: resident-set peak of the program order (jaxpr / PyTorch eager order), "
         "batch included, weights/optimizer state donated; opt_peak: OLLA order; "
         "reduction = 1 - opt/program."),
        ("lower_bound: max of CP-SAT's proven bound, the structural bound, the min-cut bound "
         "(analysis.cut_lower_bound: one minimum s-t cut per node) and the antichain bound "
         "(analysis.antichain_lower_bound); gap = (opt-bound)/opt. "
         "The ordering stops once gap <= 1% (optimize's default gap_limit)."),
        ("arena == opt_peak means zero fragmentation; bestfit_*: online best-fit allocator on the "
         "program order (fragmentation (MR-RS)/MR at MR's peak, OLLA sec. 5.4)."),
        "exec_peak: live-buffer peak (jax.live_arrays) while jaxmem.schedule.execute runs the plan.",
        ("xla_bytes: XLA compiled memory of the whole-step jit (temp+output+argument-alias): "
         "XLA fuses elementwise ops, so it plans far fewer buffers than the op-level graph."),
        (f"CPU-scaled zoo, optax.sgd / torch SGD, CP-SAT 2 workers, time limit {time_limit} s per "
         "stage (order_s: local search + block relocation + bounds + ILP; place_s: placement; "
         "solve_s: both)."),
        f"section wall time {wall:.1f} s",
        ]


#: per preset: models, batches, CP-SAT time limit per stage (s), torch twins, XLA bytes,
#: largest graph the executor runs
PRESET_SIZES = {
    "quick": {"models": tuple(QUICK_MODELS), "batches": (1,), "time_limit": 2.0,
              "torch": False, "xla": False, "exec_max_nodes": 400},
    "default": {"models": ("mlp", "convchain", "gpt"), "batches": (1,),
                "time_limit": 3.0, "torch": False, "xla": True, "exec_max_nodes": 600},
    "full": {"models": tuple(ALL_MODELS), "batches": (1, 32), "time_limit": 10.0,
             "torch": True, "xla": True, "exec_max_nodes": 1600},
}


def run(quick: bool = False, models: list[str] | None = None,
        progress: Callable[[str], None] | None = None, batches=None, time_limit=None,
        frameworks=None, *, preset: str | None = None, targets=("cpu",)) -> Section:
    """OLLA on the CPU-scaled zoo; XLA's compiled bytes of the whole step (``xla_bytes``) on
    every target of ``targets``. ``preset`` (default: ``"quick"`` if ``quick`` else
    ``"full"``; :data:`PRESET_SIZES`): ``"quick"`` mlp and convchain at batch 1, 2 s
    solves, JAX only, no XLA bytes; ``"default"`` (``jaxmem bench``) mlp, convchain
    and gpt at batch 1, 3 s solves, JAX only, XLA bytes; ``"full"`` (``jaxmem bench --full``)
    the whole zoo at batch 1 and 32, 10 s solves, JAX and the torch twins."""
    from jaxmem.bench.targets import (
        GemmLog,
        check_targets,
        grouped_columns,
        prefix,
        resolve_preset,
        target_meta,
        target_notes,
    )

    preset = resolve_preset(quick, preset)
    targets = check_targets(targets)
    P = PRESET_SIZES[preset]
    log = GemmLog()
    models = list(models or P["models"])
    for m in models:
        if m not in ALL_MODELS:
            raise ValueError(f"models: unknown model {m!r}; allowed: {ALL_MODELS}")
    batches = list(batches or P["batches"])
    time_limit = time_limit or P["time_limit"]
    if frameworks is None:
        frameworks = ["jax"]
        if P["torch"]:
            try:
                import torch  # noqa: F401

                frameworks.append("torch")
            except ImportError:
                pass
    rows = []
    t0 = time.perf_counter()
    for fw in frameworks:
        for m in models:
            for b in batches:
                if progress:
                    progress(f"schedule: {fw} {m} batch {b}")
                try:
                    row = (jax_row(m, b, time_limit, exec_max_nodes=P["exec_max_nodes"],
                                   measure_xla=P["xla"], targets=targets, log=log)
                           if fw == "jax" else torch_row(m, b, time_limit, targets=targets))
                except Exception as err:  # noqa: BLE001
                    row = {"framework": fw, "model": m, "batch": b, "status": f"error: {err!r}"[:200]}
                rows.append(row)
    notes = notes_for(time_limit, time.perf_counter() - t0)
    gpus = [t for t in targets if t != "cpu"]
    if gpus:
        notes.append("h100_xla_bytes etc.: the same whole-step jit compiled for the GPU plan; "
                     "the OLLA columns are graph-level (target-independent).")
    notes.append(f"preset {preset}: {', '.join(models)} at batch "
                 f"{', '.join(map(str, batches))}, frameworks {', '.join(frameworks)}.")
    notes += target_notes(targets, log, cpu_only="solver times and exec_peak")
    i = COLUMNS.index("xla_bytes")
    columns = COLUMNS[:i] + grouped_columns(targets, ["xla_bytes"]) + COLUMNS[i + 1:]
    units = {**UNITS, **{f"{prefix(t)}xla_bytes": "B" for t in targets}}
    return Section(
        name="schedule",
        title="OLLA scheduling: peak memory of program order vs optimised order and arena",
        columns=columns, rows=rows, units=units, notes=notes,
        meta={"time_limit": time_limit, "batches": batches, "models": models,
              "frameworks": frameworks, "preset": preset, "quick": preset == "quick",
              **target_meta(targets, log)},
    )
