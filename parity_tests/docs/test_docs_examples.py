"""Every ```python block of README.md and docs/*.md runs, as written, in a fresh interpreter.

Blocks are run one by one from the repository root (so relative paths in them resolve as a
reader's would); a block that fails shows its file, line and the error. Shell blocks are not
run (they install or run benchmarks for minutes), but every repository path they name must
exist.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def _blocks(lang: str):
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append(pytest.param(m.group(2), id=f"{page.relative_to(ROOT)}:{line}"))
    return out


PYTHON_BLOCKS = _blocks("python")
SHELL_BLOCKS = _blocks("bash")


def test_pages_have_examples():
    assert len(PYTHON_BLOCKS) >= 8, [p.id for p in PYTHON_BLOCKS]


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"example failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"


_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|jaxmem|torch_ref|parity_tests|scripts|docs)/[\w./-]+)")


@pytest.mark.parametrize("code", SHELL_BLOCKS)
def test_shell_block_paths_exist(code):
    missing = [p for p in _PATH.findall(code) if not (ROOT / p.rstrip(".")).exists()]
    assert not missing, f"paths named in a shell block do not exist: {missing}"
