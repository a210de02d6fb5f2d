"""Level 3 of docs/design.md: **measured peak** — what a real run allocates, in a fresh process.

``peak_memory(target, *args)`` starts a new Python process, builds the computation there and
measures one (or ``repeats``) calls of it:

1. ``step = target(*args, **kwargs)`` — the target builds its inputs/model/optimizer and
   returns a **zero-argument callable** (the step to measure), e.g. a jitted train step
   bound to its state;
2. ``step()`` is run ``warmup`` times (compilation, allocator warm-up), then garbage is
   collected and ``malloc_trim(0)`` returns freed heap to the OS;
3. the high-water mark is reset, the baseline taken, ``step()`` run ``repeats`` times
   (results are waited for with ``jax.block_until_ready`` / ``torch.cuda.synchronize``);
4. ``peak_bytes = high-water mark - baseline``.

How the high-water mark is read:

* CPU (both frameworks): write ``5`` to ``/proc/self/clear_refs`` (resets ``VmHWM`` to the
  current RSS), read ``VmRSS`` as baseline, run, read ``VmHWM``. The child runs with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that large buffers are ``mmap``-ed and returned to the
  OS when freed (otherwise glibc keeps freed warm-up buffers resident and the delta
  under-counts). Linux only. The figure is process RSS: it includes anything the step
  touches (allocator slack, thread stacks), so expect a few MiB of noise; use it for
  large effects and the compiled bytes for exact ones.
* GPU, JAX: ``device.memory_stats()["peak_bytes_in_use"] - bytes_in_use`` (the baseline is
  taken after warm-up; XLA's peak counter cannot be reset, so a setup that peaked higher than
  the step hides the step — free setup temporaries inside the target). ``memory_stats()``
  is ``None`` on CPU.
* GPU, torch: ``torch.cuda.reset_peak_memory_stats()``, then
  ``torch.cuda.max_memory_allocated() - memory_allocated()``.

Targets are given as ``"package.module:function"``, ``"path/to/file.py:function"`` or a
module-level function object (converted to its import path). Arguments must be JSON
serialisable (numbers, strings, lists, dicts).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PeakMemory", "peak_memory"]

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_peak_child.py")
_MARK = "JAXMEM_PEAK_RESULT "
BACKENDS = ("jax", "torch")
DEVICES = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """A measured peak.

    Attributes:
      peak_bytes: high-water mark minus baseline: what the measured step(s) added at peak.
      baseline_bytes: RSS (CPU) / bytes in use (GPU) right before the measured run.
      high_water_bytes: the absolute high-water mark read after the run.
      method: ``"cpu-vmhwm"``, ``"jax-device-peak_bytes_in_use"`` or
        ``"torch-cuda-max_memory_allocated"``.
      seconds: wall time of the measured repeats (informative only; never compare times
        across processes).
    """

    peak_bytes: int
    baseline_bytes: int
    high_water_bytes: int
    method: str
    backend: str
    device: str
    target: str
    repeats: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _target_string(target: str | Callable[..., Any]) -> str:
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(
                f"peak_memory: `target` must be 'package.module:function' or "
                f"'path/file.py:function', got {target!r}"
            )
        return target
    if callable(target):
        mod = getattr(target, "__module__", None)
        qual = getattr(target, "__qualname__", "")
        if not mod or "<" in qual:
            raise ValueError(
                "peak_memory: a function `target` must be defined at module level (got "
                f"{qual or target!r}); pass 'module:function' instead"
            )
        if mod == "__main__":
            path = getattr(sys.modules["__main__"], "__file__", None)
            if not path:
                raise ValueError("peak_memory: cannot re-import a function defined in an "
                                 "interactive __main__; put it in a module")
            return f"{os.path.abspath(path)}:{qual}"
        return f"{mod}:{qual}"
    raise TypeError(f"peak_memory: `target` must be a string or a function, got "
                    f"{type(target).__name__}")


def peak_memory(
    target: str | Callable[..., Callable[[], Any]],
    *args: Any,
    backend: str = "jax",
    device: str = "cpu",
    warmup: int = 1,
    repeats: int = 1,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> PeakMemory:
    """Measured peak bytes of ``target(*args, **kwargs)()`` in a fresh subprocess.

    Args:
      target: ``"module:function"``, ``"file.py:function"`` or a module-level function; it is
        called as ``target(*args, **kwargs)`` in the child and must return a zero-argument
        callable (the step).
      *args, kwargs: JSON-serialisable arguments for ``target``.
      backend: ``"jax"`` or ``"torch"`` — which framework's GPU counter to read (on CPU both
        use the process high-water mark; ``"jax"`` also forces ``JAX_PLATFORMS=cpu``).
      device: ``"cpu"`` or ``"gpu"``.
      warmup: calls of the step before measuring (>= 0; 1 compiles a jitted step).
      repeats: measured calls (>= 1); the peak over them is reported.
      timeout: seconds before the child is killed.
      env: extra environment variables for the child.

    Raises:
      ValueError / TypeError: bad arguments (named).
      RuntimeError: the child failed (its stderr tail is in the message) or timed out.
    """
    if backend not in BACKENDS:
        raise ValueError(f"peak_memory: `backend` must be one of {BACKENDS}, got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"peak_memory: `device` must be one of {DEVICES}, got {device!r}")
    for name, v, lo in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"peak_memory: `{name}` must be an int >= {lo}, got {v!r}")
    tgt = _target_string(target)
    spec = {
        "target": tgt,
        "args": list(args),
        "kwargs": dict(kwargs or {}),
        "backend": backend,
        "device": device,
        "warmup": warmup,
        "repeats": repeats,
        "sys_path": [os.getcwd()] + [p for p in sys.path if p],
    }
    try:
        payload = json.dumps(spec)
    except TypeError as e:
        raise TypeError(f"peak_memory: `args`/`kwargs` must be JSON serialisable: {e}") from e
    child_env = dict(os.environ)
    child_env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if device == "cpu" and backend == "jax":
        child_env["JAX_PLATFORMS"] = "cpu"
    if device == "cpu" and backend == "torch":
        child_env["CUDA_VISIBLE_DEVICES"] = ""
    child_env.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, _CHILD], check=False, input=payload, capture_output=True, text=True,
            timeout=timeout, env=child_env,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"peak_memory: {tgt} timed out after {timeout} s") from e
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(
            f"peak_memory: measuring {tgt} failed in the child process (exit code "
            f"{proc.returncode}):\n{tail}"
        )
    r = json.loads(lines[-1][len(_MARK):])
    return PeakMemory(
        peak_bytes=int(r["peak_bytes"]),
        baseline_bytes=int(r["baseline_bytes"]),
        high_water_bytes=int(r["high_water_bytes"]),
        method=r["method"],
        backend=backend,
        device=device,
        target=tgt,
        repeats=repeats,
        seconds=float(r["seconds"]),
    )
