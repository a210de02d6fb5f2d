"""``jaxmem plan module:function --budget 512MiB``: plan a user's own step from the shell.

``module:function`` names a function that takes no arguments and returns ``(loss, args)``:
the loss ``loss(params, *batch) -> scalar`` and a tuple of example arguments. The planner's
table is printed (rich), a JSON is written, and a PNG of the bytes each unit keeps, default vs
planned, when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
from collections.abc import Sequence

__all__ = ["main"]


class _UsageError(Exception):
    """A bad command line or a ``module:function`` of the wrong shape (exit status 2)."""


def _load(spec: str):
    if ":" not in spec:
        raise _UsageError(f"expected module:function, got {spec!r}")
    modname, fn = spec.split(":", 1)
    sys.path.insert(0, str(pathlib.Path.cwd()))
    try:
        mod = importlib.import_module(modname)
    except ImportError as e:
        raise _UsageError(f"cannot import {modname!r}: {e}") from None
    finally:
        sys.path.pop(0)
    make = getattr(mod, fn, None)
    if not callable(make):
        raise _UsageError(f"{modname} has no callable {fn!r}")
    out = make()
    want = ("must return (loss, args): the loss loss(params, *batch) -> scalar and a tuple "
            "(or list) of its positional example arguments, e.g. (loss, (params, batch))")
    if not (isinstance(out, tuple) and len(out) == 2):
        raise _UsageError(f"{spec}() {want}; got {type(out).__name__}")
    if not callable(out[0]):
        raise _UsageError(f"{spec}() {want}; its first item is a {type(out[0]).__name__}, "
                          f"not callable")
    if not isinstance(out[1], (tuple, list)):
        raise _UsageError(f"{spec}() {want}; its second item is a {type(out[1]).__name__}, "
                          f"not a tuple (wrap a single argument: (loss, (params,)))")
    return out[0], tuple(out[1])


def _png(p, path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [c.label for c in p.choices]
    mib = 2.0**20
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.5), 4))
    xs = range(len(labels))
    full = [c.keep_bytes / mib if c.option == "store" else (c.keep_bytes + c.work_bytes) / mib
            for c in p.choices]
    ax.bar([x - 0.2 for x in xs], full, 0.4, label="default (kept for backward)")
    ax.bar([x + 0.2 for x in xs], [c.keep_bytes / mib for c in p.choices], 0.4,
           label="planned")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MiB kept per unit")
    ax.set_title(f"compiled {p.compiled_bytes / mib:.1f} MiB of budget "
                 f"{p.budget_bytes / mib:.1f} (default {p.default_bytes / mib:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _rows_or_none(text: str) -> int | None:
    """``--logits-chunk`` / ``--attention-chunk`` / ``--mlp-chunk``: an int >= 1, or
    ``none``."""
    if text.lower() == "none":
        return None
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'none', got {text!r}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxmem plan", description=__doc__.splitlines()[0])
    ap.add_argument("step", metavar="module:function",
                    help="module:function returning (loss, args)")
    ap.add_argument("--budget", required=True,
                    help="bytes (4096), a size (512MiB, 1.5GB) or a fraction in (0, 1] of the "
                         "untouched step's compiled bytes (0.25)")
    ap.add_argument("--target", default="cpu",
                    help="plan against this target's compiled bytes: cpu (default) or a GPU "
                         "(h100, h100_pcie, h200, a100, b200: XLA:GPU's plan, compiled here "
                         "without one)")
    ap.add_argument("--approximate", action="store_true",
                    help="allow few-bit activation codes per unit (approximate gradients)")
    ap.add_argument("--no-order", action="store_true",
                    help="do not try the untouched step in an OLLA order first")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--logits-chunk", type=_rows_or_none, default=1024, metavar="ROWS",
                    help="rows per chunk of a language-model head the plan may compute in "
                         "chunks (default 1024; 'none': keep it whole)")
    ap.add_argument("--attention-chunk", type=_rows_or_none, default=512, metavar="ROWS",
                    help="query rows per chunk of an attention under the plan's conversion "
                         "(default 512; 'none': whole)")
    ap.add_argument("--mlp-chunk", type=_rows_or_none, default=None, metavar="ROWS",
                    help="rows per chunk of a transformer MLP (both passes) under the "
                         "plan's conversion (default none: whole)")
    ap.add_argument("--out", default="jaxmem-plan", help="folder for plan.json / plan.png")
    a = ap.parse_args(list(argv) if argv is not None else None)
    from rich.console import Console

    from jaxmem.measure.target import check_target
    from jaxmem.planner import BudgetError, plan
    from jaxmem.planner.api import budget_spec
    console = Console()
    try:
        budget_spec(a.budget, "--budget")
        check_target(a.target, 1, "--target")
        loss, args = _load(a.step)
    except (_UsageError, ValueError, TypeError) as e:
        print(f"jaxmem plan: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with console.status("measuring and solving"):
        try:
            p = plan(loss, *args, budget=a.budget, allow_approximate=a.approximate,
                     time_limit=a.time_limit, order=not a.no_order, target=a.target,
                     logits_chunk=a.logits_chunk, attention_chunk=a.attention_chunk,
                     mlp_chunk=a.mlp_chunk)
        except BudgetError as e:
            console.print(f"[red]{e}")
            report = {"error": str(e), "smallest_bytes": e.smallest_bytes,
                      "dominant": e.dominant}
            try:
                peak = e.smallest_peak()
            except Exception as pe:  # noqa: BLE001 - the refusal stands without its reading
                console.print(f"(its peak could not be read: {type(pe).__name__}: {pe})")
            else:
                if peak is not None:
                    console.print(f"at that plan's peak: {peak}\n{peak.top(5)}", markup=False)
                    report["smallest_peak"] = {
                        "temp_bytes": peak.temp_bytes, "live_bytes": peak.live_bytes,
                        "instruction": f"{peak.instruction}:{peak.instruction_name}",
                        "largest": [{"bytes": b.bytes, "shape": b.shape, "op": b.op_name}
                                    for b in peak.buffers[:5]]}
            (out / "plan.json").write_text(json.dumps(report, indent=1))
            return 2
    console.print(p)
    for note in p.notes:
        console.print(f"note: {note}")
    (out / "plan.json").write_text(json.dumps(p.to_dict(), indent=1))
    if _png(p, out / "plan.png"):
        console.print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    else:
        console.print(f"wrote {out / 'plan.json'} (no matplotlib: no PNG)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
