"""Compile targets and size presets shared by the ``jaxmem bench`` sections.

Every section measures its *compiled-bytes* figures (XLA's ``memory_analysis()`` of a jitted
step, :func:`jaxmem.measure.compiled_memory`) once per requested target:

* ``"cpu"`` — XLA:CPU, this process's CPU device; its columns keep their historical names
  (``jax_compiled``, ``ratio``, ...);
* a GPU target (``"h100"``, ``"h200"``, ``"a100"``, ...) — XLA:GPU's plan for that GPU,
  compiled here without one (:mod:`jaxmem.measure.target`); its columns carry the target's
  name as a prefix (``h100_jax_compiled``, ``h100_ratio``, ...) and come first in a table.

Residual bytes (jaxpr level) do not depend on the target; time ratios and measured peaks are
taken on this machine's CPU only.

Size presets (``preset``): ``"quick"`` (CI-sized smoke run), ``"default"`` (what ``jaxmem
bench`` runs without flags: a few minutes on 2 CPU cores with the H100 plan beside the CPU)
and ``"full"`` (the sweep behind ``jaxmem bench --full``). A section's ``run(quick=...)``
called without ``preset`` keeps its old meaning: ``quick=True`` is ``"quick"``, ``False``
is ``"full"``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "PRESETS",
    "GemmLog",
    "check_targets",
    "grouped_columns",
    "plan_limits",
    "prefix",
    "resolve_preset",
    "target_meta",
    "target_notes",
]

PRESETS = ("quick", "default", "full")


def resolve_preset(quick: bool, preset: str | None) -> str:
    """The preset a section runs: ``preset`` if given, else ``"quick"`` / ``"full"``."""
    if preset is None:
        return "quick" if quick else "full"
    if preset not in PRESETS:
        raise ValueError(f"preset: must be one of {', '.join(PRESETS)}, got {preset!r}")
    return preset


def check_targets(targets: str | Iterable[str] | None) -> tuple[str, ...]:
    """Validated target names, GPU targets first (in the given order), ``"cpu"`` last.

    Accepts a comma-separated string or an iterable; duplicates are dropped. ``None`` is
    ``("cpu",)``. Raises ``ValueError`` naming the allowed values (``TypeError`` for a
    non-string entry).
    """
    from jaxmem.measure import TARGETS

    if targets is None:
        return ("cpu",)
    if isinstance(targets, str):
        targets = targets.split(",")
    names = []
    for t in targets:
        if not isinstance(t, str):
            raise TypeError(f"targets: each target must be a string, got {t!r}; "
                             f"allowed: {', '.join(TARGETS)}")
        t = t.strip().lower()
        if not t:
            continue
        if t not in TARGETS:
            raise ValueError(f"targets: unknown target {t!r}; allowed: {', '.join(TARGETS)}")
        if t not in names:
            names.append(t)
    if not names:
        raise ValueError(f"targets: no target given; allowed: {', '.join(TARGETS)}")
    return tuple([t for t in names if t != "cpu"] + [t for t in names if t == "cpu"])


def prefix(target: str) -> str:
    """Column prefix of a target: ``""`` for the CPU, ``"h100_"`` for the H100 plan."""
    return "" if target == "cpu" else f"{target}_"


def grouped_columns(targets: Sequence[str], columns: Sequence[str]) -> list[str]:
    """``columns`` once per target (GPU plans first, as :func:`check_targets` orders them)."""
    return [prefix(t) + c for t in targets for c in columns]


def plan_limits() -> str:
    """The caveat written beside every GPU-plan figure."""
    import jax

    return ("GPU plans are XLA:GPU's memory_analysis() compiled on this machine without a GPU "
            "(jaxmem.measure.compiled_memory(target=...)): no autotuning, so cuBLAS/cuDNN "
            "workspaces are not counted and temp is a lower bound; no timing; the plan of the "
            f"XLA in jax {jax.__version__}.")


class GemmLog:
    """Which GEMM backend each GPU-plan compile used (``CompiledMemory.gemm_backend``).

    ``compiled(fn, *args, target=..., what=...)`` wraps :func:`compiled_memory` with
    ``gemm="auto"`` (XLA's Triton GEMMs; cuBLAS where XLA finds no Triton tiling without
    autotuning) and records the backend of every GPU compile.
    """

    def __init__(self) -> None:
        self.used: dict[str, dict[str, list[str]]] = {}

    def compiled(self, fn: Callable[..., Any], *args: Any, target: str = "cpu",
                 what: str = "", **kw: Any):
        from jaxmem.measure import compiled_memory

        cm = compiled_memory(fn, *args, target=target, gemm="auto", **kw)
        self.record(target, cm.gemm_backend, what)
        return cm

    def record(self, target: str, backend: str, what: str = "") -> None:
        if target == "cpu":
            return
        self.used.setdefault(target, {}).setdefault(backend or "?", []).append(what)

    def summary(self) -> dict[str, dict[str, int]]:
        return {t: {b: len(w) for b, w in d.items()} for t, d in self.used.items()}

    def line(self, target: str) -> str:
        d = self.used.get(target, {})
        if not d:
            return f"{target} plan GEMM backend: no compile"
        parts = []
        for b, whats in sorted(d.items(), key=lambda kv: -len(kv[1])):
            named = sorted({w for w in whats if w})
            if b != "triton" and named:
                parts.append(f"{b} for {len(whats)} compile(s) ({', '.join(named)[:200]})")
            else:
                parts.append(f"{b} for {len(whats)} compile(s)")
        return f"{target} plan GEMM backend (gemm='auto'): " + "; ".join(parts)


def target_notes(targets: Sequence[str], log: GemmLog | None = None,
                 cpu_only: str = "time ratios and measured peaks") -> list[str]:
    """Notes naming the targets, the plan's limits and the GEMM backends used."""
    gpus = [t for t in targets if t != "cpu"]
    if not gpus:
        return ["target: cpu only (XLA:CPU compiled bytes)."]
    notes = [
        (f"targets: {', '.join(gpus)} plan (columns {', '.join(prefix(t) + '*' for t in gpus)})"
         + (", cpu (unprefixed columns: XLA:CPU)" if "cpu" in targets else "")
         + f"; residual bytes are target-independent; {cpu_only} are CPU-only."),
        plan_limits(),
    ]
    if log is not None:
        notes += [log.line(t) for t in gpus]
    return notes


def target_meta(targets: Sequence[str], log: GemmLog | None = None) -> dict[str, Any]:
    """What goes into ``Section.meta``: targets, GEMM backends, the plan's limits."""
    import jax

    meta: dict[str, Any] = {"targets": list(targets), "jax": jax.__version__}
    gpus = [t for t in targets if t != "cpu"]
    if gpus:
        meta["gpu_plan"] = {
            "limits": plan_limits(),
            "gemm": "auto",
            "gemm_backends": log.summary() if log is not None else {},
            # which compiles did not get XLA's default Triton GEMMs
            "non_triton_compiles": {} if log is None else {
                t: {b: w for b, w in d.items() if b != "triton"} for t, d in log.used.items()},
        }
    return meta
