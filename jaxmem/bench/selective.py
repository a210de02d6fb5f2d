"""`jaxmem bench` section for jaxmem.selective.

Two tables in one Section:

* the paper's Figure 1: a linear chain of ``depth`` size-preserving 3x3 convolutions
  (``jaxmem.models.ConvChain(relu=False)``), cases all / none / layer 4 / layers 4+
  differentiable. For JAX default (grad w.r.t. the differentiable kernels only) and jaxmem
  (the converted model, same gradient request): residual activation bytes and compiled
  bytes (temp + output), with PyTorch default and ``torch_ref.memsave`` saved bytes next to
  them when torch is installed;
* the paper's cases All / Input / Conv / Norm (+ BN-eval = Input case in eval mode,
  surgical first/last quarter) on ResNet-18 (and, non-quick, ResNet-50 and VGG-11-BN) at a
  CPU-sized batch: compiled bytes of JAX default vs jaxmem, torch saved bytes, and the
  step-time ratio jaxmem / JAX default (interleaved repeats, median).

Memory figures are deterministic; time is a ratio measured side by side.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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

CASES = ("all", "input", "conv", "norm", "bn_eval", "first_quarter", "last_quarter")


def _convert(model):
    """The selective part of :func:`jaxmem.linen.convert` (exact; no attention)."""
    from jaxmem import linen
    return linen.convert(model, attention=False)


# ------------------------------------------------------------------------ case filters

def _layer_paths(params) -> list[str]:
    from jaxmem.selective.subset import path_str
    out = []
    for p, _ in jax.tree_util.tree_leaves_with_path(params):
        s = path_str(p).rsplit("/", 1)[0]
        if s not in out:
            out.append(s)
    return out


def case_filter(case: str, params):
    """``trainable`` filter (for ``jaxmem.selective.subset``) of a paper case; ``None`` for
    the Input case (only the network input is differentiated)."""
    from jaxmem.selective.subset import path_str
    if case in ("input", "bn_eval"):
        return None
    if case == "all":
        return True
    if case == "conv":
        return lambda p, _: "conv" in path_str(p).rsplit("/", 1)[0].rsplit("/", 1)[-1]
    if case == "norm":
        return lambda p, _: "bn" in path_str(p).rsplit("/", 1)[0].rsplit("/", 1)[-1]
    layers = _layer_paths(params)
    q = max(1, len(layers) // 4)
    chosen = set(layers[:q] if case == "first_quarter" else layers[-q:])
    return lambda p, _: path_str(p).rsplit("/", 1)[0] in chosen

def torch_requires_grad(case: str, torch_model, jax_params) -> None:
    """Set ``requires_grad`` on the torch twin's parameters for a case (same names)."""
    from jaxmem.selective.subset import path_str, trainable_mask
    flt = case_filter(case, jax_params)
    mask = {} if flt is None else {
        path_str(p): m for p, m in jax.tree_util.tree_leaves_with_path(
            trainable_mask(jax_params, flt))}
    torch_names = {}
    for name, prm in torch_model.named_parameters():
        torch_names[name] = prm
    for name, prm in torch_names.items():
        key = _torch_to_jax_name(name, set(mask))
        prm.requires_grad_(bool(mask.get(key, False)))


def _torch_to_jax_name(name: str, jax_names: set[str]) -> str:
    parts = name.split(".")
    leaf = {"weight": ("kernel", "scale"), "bias": ("bias",)}.get(parts[-1], (parts[-1],))
    base = "/".join(parts[:-1])
    for cand in leaf:
        full = f"{base}/{cand}" if base else cand
        if full in jax_names:
            return full
    # fall back: join module path with underscores (e.g. layer1.0 -> layer1_0)
    base2 = "_".join(parts[:-1])
    for cand in leaf:
        for b in (base2, base.replace("/", "_")):
            if f"{b}/{cand}" in jax_names:
                return f"{b}/{cand}"
    return name


# ------------------------------------------------------------------------- JAX steps
def _case_loss(model, variables, train: bool) -> Callable:
    """``loss(params, x) = mean(model(x)**2)`` with the non-param collections held fixed
    (BatchNorm in train mode when ``train``; its updated statistics are discarded)."""
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params, x):
        v = {"params": params, **rest}
        if "batch_stats" in rest:
            out = model.apply(v, x, train=train, mutable=["batch_stats"] if train else False)
            y = out[0] if train else out
        else:
            y = model.apply(v, x)
        return jnp.mean(jnp.square(y))

    return loss


def make_step(model, variables, case: str, *, train_bn: bool = True):
    """``f(params, x) -> grads`` for a case. ``model`` is a Linen model, converted
    (``jaxmem.linen.convert``) or not; only the case's leaves are differentiated."""
    from jaxmem.selective.subset import grad as sgrad
    loss = _case_loss(model, variables, train=train_bn and case != "bn_eval")

    flt = case_filter(case, variables["params"])
    if flt is None:
        return lambda params, x: jax.grad(loss, argnums=1)(params, x)
    return lambda params, x: sgrad(loss, trainable=flt)(params, x)


def jax_bytes(step: Callable, params, x, target: str = "cpu", log: GemmLog | None = None,
              what: str = "") -> dict:
    """Compiled temp+output bytes of ``step`` on ``target`` (``"cpu"`` or a GPU plan)."""
    c = (log or GemmLog()).compiled(step, params, x, target=target, what=what)
    return {"compiled": int(c.temp_bytes + c.output_bytes), "gemm": c.gemm_backend}


def residual_activation_bytes(model, variables, case, x) -> int:
    """Residual bytes (activations only) of the forward w.r.t. what the case differentiates."""
    from jaxmem.measure import residual_bytes
    from jaxmem.selective.subset import combine, partition
    fwd = _case_loss(model, variables, train=case != "bn_eval")

    flt = case_filter(case, variables["params"])
    if flt is None:
        return residual_bytes(fwd, variables["params"], x, argnums=1).activation_bytes
    t, f = partition(variables["params"], flt)
    return residual_bytes(lambda t_, x: fwd(combine(t_, f), x), t, x,
                          argnums=0).activation_bytes


def time_ratio(fa: Callable, fb: Callable, args, repeats: int = 5) -> float:
    """median(time fb) / median(time fa), interleaved, after one warm-up each."""
    ja, jb = jax.jit(fa), jax.jit(fb)
    jax.block_until_ready(ja(*args))
    jax.block_until_ready(jb(*args))
    ta, tb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter(); jax.block_until_ready(ja(*args)); ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); jax.block_until_ready(jb(*args)); tb.append(time.perf_counter() - t0)
    return statistics.median(tb) / statistics.median(ta)


# ------------------------------------------------------------------------ torch side
def torch_saved_bytes(torch_model, case: str, x_nchw, *, memsave: bool,
                      jax_params) -> int | None:
    try:
        import torch

        from torch_ref import memsave as ms
        from torch_ref.measure import saved_bytes
    except ImportError:  # pragma: no cover
        return None
    m = ms.convert(torch_model) if memsave else torch_model
    m.train(case != "bn_eval")
    torch_requires_grad(case, m, jax_params)
    xt = torch.as_tensor(x_nchw).clone().requires_grad_(case in ("input", "bn_eval"))

    def fwd(inp):
        return (m(inp) ** 2).mean()

    rep = saved_bytes(fwd, xt)
    return int(rep.activation_bytes)


# ------------------------------------------------------------------------ figure 1
FIG1_CASES = {
    "all": lambda d: set(range(d)),
    "none": lambda d: set(),
    "layer4": lambda d: {3},
    "layers4+": lambda d: set(range(3, d)),
}


def figure1_rows(depths=(5, 10), channels=8, batch=4, size=32, torch_too=True,
                 targets=("cpu",), log: GemmLog | None = None, cases=tuple(FIG1_CASES)):
    """Rows for the Figure-1 chain (linear convs, input differentiated, as the paper).
    Compiled bytes on every target of ``targets`` (columns ``<prefix>jax_compiled``, ...)."""
    from jaxmem import models
    from jaxmem.measure import residual_bytes
    from jaxmem.selective.subset import combine, partition, path_str
    rows = []
    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    x = jax.random.normal(jax.random.key(0), (batch, size, size, channels))
    act = batch * size * size * channels * 4
    for depth in depths:
        model = models.ConvChain(depth=depth, channels=channels, relu=False)
        params = model.init(jax.random.key(1), x)["params"]
        tm = None
        if torch_too:
            try:
                import torch

                from torch_ref import convert as tconv
                from torch_ref import models as tmodels
                tm = tmodels.ConvChain(depth, channels, relu=False)
                tconv.jax_to_torch({"params": params}, tm)
            except ImportError:  # pragma: no cover
                tm = None
        for case, which in FIG1_CASES.items():
            if case not in cases:
                continue
            layers = which(depth)
            flt = lambda p, _, L=layers: int(path_str(p).split("/")[0].split("_")[1]) in L
            row = {"table": "figure1", "depth": depth, "case": case,
                   "layer_input_bytes": act}
            for impl, m in (("jax", model), ("jaxmem", _convert(model))):
                t, f = partition(params, flt)
                fwd = lambda t_, x, m=m, f=f: jnp.sum(m.apply({"params": combine(t_, f)}, x))
                # the paper differentiates the input too (it has requires_grad upstream)
                an = (0, 1) if jax.tree_util.tree_leaves(t) else (1,)
                rb = residual_bytes(fwd, t, x, argnums=an).activation_bytes
                step = lambda t_, x, fwd=fwd: jax.grad(fwd, (0, 1))(t_, x)
                row[f"{impl}_residual"] = int(rb)
                for tgt in targets:
                    cb = log.compiled(step, t, x, target=tgt,
                                      what=f"figure1 depth {depth} {case} {impl}")
                    row[f"{prefix(tgt)}{impl}_compiled"] = int(cb.temp_bytes + cb.output_bytes)
            if tm is not None:
                import torch

                from torch_ref import memsave as ms
                from torch_ref.measure import saved_bytes
                xt = torch.as_tensor(np.array(x)).permute(0, 3, 1, 2).contiguous()
                for impl, m in (("torch", tm), ("memsave", ms.convert(tm))):
                    for i, (name, prm) in enumerate(m.named_parameters()):
                        prm.requires_grad_(int(name.split(".")[0].split("_")[1]) in layers)
                    xi = xt.clone().requires_grad_(True)
                    row[f"{impl}_saved"] = int(
                        saved_bytes(lambda inp, m=m: m(inp).sum(), xi).activation_bytes)
            rows.append(row)
    return rows


# -------------------------------------------------------------------------- CNN cases
def cnn_models(quick: bool):
    from jaxmem import models
    out = {"resnet18": (lambda: models.resnet18(width=0.25, num_classes=10),
                        "resnet18", dict(width=0.25, num_classes=10))}
    if not quick:
        out["resnet50"] = (lambda: models.resnet50(width=0.25, num_classes=10), "resnet50",
                           dict(width=0.25, num_classes=10))
        out["vgg11_bn"] = (lambda: models.vgg11(width=0.25, batch_norm=True, num_classes=10),
                           "vgg11", dict(width=0.25, batch_norm=True, num_classes=10))
    return out


def cnn_rows(quick: bool, models_=None, progress=None, batch=8, size=64, torch_too=True,
             timing=True, cases=CASES, targets=("cpu",), log: GemmLog | None = None,
             repeats=None):
    """Rows of the paper's cases on the CNNs of :func:`cnn_models` (``quick``: ResNet-18
    only). Compiled bytes on every target of ``targets``; residual and torch saved bytes
    (target-independent) and the CPU step-time ratio once per case."""
    targets = check_targets(targets)
    log = log if log is not None else GemmLog()
    rows = []
    specs = cnn_models(quick)
    if models_:
        specs = {k: v for k, v in specs.items() if k in models_}
    x = jax.random.normal(jax.random.key(0), (batch, size, size, 3))
    for name, (ctor, tname, tkw) in specs.items():
        model = ctor()
        variables = model.init(jax.random.key(1), x, train=False)
        tm = None
        if torch_too:
            try:
                import torch_ref.models as tmodels
                from torch_ref import convert as tconv
                tm = getattr(tmodels, tname)(**tkw)
                tconv.jax_to_torch(variables, tm)
            except ImportError:  # pragma: no cover
                tm = None
        for case in cases:
            if progress:
                progress(f"selective: {name} {case}")
            sj = make_step(model, variables, case)
            ss = make_step(_convert(model), variables, case)
            row = {"table": "cnn", "model": name, "case": case,
                   "batch": f"{batch}x{size}x{size}"}
            # CPU last: its compile is reused by the timing below (jit's cache)
            for tgt in targets:
                pre = prefix(tgt)
                bj = jax_bytes(sj, variables["params"], x, tgt, log, f"{name} {case} jax")
                bs = jax_bytes(ss, variables["params"], x, tgt, log, f"{name} {case} jaxmem")
                row[f"{pre}jax_compiled"] = bj["compiled"]
                row[f"{pre}jaxmem_compiled"] = bs["compiled"]
                row[f"{pre}ratio"] = bs["compiled"] / bj["compiled"]
            row["jax_residual"] = residual_activation_bytes(model, variables, case, x)
            row["jaxmem_residual"] = residual_activation_bytes(_convert(model), variables,
                                                               case, x)
            if tm is not None:
                xn = jax.device_get(x).transpose(0, 3, 1, 2).copy()
                row["torch_saved"] = torch_saved_bytes(tm, case, xn, memsave=False,
                                                       jax_params=variables["params"])
                row["memsave_saved"] = torch_saved_bytes(tm, case, xn, memsave=True,
                                                         jax_params=variables["params"])
            if timing:
                row["time_ratio"] = time_ratio(sj, ss, (variables["params"], x),
                                               repeats=repeats or (3 if quick else 9))
            rows.append(row)
    return rows


# ------------------------------------------------------------- slope and measured peak
PEAK_CASES = ("input", "all")


def _build(name: str, batch: int, size: int):
    ctor, tname, tkw = cnn_models(False)[name]
    model = ctor()
    x = jax.random.normal(jax.random.key(0), (batch, size, size, 3))
    variables = model.init(jax.random.key(1), x, train=False)
    return model, variables, x, tname, tkw


def peak_step_jax(name: str, case: str, impl: str, batch: int, size: int):
    """Target for :func:`jaxmem.measure.peak_memory`: the jitted gradient step of ``case`` on
    CNN ``name`` (``impl``: ``'jax'`` or ``'jaxmem'``), bound to its inputs."""
    model, variables, x, _, _ = _build(name, batch, size)
    m = _convert(model) if impl == "jaxmem" else model
    f = jax.jit(make_step(m, variables, case))
    params = variables["params"]
    del variables
    return lambda: f(params, x)


def peak_step_torch(name: str, case: str, impl: str, batch: int, size: int):
    """Target for :func:`torch_ref.measure.peak_memory`: forward + backward of ``case`` on the
    torch twin (``impl``: ``'torch'`` or ``'memsave'``); ``.grad`` reset to ``None`` every
    step so the gradients are allocated inside the step, as JAX's outputs are."""
    import torch

    import torch_ref.models as tmodels
    from torch_ref import memsave as ms
    _, tname, tkw = cnn_models(False)[name]
    torch.manual_seed(0)
    m = getattr(tmodels, tname)(**tkw)
    if impl == "memsave":
        m = ms.convert(m)
    m.train(True)
    for p_ in m.parameters():
        p_.requires_grad_(case == "all")
    x = torch.randn(batch, 3, size, size).requires_grad_(case == "input")

    def step():
        for p_ in m.parameters():
            p_.grad = None
        x.grad = None
        loss = (m(x) ** 2).mean()
        loss.backward()
        return loss.detach()

    return step


def slope_rows(models_=("resnet18", "resnet50"), batches=(8, 32), size=64, cases=PEAK_CASES,
               peak=True, torch_too=True, progress=None):
    """Per-image cost: compiled bytes (JAX, jaxmem), saved bytes (PyTorch, memsave) and the
    measured process peak (fresh subprocess, VmHWM delta) at two batch sizes, and the slope
    ``(bytes(b2) - bytes(b1)) / (b2 - b1)`` in bytes per extra image."""
    from jaxmem.measure import compiled_memory, peak_memory
    b1, b2 = batches
    rows = []
    for name in models_:
        for case in cases:
            if progress:
                progress(f"selective: slope {name} {case}")
            row = {"table": "per_image", "model": name, "case": case,
                   "batches": f"{b1},{b2}x{size}x{size}"}
            for b in batches:
                model, variables, x, tname, tkw = _build(name, b, size)
                for impl, m in (("jax", model), ("jaxmem", _convert(model))):
                    c = compiled_memory(make_step(m, variables, case), variables["params"], x)
                    row[f"{impl}_compiled@{b}"] = int(c.temp_bytes + c.output_bytes)
                    row[f"{impl}_residual@{b}"] = int(
                        residual_activation_bytes(m, variables, case, x))
                if torch_too:
                    try:
                        import torch_ref.models as tmodels
                        from torch_ref import convert as tconv
                        tm = getattr(tmodels, tname)(**tkw)
                        tconv.jax_to_torch(variables, tm)
                        xn = jax.device_get(x).transpose(0, 3, 1, 2).copy()
                        for impl, ms_ in (("torch", False), ("memsave", True)):
                            row[f"{impl}_saved@{b}"] = torch_saved_bytes(
                                tm, case, xn, memsave=ms_, jax_params=variables["params"])
                    except ImportError:  # pragma: no cover
                        pass
                if peak:
                    for impl in ("jax", "jaxmem"):
                        r = peak_memory(peak_step_jax, name, case, impl, b, size)
                        row[f"{impl}_peak@{b}"] = int(r.peak_bytes)
                    if torch_too:
                        from torch_ref.measure import peak_memory as tpeak
                        for impl in ("torch", "memsave"):
                            r = tpeak(peak_step_torch, name, case, impl, b, size)
                            row[f"{impl}_peak@{b}"] = int(r.peak_bytes)
            for key in list(row):
                if key.endswith(f"@{b1}") and f"{key[:-len(str(b1))]}{b2}" in row:
                    base = key[: -len(f"@{b1}")]
                    row[f"{base}/img"] = (row[f"{base}@{b2}"] - row[key]) / (b2 - b1)
            rows.append(row)
    return rows


def slope_section(rows, meta=None) -> Section:
    cols = ["model", "case", "batches"]
    order = (("residual", ("jax", "jaxmem")), ("saved", ("torch", "memsave")),
             ("compiled", ("jax", "jaxmem")), ("peak", ("jax", "jaxmem", "torch", "memsave")))
    for metric, impls in order:
        for impl in impls:
            pre = f"{impl}_{metric}@"
            cols += sorted({k for r in rows for k in r if k.startswith(pre)},
                           key=lambda k: int(k.split("@")[1]))
            cols.append(f"{impl}_{metric}/img")
    cols = [c for c in cols if any(c in r for r in rows)]
    for r in rows:
        j, s = r.get("jax_compiled/img"), r.get("jaxmem_compiled/img")
        r["slope_ratio"] = s / j if j else None
        pj, ps = r.get("jax_peak/img"), r.get("jaxmem_peak/img")
        r["peak_slope_ratio"] = ps / pj if pj and ps is not None else None
    cols += ["slope_ratio", "peak_slope_ratio"]
    units = {c: "B" for c in cols if "@" in c or c.endswith("/img")}
    units.update(slope_ratio="x", peak_slope_ratio="x")
    return Section(
        name="selective_per_image",
        title="jaxmem.selective: per-image cost (slope in batch size) and measured peak",
        columns=cols, rows=rows, units=units,
        notes=[
            "X@b = bytes at batch b; X/img = (X@b2 - X@b1) / (b2 - b1): the cost of one more "
            "image, free of fixed costs (weights, weight-layout copies, output).",
            "residual = activation bytes JAX autodiff keeps; saved = bytes torch saves for "
            "backward (saved-tensor hooks) -- the same level; compiled = XLA temp+output of "
            "the jitted gradient step (residuals + backward working memory + output); peak = measured process high-water "
            "mark minus baseline in a fresh subprocess (jaxmem.measure.peak_memory / "
            "torch_ref.measure.peak_memory, VmHWM; includes allocator slack, a few MiB of "
            "noise), gradients allocated inside the step for both frameworks.",
            "slope_ratio = jaxmem_compiled/img / jax_compiled/img; peak_slope_ratio = "
            "jaxmem_peak/img / jax_peak/img.",
        ],
        meta=meta or {},
    )


#: per preset: Figure-1 chain (depths, batch, size, torch, cases), CNN models, CNN
#: (batch, size), CNN cases, torch saved bytes, timing repeats (0 = no timing)
PRESET_SIZES = {
    "quick": {"depths": (4, 8), "fig_batch": 2, "fig_size": 16, "fig_torch": False,
              "fig_cases": ("all", "layer4"), "models": ("resnet18",), "batch": 4,
              "size": 32, "cases": ("input",), "torch": False, "repeats": 0},
    "default": {"depths": (5, 10), "fig_batch": 4, "fig_size": 32, "fig_torch": True,
                "fig_cases": ("all", "layer4"), "models": ("resnet18",), "batch": 8,
                "size": 32, "cases": ("all", "input"), "torch": True, "repeats": 5},
    "full": {"depths": (5, 10), "fig_batch": 4, "fig_size": 32, "fig_torch": True,
             "fig_cases": tuple(FIG1_CASES), "models": ("resnet18", "resnet50", "vgg11_bn"),
             "batch": 8, "size": 64, "cases": CASES, "torch": True, "repeats": 9},
}


def run(quick: bool = False, models=None, progress=None, *, preset: str | None = None,
        targets=("cpu",)) -> Section:
    """Figure-1 chain + CNN cases, compiled bytes on every target of ``targets``.

    ``preset`` (default: ``"quick"`` if ``quick`` else ``"full"``; see :data:`PRESET_SIZES`):

    * ``"quick"``: depth 4 & 8 chain (all / layer 4), ResNet-18 (width 0.25) Input case at
      4x32x32, JAX only, no timing;
    * ``"default"`` (``jaxmem bench``): depth 5 & 10 chain (all / layer 4) with torch,
      ResNet-18 (width 0.25) at 8x32x32, cases All / Input, torch, 5 timing repeats;
    * ``"full"`` (``jaxmem bench --full``): depth 5 & 10 chain with torch, ResNet-18 /
      ResNet-50 / VGG-11-BN (width 0.25) at 8x64x64, all seven cases, 9 timing repeats.

    ``models``: a subset of ``resnet18, resnet50, vgg11_bn`` (of those the preset runs).
    """
    preset = resolve_preset(quick, preset)
    targets = check_targets(targets)
    P = PRESET_SIZES[preset]
    log = GemmLog()
    # ``models`` filters the CNNs (names of other sections' models are ignored, as before)
    names = tuple(m for m in cnn_models(False) if m in models) if models else P["models"]
    if progress:
        progress("selective: Figure-1 chain")
    fig = figure1_rows(depths=P["depths"], batch=P["fig_batch"], size=P["fig_size"],
                       torch_too=P["fig_torch"], targets=targets, log=log,
                       cases=P["fig_cases"])
    cnn = cnn_rows(False, names, progress, batch=P["batch"],
                   size=P["size"], timing=P["repeats"] > 0, torch_too=P["torch"],
                   cases=P["cases"], targets=targets, log=log, repeats=P["repeats"] or None)
    compiled = grouped_columns(targets, ["jax_compiled", "jaxmem_compiled", "ratio"])
    columns = (["table", "model", "depth", "case", "batch"] + compiled
               + ["jax_residual", "jaxmem_residual", "torch_saved", "memsave_saved",
                  "time_ratio", "layer_input_bytes"])
    units = {c: "B" for c in columns if c.endswith(("_residual", "_compiled", "_saved",
                                                      "_bytes"))}
    units.update({c: "x" for c in columns if c.endswith("ratio")})
    for r in fig:
        r["batch"] = f"{P['fig_batch']}x{P['fig_size']}x{P['fig_size']}"
        r["torch_saved"] = r.pop("torch_saved", None)
        r["memsave_saved"] = r.pop("memsave_saved", None)
        for tgt in targets:
            pre = prefix(tgt)
            r[f"{pre}ratio"] = r[f"{pre}jaxmem_compiled"] / r[f"{pre}jax_compiled"]
    flag = {"quick": " --quick", "default": "", "full": " --full"}[preset]
    return Section(
        name="selective",
        title="jaxmem.selective: memory of selective differentiation (paper cases)",
        columns=columns,
        rows=fig + cnn,
        units=units,
        notes=[
            "residual = activation bytes autodiff keeps (jaxmem.measure.residual_bytes); "
            "compiled = XLA temp+output bytes of the jitted gradient step; torch_saved / "
            "memsave_saved = bytes saved for backward (saved-tensor hooks, dedup by storage).",
            "JAX default differentiates only the case's leaves (the best plain JAX does); "
            "jaxmem = same request through jaxmem.linen.convert(model, attention=False); "
            "ratio = jaxmem_compiled / jax_compiled.",
            "figure1: linear ConvChain (relu=False), input differentiated as in the paper.",
            "time_ratio = median jaxmem step time / median JAX step time, interleaved (CPU).",
            f"preset {preset}: models {', '.join(names)} (width 0.25) at "
            f"{P['batch']}x{P['size']}x{P['size']}; cases {', '.join(P['cases'])}.",
            *target_notes(targets, log),
        ],
        meta={"quick": preset == "quick", "preset": preset,
              "command": f"jaxmem bench --sections selective{flag} --target "
                         f"{','.join(targets)}",
              "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in P.items()},
              **target_meta(targets, log)},
    )
