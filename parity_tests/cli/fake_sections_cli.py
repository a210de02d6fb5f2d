"""Fake bench sections for the CLI tests (imported by module path; not collected)."""
from __future__ import annotations

from jaxmem.bench import Section

CALLS: list[dict] = []


def run(quick=False, models=None, progress=None):
    CALLS.append({"quick": quick, "models": models})
    if progress:
        progress("working")
    return Section(
        name="fake_ok",
        title="A fake section",
        columns=["model", "bytes", "ratio"],
        rows=[{"model": m, "bytes": (i + 1) * 2**20, "ratio": 1.5} for i, m in
              enumerate(models or ["a", "b"])],
        units={"bytes": "B", "ratio": "x"},
        notes=["made up"],
        meta={"plot": {"x": "model", "y": ["bytes"], "file": "fake_ok.png"}},
    )
