"""Benchmark sections behind `jaxmem bench`.

Each technique contributes one module ``jaxmem.bench.<name>`` exposing::

    def run(quick: bool = False, models: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> Section

The CLI imports the modules listed in :data:`SECTIONS` lazily, runs them in order, prints
each :class:`Section` as a table and writes ``<out>/<name>.json`` and ``<out>/<name>.md``
(plus any PNG the section wrote into ``Section.plots``).

Rules for sections (see docs/design.md):
- memory figures are deterministic and reported in bytes (render MiB in the table);
- time only as a ratio measured side by side in the same run;
- ``quick=True`` must finish in well under a minute on 2 CPU cores.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

#: name -> module path, in the order the CLI runs them.
SECTIONS: dict[str, str] = {
    "baseline": "jaxmem.bench.baseline",
    "selective": "jaxmem.bench.selective",
    "fewbit": "jaxmem.bench.fewbit",
    "rowconv": "jaxmem.bench.rowconv",
    "schedule": "jaxmem.bench.schedule",
}


@dataclasses.dataclass
class Section:
    """One table of a benchmark report.

    Attributes:
      name: short id (the key in :data:`SECTIONS`).
      title: one-line human title.
      columns: column keys, in display order; every row is a dict with (a subset of) them.
      rows: the measurements; values are numbers, strings or None.
      units: optional column -> unit ("B" for bytes, "x" for ratios, "s" for seconds) used
        when rendering (bytes are shown in MiB).
      notes: free-text lines printed under the table (how it was measured, caveats).
      plots: paths of PNG files the section wrote.
      meta: anything else worth keeping in the JSON (shapes, versions, commands).
    """

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    units: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    plots: list[str] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)

    def format_value(self, column: str, value: Any) -> str:
        if value is None:
            return "—"
        unit = self.units.get(column)
        if unit == "B" and isinstance(value, (int, float)):
            return f"{value / 2**20:.2f} MiB"
        if unit == "x" and isinstance(value, (int, float)):
            return f"{value:.2f}x"
        if unit == "s" and isinstance(value, (int, float)):
            return f"{value:.3g} s"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    def to_markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        for row in self.rows:
            lines.append(
                "| " + " | ".join(self.format_value(c, row.get(c)) for c in self.columns) + " |"
            )
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        for p in self.plots:
            lines.append(f"\n![{self.name}]({p})")
        return "\n".join(lines) + "\n"
