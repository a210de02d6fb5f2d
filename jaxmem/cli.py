"""The ``jaxmem`` command.

    jaxmem --version
    jaxmem bench [--quick | --full] [--target cpu,h100] [--models m1,m2] [--sections s1,s2]
                 [--out DIR] [--fail-fast]
    jaxmem bench --list

``jaxmem bench`` runs the benchmark sections registered in :data:`jaxmem.bench.SECTIONS`
(in that order), shows a progress bar, prints each section as a table and writes
``<out>/<name>.json``, ``<out>/<name>.md``, PNG plots where a section asks for them, a
combined ``<out>/report.md`` and ``<out>/summary.json``.

Sizes: ``--quick`` (CI-sized smoke run), the default (a few minutes on 2 CPU cores) or
``--full`` (the whole sweep). Targets: every section measures its compiled bytes on each
target of ``--target`` (default ``cpu,h100``: XLA:GPU's plan for an H100, compiled without a
GPU, beside XLA:CPU; :mod:`jaxmem.bench.targets`). When the GPU-plan plugin is missing, the
default falls back to ``cpu`` with one line saying so; an explicit GPU ``--target`` is a usage
error instead.

Section outcomes and the exit code:

* **ok** — the section ran.
* **failed** — importing or running its module raised. The traceback goes to
  ``<out>/<name>.error.txt``; the remaining sections still run (so one broken technique does
  not hide the others) and the command exits with status **1**. ``--fail-fast`` stops at
  the first failure instead.

Bad usage (unknown section or target, empty model list, ``--quick`` with ``--full``, a GPU
``--target`` without the plugin) exits with status 2.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import inspect
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: ``--target`` when none is given
DEFAULT_TARGETS = "cpu,h100"
# jaxmem.measure.TARGETS, spelled out so that `jaxmem --help` imports no JAX
_TARGETS = ("cpu", "h100", "h100_pcie", "h200", "a100", "b200")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("jaxmem")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return getattr(importlib.import_module("jaxmem"), "__version__", "unknown")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxmem",
        description="jaxmem: train JAX/Flax models in less memory without changing the "
                    "gradients. Memory benchmarks against PyTorch.",
    )
    p.add_argument("--version", action="version", version=f"jaxmem {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser(
        "bench",
        help="run the benchmark sections and write a report",
        description="Run the benchmark sections (JAX default vs PyTorch default, then one "
                    "section per technique) and write JSON + Markdown (+ PNG) reports.",
    )
    b.add_argument("--quick", action="store_true",
                   help="smallest shapes, fewest cases: a CI-sized smoke run")
    b.add_argument("--full", action="store_true",
                   help="the whole sweep (every model and case at full size; long: compiles "
                        "are slow). Default: sizes that finish in about 5 min on 2 CPU cores")
    b.add_argument("--target", "--targets", dest="target", default=None,
                   help="comma-separated compile targets for the compiled-bytes columns, out of "
                        f"{', '.join(_TARGETS)} (default: {DEFAULT_TARGETS}; GPU targets are "
                        "XLA:GPU's plan compiled without a GPU)"),
    b.add_argument("--models", default=None,
                   help="comma-separated model names passed to every section "
                        "(default: each section's own list)")
    b.add_argument("--sections", default=None,
                   help="comma-separated sections to run (default: all; see --list)")
    b.add_argument("--out", default="jaxmem-bench", help="output folder (default: ./jaxmem-bench)")
    b.add_argument("--list", action="store_true", help="list the sections and exit")
    b.add_argument("--fail-fast", action="store_true",
                   help="stop at the first failing section (default: run all, exit 1 at the end)")
    sub.add_parser("plan", add_help=False,
                   help="fit your own training step into a memory budget "
                        "(jaxmem plan module:function --budget 512MiB; see jaxmem plan --help)")
    return p


def _split(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _list(console: Any) -> int:
    from rich.table import Table

    from jaxmem.bench import SECTIONS

    t = Table(title="jaxmem bench sections (run in this order)", title_justify="left")
    t.add_column("section")
    t.add_column("module")
    for name, mod in SECTIONS.items():
        t.add_row(name, mod)
    console.print(t)
    return 0


def _section_kwargs(run: Any, preset: str, targets: tuple[str, ...]) -> dict[str, Any]:
    """Keyword arguments ``run`` accepts beyond ``quick, models, progress``: ``preset`` and
    ``targets`` (a section with the old signature gets neither and measures on the CPU)."""
    try:
        params = inspect.signature(run).parameters
    except (TypeError, ValueError):
        return {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw: dict[str, Any] = {}
    if "preset" in params or var_kw:
        kw["preset"] = preset
    if "targets" in params or var_kw:
        kw["targets"] = targets
    return kw


def _run_section(module: str, preset: str, models: list[str] | None, progress: Any,
                 targets: tuple[str, ...] = ("cpu",)):
    """Import and run one section; returns ``("ok", section, "")``, raises on failure."""
    mod = importlib.import_module(module)
    run = getattr(mod, "run", None)
    if not callable(run):
        raise TypeError(f"{module} has no run(quick, models, progress) function")
    kw = _section_kwargs(run, preset, targets)
    section = run(quick=preset == "quick", models=models, progress=progress, **kw)
    if not (hasattr(section, "to_markdown") and hasattr(section, "rows")):
        raise TypeError(f"{module}.run returned {type(section).__name__}, not a Section")
    if "targets" not in kw and targets != ("cpu",):
        section.notes.append("measured on the CPU only: this section's run() takes no "
                             "`targets`")
    return "ok", section, ""


def _targets(args: argparse.Namespace, console: Any) -> tuple[str, ...] | int:
    """The validated ``--target`` list (GPU plans first), or exit status 2.

    A GPU target without the GPU-plan plugin: with the default ``--target`` one line says so
    and the run goes on with ``cpu``; asked for explicitly, it is a usage error."""
    from rich.markup import escape

    explicit = args.target is not None
    try:
        from jaxmem.bench.targets import check_targets

        targets = check_targets(args.target if explicit else DEFAULT_TARGETS)
    except ValueError as e:
        console.print(f"[red]jaxmem bench: --target: {escape(str(e))}[/red]")
        return 2
    gpus = [t for t in targets if t != "cpu"]
    if not gpus:
        return targets
    reason = _gpu_plan_error()
    if reason is None:
        return targets
    if explicit:
        console.print(f"[red]jaxmem bench: --target {','.join(gpus)} needs the GPU-plan "
                      f"plugin: {escape(reason)}[/red]")
        return 2
    first = reason.splitlines()[0] if reason else "unavailable"
    console.print(f"[yellow]jaxmem bench: no {','.join(gpus)} plan (GPU-plan plugin "
                  f"unavailable: {escape(first)}); measuring on cpu only[/yellow]",
                  soft_wrap=True)
    return ("cpu",)


def _gpu_plan_error() -> str | None:
    """``None`` when GPU targets compile here, else why not."""
    from jaxmem.measure import gpu_plan_available

    if gpu_plan_available():
        return None
    try:
        from jaxmem.measure.target import _cuda_c_api

        _cuda_c_api()
    except Exception as e:  # noqa: BLE001 - the message is what we want
        return str(e) or type(e).__name__
    return "the CUDA PJRT plugin did not load"


def _bench(args: argparse.Namespace, console: Any) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from jaxmem.bench import SECTIONS
    from jaxmem.bench.report import rich_table, write_report, write_section

    if args.list:
        return _list(console)
    names = _split(args.sections)
    if names is None:
        names = list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        console.print(f"[red]jaxmem bench: unknown section(s) {unknown}; allowed: "
                      f"{', '.join(SECTIONS)}[/red]")
        return 2
    models = _split(args.models)
    if models is not None and not models:
        console.print("[red]jaxmem bench: --models is empty[/red]")
        return 2
    if args.quick and args.full:
        console.print("[red]jaxmem bench: --quick and --full exclude each other[/red]")
        return 2
    preset = "quick" if args.quick else "full" if args.full else "default"
    targets = _targets(args, console)
    if isinstance(targets, int):
        return targets
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    started = _dt.datetime.now(_dt.UTC)
    t_all = time.perf_counter()
    cpu_all = _cpu_seconds()
    results: list[dict[str, Any]] = []
    sections: dict[str, Any] = {}
    command = "jaxmem " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0] else "jaxmem bench"
    with Progress(
        SpinnerColumn(), TextColumn("[bold]{task.fields[section]}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=console, transient=False,
    ) as bar:
        task = bar.add_task("", total=len(names), section="")
        for name in names:
            module = SECTIONS[name]
            bar.update(task, section=name, description="starting")

            def progress(msg: str, _name: str = name) -> None:
                bar.update(task, section=_name, description=str(msg)[:70])

            t0, c0 = time.perf_counter(), _cpu_seconds()
            try:
                status, section, reason = _run_section(module, preset, models, progress,
                                                       targets)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - reported, exit code set below
                status, section = "failed", None
                reason = f"{type(e).__name__}: {e}"
                with open(os.path.join(out, f"{name}.error.txt"), "w") as f:
                    f.write(traceback.format_exc())
            seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            results.append({"name": name, "module": module, "status": status,
                            "seconds": seconds, "cpu_seconds": cpu, "reason": reason})
            if section is not None:
                sections[name] = section
                write_section(section, out, extra={"status": status, "seconds": seconds,
                                                   "cpu_seconds": cpu, "quick": args.quick,
                                                   "preset": preset,
                                                   "targets": list(targets),
                                                   "command": command})
                bar.console.print(rich_table(section))
                for n in section.notes:
                    bar.console.print(f"  [dim]- {n}[/dim]")
            else:
                bar.console.print(f"[red]{name}: FAILED — {reason}[/red] "
                                  f"(traceback: {os.path.join(out, name + '.error.txt')})")
            bar.advance(task)
            if status == "failed" and args.fail_fast:
                break
        bar.update(task, section="done", description="")

    total = time.perf_counter() - t_all
    cpu_total = _cpu_seconds() - cpu_all
    header = [
        f"- command: `{command}`",
        (f"- jaxmem {_version()}, python {platform.python_version()}, "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs"),
        (f"- started {started:%Y-%m-%d %H:%M UTC}, total {total:.1f} s wall, "
         f"{cpu_total:.1f} s CPU (this process and its children), preset={preset}, "
         f"models={','.join(models) if models else 'default'}"),
        (f"- targets: {', '.join(targets)}"
         + ("" if targets == ("cpu",) else
            " (GPU targets: XLA:GPU's plan compiled without a GPU; no autotuning, so library "
            "workspaces are not counted and temp is a lower bound; no timing; time ratios and "
            "measured peaks are CPU-only)")),
    ]
    try:
        import jax

        header.append(f"- jax {jax.__version__}, backend {jax.default_backend()}")
    except Exception as e:  # noqa: BLE001 - the report is still useful without it
        header.append(f"- jax unavailable: {type(e).__name__}: {e}")
    report = write_report(out, header, results, sections)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"command": command, "quick": args.quick, "preset": preset,
                   "targets": list(targets), "models": models, "total_seconds": total,
                   "total_cpu_seconds": cpu_total, "sections": results}, f, indent=2)
        f.write("\n")
    failed = [r["name"] for r in results if r["status"] == "failed"]
    console.print(
        f"\n[bold]report:[/bold] {report}  ({total:.1f} s, {cpu_total:.1f} CPU-s; "
        f"{len(results) - len(failed)} ok, {len(failed)} failed)"
    )
    return 1 if failed else 0


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxmem`` console script; returns the exit status."""
    from rich.console import Console

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # the planner parses its own arguments
        from jaxmem.planner.cli import main as plan_main

        return plan_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs / CI: don't squeeze wide tables into 80 columns
        console = Console(width=max(console.width, 200))
    if args.command == "bench":
        return _bench(args, console)
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
