"""Rendering helpers for ``jaxmem bench``: rich tables, Markdown/JSON files, PNG plots.

A section can ask for a bar chart without touching matplotlib itself by putting a plot spec
in ``Section.meta["plot"]`` (one dict) or ``Section.meta["plots"]`` (a list of dicts)::

    {"x": "model",                       # column holding the bar-group labels
     "y": ["jax_residual", "torch_saved"],  # numeric columns, one bar per column
     "title": "residual bytes per step",  # optional
     "log": False,                        # optional log y-axis
     "file": "baseline_residuals.png"}    # optional file name (default <name>[_i].png)

Columns whose unit is ``"B"`` are plotted in MiB. matplotlib is imported lazily with the
``Agg`` backend; if it is missing, plots are skipped (a note says so).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

from jaxmem.bench import Section

__all__ = ["render_plots", "rich_table", "write_report", "write_section"]


def rich_table(section: Section):
    """The section as a ``rich.table.Table`` (values formatted by ``Section.format_value``)."""
    from rich.table import Table

    table = Table(title=section.title, title_justify="left", show_lines=False)
    for c in section.columns:
        unit = section.units.get(c)
        header = f"{c} [MiB]" if unit == "B" else c
        numeric = any(isinstance(r.get(c), (int, float)) for r in section.rows)
        table.add_column(header, justify="right" if numeric else "left")
    for row in section.rows:
        table.add_row(*[_cell(section, c, row.get(c)) for c in section.columns])
    return table


def _cell(section: Section, column: str, value: Any) -> str:
    if section.units.get(column) == "B" and isinstance(value, (int, float)):
        return f"{value / 2**20:.2f}"
    return section.format_value(column, value)


def _plot_specs(section: Section) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    if isinstance(section.meta.get("plot"), dict):
        specs.append(section.meta["plot"])
    if isinstance(section.meta.get("plots"), list):
        specs.extend(s for s in section.meta["plots"] if isinstance(s, dict))
    return specs


def render_plots(section: Section, out_dir: str) -> list[str]:
    """Render the section's plot specs to PNGs in ``out_dir``; return the file names."""
    specs = _plot_specs(section)
    if not specs:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        section.notes.append("(plots skipped: matplotlib is not installed)")
        return []
    import numpy as np

    files = []
    for i, spec in enumerate(specs):
        x_col, y_cols = spec["x"], list(spec["y"])
        rows = [r for r in section.rows if any(isinstance(r.get(c), (int, float)) for c in y_cols)]
        if not rows:
            continue
        labels = [str(r.get(x_col)) for r in rows]
        fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) * len(y_cols) + 2), 3.6))
        width = 0.8 / len(y_cols)
        xs = np.arange(len(rows))
        any_bytes = False
        for j, c in enumerate(y_cols):
            scale = 2.0**20 if section.units.get(c) == "B" else 1.0
            any_bytes |= section.units.get(c) == "B"
            vals = [(r.get(c) / scale) if isinstance(r.get(c), (int, float)) else np.nan
                    for r in rows]
            ax.bar(xs + (j - (len(y_cols) - 1) / 2) * width, vals, width, label=c)
        ax.set_xticks(xs, labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(spec.get("ylabel", "MiB" if any_bytes else ""))
        if spec.get("log"):
            ax.set_yscale("log")
        ax.set_title(spec.get("title", section.title), fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = spec.get("file") or (f"{section.name}.png" if len(specs) == 1
                                    else f"{section.name}_{i}.png")
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def write_section(section: Section, out_dir: str, extra: dict[str, Any] | None = None) -> None:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.md``; PNGs the section produced (plot
    specs, or files it wrote elsewhere) end up in ``out_dir`` and are linked by file name."""
    os.makedirs(out_dir, exist_ok=True)
    plots = []
    for p in section.plots:
        if os.path.isfile(p):
            dest = os.path.join(out_dir, os.path.basename(p))
            if os.path.abspath(p) != os.path.abspath(dest):
                shutil.copyfile(p, dest)
            plots.append(os.path.basename(p))
        else:
            plots.append(p)
    plots += [f for f in render_plots(section, out_dir) if f not in plots]
    section.plots = plots
    data = json.loads(section.to_json())
    if extra:
        data.update(extra)
    with open(os.path.join(out_dir, f"{section.name}.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    with open(os.path.join(out_dir, f"{section.name}.md"), "w") as f:
        f.write(section.to_markdown())


def write_report(out_dir: str, header: Iterable[str], results: list[dict[str, Any]],
                 sections: dict[str, Section]) -> str:
    """Combined ``<out>/report.md``: header lines, a status table, then every section."""
    lines = ["# jaxmem bench report", ""]
    lines += list(header)
    lines += ["", "| section | status | seconds | CPU seconds | detail |", "|---|---|---|---|---|"]
    for r in results:
        detail = str(r.get("reason", "")).replace("|", "\\|").replace("\n", " ")[:160]
        cpu = r.get("cpu_seconds")
        cpu = "—" if cpu is None else f"{cpu:.1f}"
        lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', 0):.1f} | {cpu} | "
                     f"{detail} |")
    lines.append("")
    for r in results:
        s = sections.get(r["name"])
        if s is not None:
            lines.append(s.to_markdown())
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
