"""The `jaxmem` command: bench sections, outcomes, exit codes and written files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxmem import bench
from jaxmem.cli import main

HERE = os.path.dirname(__file__)


@pytest.fixture
def fake_sections(monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    import fake_sections_cli

    fake_sections_cli.CALLS.clear()
    sections = {
        "fake_ok": "fake_sections_cli",
        "missing": "jaxmem.bench.no_such_section",
        "failing": "fake_failing_cli",
        "broken": "fake_broken_import_cli",
    }
    monkeypatch.setattr(bench, "SECTIONS", sections)
    return fake_sections_cli


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("jaxmem ")


def test_list(fake_sections, capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "fake_ok" in out and "fake_sections_cli" in out and "jaxmem.bench.no_such_section" in out


def test_bench_outcomes_files_and_exit_code(fake_sections, tmp_path, capsys):
    out = tmp_path / "o"
    code = main(["bench", "--quick", "--models", "m1, m2", "--out", str(out)])
    assert code == 1  # 'missing', 'failing' and 'broken' failed; fake_ok still ran
    assert fake_sections.CALLS == [{"quick": True, "models": ["m1", "m2"]}]
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s["status"] for s in summary["sections"]}
    assert status == {"fake_ok": "ok", "missing": "failed", "failing": "failed",
                      "broken": "failed"}
    assert "ModuleNotFoundError" in (out / "missing.error.txt").read_text()
    assert "exploded on purpose" in (out / "failing.error.txt").read_text()
    data = json.loads((out / "fake_ok.json").read_text())
    assert data["rows"][1] == {"model": "m2", "bytes": 2 * 2**20, "ratio": 1.5}
    assert data["status"] == "ok" and data["quick"] is True
    md = (out / "fake_ok.md").read_text()
    assert "| m2 | 2.00 MiB | 1.50x |" in md and "fake_ok.png" in md
    assert (out / "fake_ok.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "A fake section" in report and "exploded" in report
    printed = capsys.readouterr().out
    assert "A fake section" in printed and "FAILED" in printed


def test_bench_only_ok_sections_exits_zero(fake_sections, tmp_path):
    assert main(["bench", "--sections", "fake_ok", "--out", str(tmp_path)]) == 0
    assert fake_sections.CALLS == [{"quick": False, "models": None}]


def test_bench_missing_section_module_is_a_failure(fake_sections, tmp_path):
    """A section whose module does not exist is a failure (exit 1), never skipped."""
    assert main(["bench", "--sections", "missing,fake_ok", "--out", str(tmp_path)]) == 1
    assert fake_sections.CALLS == [{"quick": False, "models": None}]


def test_fail_fast_stops(fake_sections, tmp_path):
    code = main(["bench", "--sections", "failing,fake_ok", "--fail-fast", "--out",
                 str(tmp_path)])
    assert code == 1
    assert fake_sections.CALLS == []  # fake_ok never ran
    assert not (tmp_path / "fake_ok.json").exists()


def test_bad_usage_exits_2(fake_sections, tmp_path, capsys):
    assert main(["bench", "--sections", "nope", "--out", str(tmp_path)]) == 2
    assert "allowed" in capsys.readouterr().out
    assert main(["bench", "--models", " , ", "--out", str(tmp_path)]) == 2


def test_python_dash_m_and_console_script():
    r = subprocess.run([sys.executable, "-m", "jaxmem", "--version"], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("jaxmem ")
    r = subprocess.run([sys.executable, "-m", "jaxmem", "bench", "--list"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "baseline" in r.stdout
