"""Child process of :func:`jaxmem.measure.peak_memory` (stdlib only; run by file path so that
it imports neither jax nor torch unless the measured target does).

Protocol: a JSON spec on stdin; one line ``JAXMEM_PEAK_RESULT <json>`` on stdout.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import sys
import time

MARK = "JAXMEM_PEAK_RESULT "


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load(target: str):
    if ":" not in target:
        raise ValueError(f"target must look like 'module:function' or 'file.py:function', got "
                         f"{target!r}")
    mod_name, _, attr = target.rpartition(":")
    if mod_name.endswith(".py") or os.sep in mod_name:
        spec = importlib.util.spec_from_file_location("_jaxmem_peak_target", mod_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {mod_name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["_jaxmem_peak_target"] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _block(out) -> None:
    if "jax" in sys.modules:
        import jax

        jax.block_until_ready(out)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def main() -> None:
    spec = json.loads(sys.stdin.read())
    for p in reversed(spec.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    factory = _load(spec["target"])
    step = factory(*spec.get("args", []), **spec.get("kwargs", {}))
    if not callable(step):
        raise TypeError(f"{spec['target']} must return a zero-argument callable (the step to "
                        f"measure), got {type(step).__name__}")
    for _ in range(spec["warmup"]):
        _block(step())
    gc.collect()
    _malloc_trim()
    backend, device, repeats = spec["backend"], spec["device"], spec["repeats"]
    result = {"backend": backend, "device": device}
    if device == "cpu":
        _reset_hwm()
        base = _status_kib("VmRSS") * 1024
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step()
            _block(out)
            del out
        elapsed = time.perf_counter() - t0
        hwm = _status_kib("VmHWM") * 1024
        result.update(method="cpu-vmhwm", baseline_bytes=base, high_water_bytes=hwm,
                      peak_bytes=max(hwm - base, 0))
    elif backend == "jax":
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats()
        if stats is None:
            raise RuntimeError(f"device {dev} has no memory_stats(); use device='cpu'")
        base = int(stats["bytes_in_use"])
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step()
            _block(out)
            del out
        elapsed = time.perf_counter() - t0
        hwm = int(dev.memory_stats()["peak_bytes_in_use"])
        result.update(method="jax-device-peak_bytes_in_use", baseline_bytes=base,
                      high_water_bytes=hwm, peak_bytes=max(hwm - base, 0), device_kind=str(dev))
    elif backend == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = int(torch.cuda.memory_allocated())
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step()
            _block(out)
            del out
        elapsed = time.perf_counter() - t0
        hwm = int(torch.cuda.max_memory_allocated())
        result.update(method="torch-cuda-max_memory_allocated", baseline_bytes=base,
                      high_water_bytes=hwm, peak_bytes=max(hwm - base, 0))
    else:
        raise ValueError(f"unknown backend {backend!r}")
    result["seconds"] = elapsed
    sys.stdout.write("\n" + MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
