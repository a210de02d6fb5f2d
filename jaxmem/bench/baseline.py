"""Bench section ``baseline``: JAX default vs PyTorch default on the twin model zoo.

For every model (same architecture in ``jaxmem.models`` / ``torch_ref.models``, weights
transferred with ``torch_ref.convert.jax_to_torch`` so both run the same function) and one
plain-SGD training step (cross-entropy; MSE to a random target for the conv chain):

* ``jax_saved`` / ``torch_saved`` (level 1, residual bytes) — JAX:
  ``jaxmem.measure.residual_bytes(loss, params, ...)`` w.r.t. the parameters; torch:
  ``torch_ref.measure.saved_bytes`` of forward + loss. Activations only in both (parameters
  and the batch are excluded);
* ``jax_temp`` / ``jax_total`` (level 2, JAX only) — ``compiled_memory`` of the jitted train
  step: temp, and temp + output + argument − alias (no buffer donation: the JAX default);
* ``jax_peak`` / ``torch_peak`` (level 3) — CPU high-water mark of one train step after a
  warm-up, in a fresh subprocess per framework (``jaxmem.measure.peak_memory``). The
  children initialise their own model (memory does not depend on the values);
* ``torch/jax time`` — both steps timed interleaved in ONE fresh process pinned to one CPU
  core; ratio of the fastest repeats (> 1: torch slower);
* ``loss_rdiff`` — |loss_jax − loss_torch| / |loss_torch| on the shared weights: the check that
  both columns measure the same model.

Parameters are drawn with numpy (:func:`_fast_init`), not Flax's initialisers, whose XLA
compile alone took 8.6 s for resnet18 on this CPU. A temporary persistent compilation cache
is shared with the subprocesses (:func:`_shared_compilation_cache`).

This module imports torch only inside functions (``import jaxmem`` never imports torch).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from jaxmem.bench import Section

__all__ = ["MODELS", "QUICK_MODELS", "jax_step", "run", "torch_step"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A twin model and its batch. ``batch``/``size`` are (quick, full); the ``default``
    preset of ``jaxmem bench`` uses the quick sizes."""

    name: str
    family: str  # convchain | mlp | vgg16 | resnet18 | resnet50 | gpt | vit
    batch: tuple[int, int]
    size: tuple[int, int]  # image side / sequence length / input features
    loss: str  # "ce" | "mse"


MODELS: dict[str, ModelSpec] = {
    "convchain": ModelSpec("convchain", "convchain", (8, 16), (32, 96), "mse"),
    "mlp": ModelSpec("mlp", "mlp", (64, 256), (256, 1024), "ce"),
    "vgg16": ModelSpec("vgg16", "vgg16", (8, 32), (32, 32), "ce"),
    "resnet18": ModelSpec("resnet18", "resnet18", (8, 32), (32, 32), "ce"),
    "resnet50": ModelSpec("resnet50", "resnet50", (8, 16), (32, 32), "ce"),
    "gpt": ModelSpec("gpt", "gpt", (8, 16), (64, 64), "ce"),
    "vit": ModelSpec("vit", "vit", (8, 32), (32, 32), "ce"),
}
#: models of ``jaxmem bench --quick`` (all of MODELS otherwise).
QUICK_MODELS = ("convchain", "resnet18", "gpt")

#: per preset: models, sizes (0: quick sizes, 1: full sizes), measured peaks, timing repeats
PRESET_SIZES: dict[str, dict[str, Any]] = {
    "quick": {"models": QUICK_MODELS, "sizes": 0, "peak": True, "repeats": 3},
    # every model but resnet50 (a quarter of the section's time, the same story as resnet18)
    "default": {"models": tuple(m for m in MODELS if m != "resnet50"), "sizes": 0,
                "peak": True, "repeats": 5},
    "full": {"models": tuple(MODELS), "sizes": 1, "peak": True, "repeats": 15},
}


def _ix(quick: bool | str) -> int:
    """Index into ``ModelSpec.batch`` / ``size``: 1 for the full sizes (``quick=False`` or
    preset ``"full"``), 0 for the quick sizes (``quick=True``, ``"quick"``, ``"default"``)."""
    if isinstance(quick, str):
        return 1 if quick == "full" else 0
    return 0 if quick else 1

_LR = 0.01
_CLASSES = 10


def _get(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"baseline: unknown model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[name]


# ----------------------------------------------------------------------------- builders

def _jax_model(spec: ModelSpec, quick: bool | str):
    import jaxmem.models as jm

    f = spec.family
    if f == "convchain":
        return jm.ConvChain(depth=8, channels=8, relu=True)
    if f == "mlp":
        return jm.MLP(features=(1024, 1024, 1024, _CLASSES), activation="gelu")
    if f == "vgg16":
        return jm.vgg16(width=0.25, num_classes=_CLASSES)
    if f == "resnet18":
        return jm.resnet18(width=0.25, num_classes=_CLASSES, stem="cifar")
    if f == "resnet50":
        return jm.resnet50(width=0.25, num_classes=_CLASSES, stem="cifar")
    if f == "gpt":
        from jaxmem.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab=512, ctx=64, d_model=128, n_head=4, n_layer=4))
    if f == "vit":
        from jaxmem.models.vit import vit_tiny

        return vit_tiny(image_size=32, patch_size=4, num_classes=_CLASSES,
                        n_layer=6 if _ix(quick) else 2)
    raise AssertionError(f)


def _torch_model(spec: ModelSpec, quick: bool | str):
    import torch_ref.models as tm

    f = spec.family
    if f == "convchain":
        return tm.ConvChain(8, 8, relu=True)
    if f == "mlp":
        return tm.MLP(spec.size[_ix(quick)], features=(1024, 1024, 1024, _CLASSES),
                      activation="gelu")
    if f == "vgg16":
        return tm.vgg16(width=0.25, num_classes=_CLASSES)
    if f == "resnet18":
        return tm.resnet18(width=0.25, num_classes=_CLASSES, stem="cifar")
    if f == "resnet50":
        return tm.resnet50(width=0.25, num_classes=_CLASSES, stem="cifar")
    if f == "gpt":
        from jaxmem.models.gpt import GPTConfig
        from torch_ref.models.gpt import GPT

        return GPT(GPTConfig(vocab=512, ctx=64, d_model=128, n_head=4, n_layer=4))
    if f == "vit":
        from torch_ref.models.vit import vit_tiny

        return vit_tiny(image_size=32, patch_size=4, num_classes=_CLASSES,
                        n_layer=6 if _ix(quick) else 2)
    raise AssertionError(f)


def _batch(spec: ModelSpec, quick: bool | str, seed: int = 0):
    """numpy (x, y) in JAX layout (NHWC images)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = spec.batch[_ix(quick)]
    s = spec.size[_ix(quick)]
    f = spec.family
    if f == "convchain":
        x = rng.standard_normal((n, s, s, 8), dtype=np.float32)
        y = rng.standard_normal((n, s, s, 8), dtype=np.float32)
    elif f == "mlp":
        x = rng.standard_normal((n, s), dtype=np.float32)
        y = rng.integers(0, _CLASSES, (n,)).astype(np.int32)
    elif f == "gpt":
        x = rng.integers(0, 512, (n, s)).astype(np.int32)
        y = rng.integers(0, 512, (n, s)).astype(np.int32)
    else:
        x = rng.standard_normal((n, s, s, 3), dtype=np.float32)
        y = rng.integers(0, _CLASSES, (n,)).astype(np.int32)
    return x, y


def _train_kw(spec: ModelSpec) -> bool:
    return spec.family in ("vgg16", "resnet18", "resnet50")


def _fast_init(model, x, seed: int):
    """Variables of the model's shapes, drawn with numpy (memory and time do not depend on the
    values). Flax's own init compiles slowly on CPU (8.6 s of XLA compile for resnet18, eager:
    10 s), which would dominate ``--quick``. Kernels ~ N(0, 1/fan_in), embeddings and other
    free parameters ~ N(0, 0.02^2), norm scales / running variances 1, biases / means 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.key(seed), x)

    def fill(path, sds):
        name = str(getattr(path[-1], "key", path[-1]))
        shape, dtype = sds.shape, sds.dtype
        if name in ("scale", "var"):
            return jnp.ones(shape, dtype)
        if name in ("bias", "mean"):
            return jnp.zeros(shape, dtype)
        if name == "kernel":
            fan_in = int(np.prod(shape[:-1])) or 1
            std = (1.0 / fan_in) ** 0.5
        else:
            std = 0.02
        return jnp.asarray((rng.standard_normal(shape) * std).astype(dtype))

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _jax_parts(spec: ModelSpec, quick: bool | str, seed: int = 0):
    """(loss_fn(params, stats, x, y), step_fn, variables, (x, y)) for JAX."""
    import jax
    import jax.numpy as jnp
    import optax

    model = _jax_model(spec, quick)
    x, y = _batch(spec, quick, seed)
    x, y = jnp.asarray(x), jnp.asarray(y)
    variables = _fast_init(model, x[:1], seed)
    params = variables["params"]
    stats = variables.get("batch_stats", {})
    has_bn = _train_kw(spec)

    def loss_fn(params, stats, x, y):
        v = {"params": params}
        if has_bn:
            v["batch_stats"] = stats
            out, upd = model.apply(v, x, train=True, mutable=["batch_stats"])
            new_stats = upd["batch_stats"]
        else:
            out, new_stats = model.apply(v, x), stats
        if spec.loss == "mse":
            loss = jnp.mean((out - y) ** 2)
        else:
            loss = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        return loss, new_stats

    def step(params, stats, x, y):
        (loss, new_stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y)
        params = jax.tree_util.tree_map(lambda p, gi: p - _LR * gi, params, g)
        return params, new_stats, loss

    return loss_fn, step, {"params": params, "batch_stats": stats}, (x, y)


def _torch_parts(spec: ModelSpec, quick: bool | str, variables=None, seed: int = 0):
    """(model, loss_fn(model, x, y), step(), (x, y)) for torch; loads ``variables`` if given."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = _torch_model(spec, quick)
    if variables is not None:
        from torch_ref.convert import jax_to_torch

        v = {"params": variables["params"]}
        if variables.get("batch_stats"):
            v["batch_stats"] = variables["batch_stats"]
        jax_to_torch(v, model)
    model.train()
    x, y = _batch(spec, quick, seed)
    if x.ndim == 4:
        x = np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))
    if y.ndim == 4:
        y = np.ascontiguousarray(np.transpose(y, (0, 3, 1, 2)))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    if yt.dtype == torch.int32:
        yt = yt.long()
    if xt.dtype == torch.int32:
        xt = xt.long()

    def loss_fn(m, x, y):
        out = m(x)
        if spec.loss == "mse":
            return torch.mean((out - y) ** 2)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        # plain SGD, as torch.optim.SGD(lr) without momentum would do (torch.optim is not
        # used: importing it pulls in torch._dynamo, 3 s per fresh process)
        loss = loss_fn(model, xt, yt)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-_LR)
                p.grad = None  # between steps only the parameters stay resident
        return loss.detach()

    return model, loss_fn, step, (xt, yt)


# ------------------------------------------------------ peak-memory targets (subprocess)

def jax_step(name: str, quick: bool | str) -> Callable[[], Any]:
    """``peak_memory`` target: a zero-arg callable running one jitted JAX train step."""
    import jax

    _, step, v, (x, y) = _jax_parts(_get(name), quick)
    f = jax.jit(step)
    state = [v["params"], v["batch_stats"]]

    def run():
        p, s, loss = f(state[0], state[1], x, y)
        state[0], state[1] = p, s
        return loss

    return run


def torch_step(name: str, quick: bool | str) -> Callable[[], Any]:
    """``peak_memory`` target: a zero-arg callable running one eager torch train step."""
    _, _, step, _ = _torch_parts(_get(name), quick)
    return step


# ------------------------------------------------------------- step-time ratio (subprocess)

_TIME_MARK = "JAXMEM_TIME_RESULT "
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}


def _time_main() -> None:
    """Child of :func:`step_time_ratios`: spec JSON on stdin, result line on stdout."""
    import json
    import os
    import sys

    # one core for both frameworks (same XLA compile options as the parent, so the shared
    # compilation cache hits; torch with one intra-op thread)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax
    import torch

    torch.set_num_threads(1)
    spec = json.loads(sys.stdin.read())
    out = {}
    for name in spec["names"]:
        j = jax_step(name, spec["quick"])
        t = torch_step(name, spec["quick"])
        jax.block_until_ready(j())
        t()
        tj, tt = [], []
        for _ in range(spec["repeats"]):  # interleaved
            t0 = time.perf_counter()
            jax.block_until_ready(j())
            tj.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            t()
            tt.append(time.perf_counter() - t0)
        out[name] = {"jax_s": statistics.median(tj), "torch_s": statistics.median(tt),
                     "jax_min_s": min(tj), "torch_min_s": min(tt)}
        del j, t
    sys.stdout.write("\n" + _TIME_MARK + json.dumps(out) + "\n")


def step_time_ratios(names: list[str], quick: bool | str, repeats: int = 5,
                     timeout: float = 600.0) -> dict[str, dict[str, float]]:
    """Median train-step times of both frameworks, measured interleaved in ONE fresh process
    pinned to one CPU core (``sched_setaffinity``; torch with one intra-op thread). One core
    keeps the ratio stable on a loaded machine (torch's 2-thread OpenMP steps were up to 5x
    slower under contention); multi-core ratios can differ."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.update(_SINGLE_THREAD_ENV)
    code = "from jaxmem.bench.baseline import _time_main; _time_main()"
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          input=json.dumps({"names": names, "quick": quick,
                                            "repeats": repeats}),
                          timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_TIME_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError("baseline: step-time child failed:\n" + proc.stderr[-3000:])
    return json.loads(lines[-1][len(_TIME_MARK):])


@contextlib.contextmanager
def _shared_compilation_cache():
    """A temporary persistent XLA compilation cache shared by this process and the measuring
    subprocesses (they compile the same train steps; a hit saves seconds per model). The
    previous JAX settings and environment are restored on exit."""
    import os
    import shutil
    import tempfile

    import jax

    d = tempfile.mkdtemp(prefix="jaxmem-bench-xla-")
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old_cfg = {k: getattr(jax.config, k) for k in keys}
    env = {"JAX_COMPILATION_CACHE_DIR": d, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    old_env = {k: os.environ.get(k) for k in env}
    try:
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        os.environ.update(env)
        yield d
    finally:
        for k, v in old_cfg.items():
            jax.config.update(k, v)
        # the cache object was initialised on the temporary folder: drop it, or later
        # compilations keep writing into the folder removed below (noisy warnings)
        try:
            from jaxmem._compat import compilation_cache as _cc

            _cc.reset_cache()
        except Exception:  # noqa: BLE001 - private API; only the warnings depend on it
            pass
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- section

COLUMNS = [
    "model", "params", "batch", "jax_saved", "torch_saved", "torch/jax saved",
    "jax_temp", "jax_total", "jax_peak", "torch_peak", "torch/jax time",
    "loss_rdiff",
]
UNITS = {
    "params": "B", "jax_saved": "B", "torch_saved": "B", "torch/jax saved": "x",
    "jax_temp": "B", "jax_total": "B", "jax_peak": "B", "torch_peak": "B",
    "torch/jax time": "x",
}


def columns_for(targets=("cpu",)) -> list[str]:
    """:data:`COLUMNS` with the compiled columns once per target (GPU plans first)."""
    from jaxmem.bench.targets import check_targets, grouped_columns

    targets = check_targets(targets)
    i = COLUMNS.index("jax_temp")
    return COLUMNS[:i] + grouped_columns(targets, ["jax_temp", "jax_total"]) + COLUMNS[i + 2:]


def measure_model(name: str, quick: bool | str, peak: bool = True,
                  progress: Callable[[str], None] | None = None, targets=("cpu",),
                  log=None) -> dict[str, Any]:
    """All baseline figures for one model (a row of the table); compiled bytes once per
    target of ``targets`` (``<prefix>jax_temp`` / ``<prefix>jax_total``)."""
    import jax
    import torch

    from jaxmem.bench.targets import GemmLog, check_targets, prefix
    from jaxmem.measure import peak_memory, residual_bytes
    from torch_ref.measure import saved_bytes

    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    say = progress or (lambda _m: None)
    spec = _get(name)
    loss_fn, step, v, (x, y) = _jax_parts(spec, quick)
    params, stats = v["params"], v["batch_stats"]
    n_params = sum(int(p.nbytes) for p in jax.tree_util.tree_leaves(params))
    row: dict[str, Any] = {"model": name, "params": n_params, "batch": int(x.shape[0])}

    say(f"{name}: residual bytes")
    rep = residual_bytes(lambda p, s, x, y: loss_fn(p, s, x, y)[0], params, stats, x, y)
    row["jax_saved"] = rep.activation_bytes
    model, tloss, tstep, (xt, yt) = _torch_parts(spec, quick, variables=v)
    srep = saved_bytes(tloss, model, xt, yt)
    row["torch_saved"] = srep.activation_bytes
    row["torch/jax saved"] = (srep.activation_bytes / rep.activation_bytes
                              if rep.activation_bytes else None)
    with torch.no_grad():
        lt = float(tloss(model, xt, yt))

    for tgt in targets:  # CPU last (check_targets' order): the jit call below reuses it
        say(f"{name}: compiled bytes ({tgt})")
        cm = log.compiled(step, params, stats, x, y, target=tgt, what=name)
        row[f"{prefix(tgt)}jax_temp"] = cm.temp_bytes
        row[f"{prefix(tgt)}jax_total"] = cm.total_bytes
    # the step returns the loss before its update; this call reuses the compilation cache
    lj = float(jax.jit(step)(params, stats, x, y)[2])
    row["loss_rdiff"] = abs(lj - lt) / max(abs(lt), 1e-30)

    del model, tstep
    if peak:
        say(f"{name}: measured peak (JAX subprocess)")
        row["jax_peak"] = peak_memory("jaxmem.bench.baseline:jax_step", name, quick,
                                      backend="jax").peak_bytes
        say(f"{name}: measured peak (torch subprocess)")
        row["torch_peak"] = peak_memory("jaxmem.bench.baseline:torch_step", name, quick,
                                        backend="torch", env=_ONE_THREAD).peak_bytes
    else:
        row["jax_peak"] = row["torch_peak"] = None
    return row


def run(quick: bool = False, models: list[str] | None = None,
        progress: Callable[[str], None] | None = None, peak: bool | None = None, *,
        preset: str | None = None, targets=("cpu",)) -> Section:
    """The baseline section (see module docstring), compiled bytes on every target of
    ``targets``.

    ``preset`` (default: ``"quick"`` if ``quick`` else ``"full"``; :data:`PRESET_SIZES`):
    ``"quick"`` runs :data:`QUICK_MODELS` at their small batches with 3 timing repeats;
    ``"default"`` (``jaxmem bench``) every model but resnet50 at the same small sizes,
    5 repeats;
    ``"full"`` (``jaxmem bench --full``) every model at its full size, 15 repeats.
    ``peak`` (default: the preset's) measures the CPU peaks in subprocesses.
    """
    import jax
    import torch

    from jaxmem.bench.targets import (
        GemmLog,
        check_targets,
        resolve_preset,
        target_meta,
        target_notes,
    )

    preset = resolve_preset(quick, preset)
    targets = check_targets(targets)
    P = PRESET_SIZES[preset]
    peak = P["peak"] if peak is None else peak
    log = GemmLog()
    names = list(models) if models else list(P["models"])
    for n in names:
        _get(n)
    rows = []
    with _shared_compilation_cache():
        for n in names:
            rows.append(measure_model(n, preset, peak=peak, progress=progress,
                                      targets=targets, log=log))
        if progress:
            progress("step time, both frameworks in one process")
        times = step_time_ratios(names, preset, repeats=P["repeats"])
    for row in rows:
        t = times[row["model"]]
        row["torch/jax time"] = t["torch_min_s"] / t["jax_min_s"]
        row["jax_step_s_min"] = t["jax_min_s"]
        row["torch_step_s_min"] = t["torch_min_s"]
        row["torch/jax time (median)"] = t["torch_s"] / t["jax_s"]
    notes = [
        ("jax_saved: jaxmem.measure.residual_bytes of the loss w.r.t. all params, activation "
        "residuals only (jaxpr level, before XLA); torch_saved: torch_ref.measure.saved_bytes "
        "(saved-tensor hooks, deduplicated by storage), activations only. Params and the batch "
        "are excluded from both."),
        ("jax_temp / jax_total: XLA memory_analysis() of the jitted SGD train step; total = temp + "
        "output + argument - alias (no donation)."),
        ("jax_peak / torch_peak: CPU VmHWM delta of one train step after warm-up, each in a "
        "fresh subprocess (jaxmem.measure.peak_memory); includes gradients and new params."),
        ("torch/jax time: ratio of the fastest of the interleaved train steps of each framework "
        "(torch eager, JAX jitted), both in one fresh process pinned to one CPU core; >1 means "
        "torch is slower. Times are noisy; only this ratio is reported (the JSON also has the "
        "ratio of medians)."),
        ("Both frameworks run the same weights (torch_ref.convert.jax_to_torch); loss_rdiff = "
        "|loss_jax - loss_torch| / |loss_torch| is the check."),
        (f"preset {preset}: {', '.join(names)} at "
         f"{'full' if P['sizes'] else 'small'} sizes (batch "
         f"{', '.join(str(MODELS[n].batch[P['sizes']]) for n in names)}), "
         f"{P['repeats']} timing repeats."),
        *target_notes(targets, log, cpu_only="saved bytes are framework-level; time ratios "
                                             "and measured peaks"),
    ]
    meta = {
        "quick": preset == "quick",
        "preset": preset,
        "models": {n: dataclasses.asdict(MODELS[n]) for n in names},
        "jax": jax.__version__,
        "torch": torch.__version__,
        "backend": jax.default_backend(),
        "plots": [
            {"x": "model", "y": ["jax_saved", "torch_saved"],
             "title": "activation bytes kept for backward (JAX default vs PyTorch default)",
             "file": "baseline_residuals.png"},
            {"x": "model", "y": ["jax_temp", "jax_peak", "torch_peak"],
             "title": "compiled temp (JAX) and measured CPU peak of one train step",
             "file": "baseline_peak.png"},
        ],
        **target_meta(targets, log),
    }
    gpus = [t for t in targets if t != "cpu"]
    if gpus:
        meta["plots"].append(
            {"x": "model", "y": [f"{t}_jax_temp" for t in gpus] + ["jax_temp"],
             "title": "compiled temp of the JAX train step: GPU plan(s) vs XLA:CPU",
             "file": "baseline_plans.png"})
    return Section(
        name="baseline",
        title="Baseline: JAX default vs PyTorch default (one SGD train step)",
        columns=columns_for(targets),
        rows=rows,
        units={**UNITS, **{f"{t}_{c}": "B" for t in gpus for c in ("jax_temp", "jax_total")}},
        notes=notes,
        meta=meta,
    )
