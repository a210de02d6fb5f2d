"""Runs ``parity_tests/distributed/multidevice`` on 8 CPU devices in a fresh process.

The tests compile many small programs and run each once: the process inherits the suite's
cheap LLVM pipeline (``FAST_CODEGEN`` in ``parity_tests/conftest.py``). It changes the machine
code only, not the HLO that the tests check (collectives, buffer sizes) nor the float semantics.
"""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 900


def test_multidevice_suite():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["JAXMEM_MULTIDEVICE"] = "1"
    env["JAX_PLATFORMS"] = "cpu"   # 8 host devices also where a GPU is JAX's default backend
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           str(HERE / "multidevice")]
    proc = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True,
                          check=False, timeout=TIMEOUT_S)
    out = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"multidevice suite failed (rc {proc.returncode}):\n{out}"
