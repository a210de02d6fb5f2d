"""Every ```python block of README.md and docs/*.md runs, as written, in a fresh process.

Blocks are run one by one from the repository root (so relative paths in them resolve as a
reader's would) as ``__main__`` of a process of their own; a block that fails shows its file,
line and the error. The processes are forked from a server that has imported jax, flax,
optax, numpy and jaxmem and nothing more: no backend started, no device, no array, no
option set (the seconds each block would spend importing them are spent once). Shell blocks
are not run (they install or run benchmarks for minutes), but every repository path they
name must exist.
"""
from __future__ import annotations

import multiprocessing
import os
import pathlib
import re
import runpy
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def _blocks(lang: str):
    """One param per distinct block (a block repeated verbatim on two pages runs once; its
    id names every place it appears)."""
    places: dict[str, list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                line = text.count("\n", 0, m.start()) + 1
                places.setdefault(m.group(2), []).append(f"{page.relative_to(ROOT)}:{line}")
    return [pytest.param(code, id="+".join(where)) for code, where in places.items()]


PYTHON_BLOCKS = _blocks("python")
SHELL_BLOCKS = _blocks("bash")


def test_pages_have_examples():
    assert len(PYTHON_BLOCKS) >= 8, [p.id for p in PYTHON_BLOCKS]


#: imported by the fork server before any block (importing starts no backend)
PRELOAD = ["jax", "jax.numpy", "numpy", "flax.linen", "flax.nnx", "optax", "jaxmem",
           "jaxmem.models", "jaxmem.measure"]


def _run_block(script: str, log: str) -> None:
    """In the forked process: stdout and stderr (file descriptors too) to ``log``, the
    repository root as working directory and import root, the block as ``__main__``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(ROOT)
    sys.path[:0] = [os.path.dirname(script), str(ROOT)]
    os.environ["PYTHONPATH"] = str(ROOT)
    if not os.environ.get("JAX_PLATFORMS"):   # JAX read its options at import: set it there
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        jax.config.update("jax_platforms", "cpu")
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)        # as the interpreter does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else int(e.code is not None))
    except BaseException:  # noqa: BLE001 - any error of the block is its failure
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def block_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs(code, tmp_path, block_context):
    script, log = tmp_path / "example.py", tmp_path / "example.log"
    script.write_text(code)
    proc = block_context.Process(target=_run_block, args=(str(script), str(log)))
    proc.start()
    proc.join(600)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    out = log.read_text(errors="replace") if log.exists() else ""
    assert proc.exitcode == 0, \
        f"example failed (exit {proc.exitcode}):\n{code}\n--- output ---\n{out[-4000:]}"


_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|jaxmem|torch_ref|parity_tests|scripts|docs)/[\w./-]+)")


@pytest.mark.parametrize("code", SHELL_BLOCKS)
def test_shell_block_paths_exist(code):
    missing = [p for p in _PATH.findall(code) if not (ROOT / p.rstrip(".")).exists()]
    assert not missing, f"paths named in a shell block do not exist: {missing}"
