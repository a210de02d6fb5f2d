"""The same jaxmem training code across processes: 2 ``jax.distributed`` processes on
loopback with gloo CPU collectives, 4 CPU devices each, run one FSDP (data-parallel, parameters
sharded over all 8 devices) step of a jaxmem GPT (selective + 3-bit few-bit GELU); the
gradients and updated parameters equal the one-process, one-device step computed here.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

HERE = Path(__file__).resolve().parent
NPROC, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 240
SKIP = 77


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_workers(out):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +      # the suite's cheap LLVM pipeline too
                        f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
    env.pop("JAX_PLATFORMS", None)
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(HERE / "_multiprocess_worker.py"), str(port),
                              str(i), str(NPROC), str(out)], env=env, cwd=HERE.parents[1],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(NPROC)]


def _wait(procs):
    results = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, so[-3000:] + se[-3000:]))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"jax.distributed workers did not finish in {TIMEOUT_S} s")
    return results


def test_two_process_fsdp_step_equals_single_process(tmp_path):
    from _multiprocess_case import case

    out = tmp_path / "result.npz"
    procs = _start_workers(out)
    try:  # the one-process, one-device reference, computed while the workers run
        params, batch, loss_fn, opt = case()
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
        upd, _ = opt.update(grads, opt.init(params), params)
        new = optax.apply_updates(params, upd)
    except BaseException:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    results = _wait(procs)
    if all(rc == SKIP for rc, _ in results):
        pytest.skip("this platform lacks jax.distributed with gloo CPU collectives: "
                    + results[0][1].strip().splitlines()[-1])
    for i, (rc, log) in enumerate(results):
        assert rc == 0, f"process {i} failed (rc {rc}):\n{log}"
    got = dict(np.load(out))
    assert list(got["devices"]) == [NPROC * LOCAL_DEVICES, LOCAL_DEVICES, NPROC]

    from jaxmem.distributed import path_str
    for prefix, tree in (("grad", grads), ("param", new)):
        for k, want in jax.tree_util.tree_leaves_with_path(tree):
            name = f"{prefix}/{path_str(k)}"
            np.testing.assert_allclose(got[name], np.asarray(want), rtol=2e-5,
                                       atol=2e-6 * float(np.max(np.abs(want))), err_msg=name)
    np.testing.assert_allclose(got["loss"].reshape(-1)[0], float(loss), rtol=1e-6)
