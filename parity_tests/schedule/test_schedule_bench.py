"""The `jaxmem bench` section for schedule runs and reports consistent rows."""
from __future__ import annotations

import pytest


def test_bench_section_quick_convchain():
    from jaxmem.bench.schedule import run

    sec = run(quick=True, models=["convchain"], time_limit=1.0)
    assert sec.name == "schedule" and len(sec.rows) == 1
    row = sec.rows[0]
    assert row["opt_peak"] <= row["program_peak"]
    assert row["lower_bound"] <= row["opt_peak"] <= row["arena"]
    assert row["exec_peak"] == row["opt_peak"]  # executor realises the plan
    assert row["exec_matches_jit"]
    assert "| convchain |" in sec.to_markdown()
    with pytest.raises(ValueError, match="models"):
        run(quick=True, models=["nope"])
