"""`jaxmem bench --target` / `--full`: target parsing and validation, the GPU-plan fallback,
presets passed to the sections, and one real section measured on cpu and the H100 plan."""
from __future__ import annotations

import json
import os

import pytest

from jaxmem import bench
from jaxmem import cli as jcli
from jaxmem.bench.targets import check_targets, grouped_columns, resolve_preset
from jaxmem.cli import main
from jaxmem.measure import TARGETS, gpu_plan_available

HERE = os.path.dirname(__file__)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    import fake_sections_cli
    import fake_targets_cli

    fake_sections_cli.CALLS.clear()
    fake_targets_cli.CALLS.clear()
    monkeypatch.setattr(bench, "SECTIONS", {"fake_targets": "fake_targets_cli",
                                            "fake_ok": "fake_sections_cli"})
    return fake_targets_cli, fake_sections_cli


@pytest.fixture
def plan_ok(monkeypatch):
    """Pretend the GPU-plan plugin loads (no compile happens in the fake sections)."""
    monkeypatch.setattr(jcli, "_gpu_plan_error", lambda: None)


@pytest.fixture
def plan_missing(monkeypatch):
    monkeypatch.setattr(jcli, "_gpu_plan_error",
                        lambda: "GPU targets need the CUDA PJRT plugin, which is not installed")


def test_check_targets_order_dedup_and_errors():
    assert check_targets("cpu,h100") == ("h100", "cpu")  # the GPU plan reads first
    assert check_targets(["H100", " cpu", "h100", "a100"]) == ("h100", "a100", "cpu")
    assert check_targets(None) == ("cpu",)
    for bad in ("tpu", "cpu,gpu", " , "):
        with pytest.raises(ValueError, match="allowed: cpu, h100"):
            check_targets(bad)
    assert grouped_columns(("h100", "cpu"), ["a", "b"]) == ["h100_a", "h100_b", "a", "b"]
    assert resolve_preset(True, None) == "quick" and resolve_preset(False, None) == "full"
    assert resolve_preset(False, "default") == "default"
    with pytest.raises(ValueError, match="preset"):
        resolve_preset(False, "huge")


def test_cli_target_list_matches_measure():
    assert jcli._TARGETS == TARGETS


@pytest.mark.parametrize("bad", ["tpu", "cpu,v100", ","])
def test_bad_target_exits_2_naming_allowed_values(fake, bad, tmp_path, capsys):
    assert main(["bench", "--target", bad, "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "--target" in out and "allowed" in out
    assert all(t in out for t in TARGETS), out
    assert fake[0].CALLS == [] and fake[1].CALLS == []


def test_quick_and_full_exclude_each_other(fake, tmp_path, capsys):
    assert main(["bench", "--quick", "--full", "--out", str(tmp_path)]) == 2
    assert "exclude" in capsys.readouterr().out


def test_default_run_passes_both_targets_and_default_preset(fake, plan_ok, tmp_path):
    ft, fo = fake
    assert main(["bench", "--out", str(tmp_path)]) == 0
    assert ft.CALLS == [{"quick": False, "models": None, "preset": "default",
                         "targets": ("h100", "cpu")}]
    # a section with the old run(quick, models, progress) signature still runs (CPU only)
    assert fo.CALLS == [{"quick": False, "models": None}]
    data = json.loads((tmp_path / "fake_targets.json").read_text())
    assert data["columns"] == ["model", "h100_bytes", "bytes"]
    assert data["targets"] == ["h100", "cpu"] and data["preset"] == "default"
    assert "CPU only" in " ".join(json.loads((tmp_path / "fake_ok.json").read_text())["notes"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["targets"] == ["h100", "cpu"] and summary["preset"] == "default"
    assert all(s["cpu_seconds"] >= 0 for s in summary["sections"])
    assert "| m | 1.00 MiB | 2.00 MiB |" in (tmp_path / "fake_targets.md").read_text()


@pytest.mark.parametrize("flags, preset, quick", [(["--full"], "full", False),
                                                  (["--quick"], "quick", True)])
def test_full_and_quick_presets(fake, plan_ok, tmp_path, flags, preset, quick):
    ft, fo = fake
    assert main(["bench", *flags, "--target", "cpu", "--out", str(tmp_path)]) == 0
    assert ft.CALLS == [{"quick": quick, "models": None, "preset": preset,
                         "targets": ("cpu",)}]
    assert fo.CALLS == [{"quick": quick, "models": None}]


def test_missing_plugin_default_falls_back_to_cpu(fake, plan_missing, tmp_path, capsys):
    ft, _ = fake
    assert main(["bench", "--sections", "fake_targets", "--out", str(tmp_path)]) == 0
    assert ft.CALLS[0]["targets"] == ("cpu",)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "no h100 plan" in ln]
    assert len(lines) == 1 and "cpu only" in lines[0] and "not installed" in lines[0], out


def test_missing_plugin_explicit_gpu_target_exits_2(fake, plan_missing, tmp_path, capsys):
    ft, _ = fake
    assert main(["bench", "--target", "cpu,h100", "--out", str(tmp_path)]) == 2
    assert "not installed" in capsys.readouterr().out
    assert ft.CALLS == []
    # an explicit CPU-only run needs no plugin
    assert main(["bench", "--sections", "fake_targets", "--target", "cpu",
                 "--out", str(tmp_path)]) == 0


@pytest.mark.skipif(not gpu_plan_available(),
                    reason="the CUDA PJRT plugin for GPU plans is not installed")
def test_real_section_measures_cpu_and_h100_plan(tmp_path):
    """The few-bit MLP rows (smallest real section part) through the command: both column
    groups, the GEMM backend and the plan's limits recorded."""
    out = tmp_path / "o"
    code = main(["bench", "--quick", "--sections", "fewbit", "--models", "mlp",
                 "--target", "cpu,h100", "--out", str(out)])
    assert code == 0, (out / "fewbit.error.txt").read_text() if (out / "fewbit.error.txt"
                                                                   ).exists() else code
    data = json.loads((out / "fewbit.json").read_text())
    cols = data["columns"]
    assert cols.index("h100_compiled_per_layer") < cols.index("compiled_per_layer")
    assert "h100_gemm" in cols
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"jax default", "fewbit 3-bit"}
    few = rows["fewbit 3-bit"]
    for pre in ("", "h100_"):  # 3-bit codes: <= 3/8 B per hidden element and layer (+5 %)
        assert 0 < few[f"{pre}per_elem_per_layer"] <= 3 / 8 * 1.05, (pre, few)
        assert few[f"{pre}per_layer_vs_default"] < 0.2
    assert few["h100_gemm"] in ("triton", "cublas")
    assert data["meta"]["targets"] == ["h100", "cpu"]
    assert "temp is a lower bound" in data["meta"]["gpu_plan"]["limits"]
    assert data["meta"]["gpu_plan"]["gemm_backends"]["h100"]
    md = (out / "fewbit.md").read_text()
    assert "h100_compiled_per_layer" in md and "no autotuning" in md
