"""A fake bench section with the new signature (``preset``, ``targets``) for the CLI tests."""
from __future__ import annotations

from jaxmem.bench import Section
from jaxmem.bench.targets import check_targets, grouped_columns, prefix

CALLS: list[dict] = []


def run(quick=False, models=None, progress=None, *, preset=None, targets=("cpu",)):
    targets = check_targets(targets)
    CALLS.append({"quick": quick, "models": models, "preset": preset, "targets": targets})
    row = {"model": "m"}
    for i, t in enumerate(targets):
        row[f"{prefix(t)}bytes"] = (i + 1) * 2**20
    return Section(
        name="fake_targets",
        title="A fake section with targets",
        columns=["model", *grouped_columns(targets, ["bytes"])],
        rows=[row],
        units={f"{prefix(t)}bytes": "B" for t in targets},
    )
