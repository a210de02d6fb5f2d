"""Level 2 of docs/design.md: **compiled bytes** — the buffers XLA plans for a jitted function.

``compiled_memory(fn, *args)`` runs ``jax.jit(fn).lower(*args).compile().memory_analysis()``
and returns its fields:

* ``temp_bytes`` — scratch buffers live during the call (activations of a train step, the
  backward's intermediates). The figure a memory technique is meant to shrink.
* ``argument_bytes`` — the inputs (parameters, batch, optimizer state).
* ``output_bytes`` — the outputs (new parameters, loss, ...). XLA may place residuals in
  output buffers of a *forward-only* jit, so read temp and output together.
* ``alias_bytes`` — outputs that reuse (donated) argument buffers.
* ``generated_code_bytes`` — compiled code size (not counted in the total).

``total_bytes = temp + output + argument - alias``: the bytes that must fit on the device
for one call when nothing else is resident. On CPU, XLA's ``peak_memory_in_bytes`` counts
only arguments and outputs (no temporaries), so it is kept only as
``reported_peak_bytes`` for reference and is **never** used alone.

The plan is deterministic for a given JAX/XLA version and backend. To judge a layer-wise
technique use the difference at two depths (:func:`jaxmem.measure.slope`): it cancels the
fixed costs and shows whether XLA fusion undid a residual trick.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem.measure._validate import (
    TraceError,
    check_array_args,
    check_callable,
    fn_name,
    normalize_argnums,
)
from jaxmem.measure.target import (
    GEMM_BACKENDS,
    GpuPlanUnavailable,
    _cuda_c_api,
    buffer_assignment_text,
    check_placement,
    check_target,
    compile_lowered,
    lower_for_target,
)

__all__ = ["CompiledMemory", "buffer_assignment", "compiled_hlo", "compiled_memory"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's ``memory_analysis()`` of one compiled function, in bytes."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    reported_peak_bytes: int | None = None
    backend: str = ""
    fn_name: str = ""
    target: str = "cpu"
    devices: int = 1
    gemm_backend: str = ""

    @property
    def total_bytes(self) -> int:
        """``temp + output + argument - alias`` (generated code excluded)."""
        return self.temp_bytes + self.output_bytes + self.argument_bytes - self.alias_bytes

    @property
    def plan(self) -> str:
        """Which plan this is: ``"cpu"``, ``"h100 plan"``, ``"h100 plan x8"``."""
        if self.target == "cpu":
            return "cpu"
        return f"{self.target} plan" + (f" x{self.devices}" if self.devices > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        return d

    def __str__(self) -> str:
        mib = 2.0**20
        return (
            f"compiled memory of {self.fn_name} on {self.plan}: total "
            f"{self.total_bytes / mib:.2f} MiB = temp {self.temp_bytes / mib:.2f} + output "
            f"{self.output_bytes / mib:.2f} + argument {self.argument_bytes / mib:.2f} - alias "
            f"{self.alias_bytes / mib:.2f} MiB (code {self.generated_code_bytes} B)"
        )


def _prepare(fn: Callable[..., Any], args: Sequence[Any], static_argnums: Any,
             donate_argnums: Any, target: Any, devices: Any, gemm: Any, who: str
             ) -> tuple[Any, str, str]:
    """Check the arguments and lower ``fn`` for ``target``: ``(lowered, target, name)``."""
    check_callable(fn, who)
    target = check_target(target, devices, who)
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"{who}: `gemm` must be one of {GEMM_BACKENDS}, got {gemm!r}")
    name = fn_name(fn)
    n = len(args)
    static = normalize_argnums(static_argnums, n, who, "static_argnums") \
        if static_argnums != () and n else ()
    donate = normalize_argnums(donate_argnums, n, who, "donate_argnums") \
        if donate_argnums != () and n else ()
    dynamic = [i for i in range(n) if i not in static]
    # ShapeDtypeStruct leaves are valid abstract inputs for lower(); check the rest.
    def concrete_view(a: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x: 0.0 if isinstance(x, jax.ShapeDtypeStruct) else x,
            a, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

    check_array_args([concrete_view(a) for a in args], dynamic, (), who)
    if target != "cpu":
        _cuda_c_api_or_raise(who)
        check_placement(args, static, target, int(devices), who)
    try:
        lowered = lower_for_target(fn, args, static, donate, target, int(devices))
    except Exception as e:
        raise TraceError(f"{who}: could not trace/lower {name}: {type(e).__name__}: {e}") from e
    return lowered, target, name


def _cuda_c_api_or_raise(who: str) -> None:
    try:
        _cuda_c_api()
    except GpuPlanUnavailable as e:
        raise GpuPlanUnavailable(f"{who}: {e}") from None


def _compile(lowered: Any, target: str, gemm: str, name: str, who: str) -> tuple[Any, str]:
    try:
        return compile_lowered(lowered, target, gemm)
    except Exception as e:
        raise TraceError(f"{who}: could not compile {name} for target {target!r}: "
                         f"{type(e).__name__}: {e}") from e


def compiled_memory(
    fn: Callable[..., Any],
    *args: Any,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    target: str = "cpu",
    devices: int = 1,
    gemm: str = "auto",
) -> CompiledMemory:
    """Compile ``fn`` for ``args`` (``fn`` is jitted for you) and report XLA's memory plan.

    Args:
      fn: any JAX-traceable function (already-jitted functions are fine).
      *args: arrays / Python numbers / pytrees of them; non-array arguments must be listed in
        ``static_argnums``. Abstract ``jax.ShapeDtypeStruct`` leaves are accepted too (nothing
        is executed).
      static_argnums, donate_argnums: passed to ``jax.jit``. Donated arguments show up as
        ``alias_bytes`` when XLA reuses their buffers for outputs.
      target: ``"cpu"`` (this process's CPU device) or a GPU: ``"h100"``, ``"h100_pcie"``,
        ``"h200"``, ``"a100"``, ``"b200"`` — XLA:GPU's plan for that GPU, compiled here
        without one (:mod:`jaxmem.measure.target`; needs the ``gpu-plan`` extra). Arguments
        are placed replicated on the target's devices unless they are
        ``ShapeDtypeStruct`` leaves already sharded on :func:`target_mesh`.
      devices: GPUs in the target topology (1..8); figures are per device.
      gemm: GPU targets only: ``"auto"`` (XLA's Triton GEMMs, cuBLAS where no Triton tiling
        is found without autotuning), ``"triton"`` or ``"cublas"``; the one used is
        ``gemm_backend`` of the result.

    Returns:
      :class:`CompiledMemory`: ``temp_bytes``, ``argument_bytes``, ``output_bytes``,
      ``alias_bytes``, ``generated_code_bytes`` and ``total_bytes`` (per device for
      ``devices > 1``), with ``target``, ``devices``, ``gemm_backend`` (``""`` on CPU) and
      ``plan`` (``"cpu"``, ``"h100 plan"``, ``"h100 plan x8"``) saying which plan they are.
      A GPU plan counts no autotuning workspaces: read its ``temp_bytes`` as a lower bound.

    Raises:
      TypeError: non-callable ``fn`` or a non-array argument that is not static.
      ValueError: an unknown ``target``, ``devices`` out of range, an unknown ``gemm``, or
        an argument sharded on compile-only devices other than the target's.
      GpuPlanUnavailable: a GPU target without the CUDA plugin (the message says how to
        install it).
      TraceError (a ValueError): ``fn`` failed to trace/lower/compile; the message names ``fn``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.measure import compiled_memory, gpu_plan_available
      >>> x = jnp.ones((256, 256))
      >>> m = compiled_memory(lambda x: jnp.tanh(x @ x), x)
      >>> m.plan, m.argument_bytes, m.output_bytes
      ('cpu', 262144, 262144)
      >>> m.total_bytes == m.temp_bytes + m.output_bytes + m.argument_bytes - m.alias_bytes
      True
      >>> if gpu_plan_available():  # XLA:GPU's plan for an H100, compiled without a GPU
      ...     h = compiled_memory(lambda x: jnp.tanh(x @ x), x, target="h100")
      ...     assert (h.plan, h.argument_bytes, h.output_bytes) == ("h100 plan", 262144, 262144)
    """
    who = "compiled_memory"
    lowered, target, name = _prepare(fn, args, static_argnums, donate_argnums, target,
                                     devices, gemm, who)
    compiled, gemm_backend = _compile(lowered, target, gemm, name, who)
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(
            f"{who}: this backend ({target}) returned no memory_analysis() for {name}"
        )
    peak = getattr(m, "peak_memory_in_bytes", None)
    return CompiledMemory(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        generated_code_bytes=int(m.generated_code_size_in_bytes),
        reported_peak_bytes=None if peak is None else int(peak),
        backend=jax.default_backend() if target == "cpu" else "cuda",
        fn_name=name,
        target=target,
        devices=int(devices),
        gemm_backend=gemm_backend,
    )


def compiled_hlo(fn: Callable[..., Any], *args: Any, static_argnums: int | Sequence[int] = (),
                 donate_argnums: int | Sequence[int] = (), target: str = "cpu",
                 devices: int = 1, gemm: str = "auto") -> str:
    """The optimized HLO text XLA compiles ``fn`` to for ``target`` (arguments as in
    :func:`compiled_memory`): read fusions, collectives and what the backward keeps."""
    who = "compiled_hlo"
    lowered, target, name = _prepare(fn, args, static_argnums, donate_argnums, target,
                                     devices, gemm, who)
    return _compile(lowered, target, gemm, name, who)[0].as_text()


def buffer_assignment(fn: Callable[..., Any], *args: Any,
                      static_argnums: int | Sequence[int] = (),
                      donate_argnums: int | Sequence[int] = (), target: str = "cpu",
                      devices: int = 1, gemm: str = "auto") -> str:
    """XLA's buffer assignment for ``fn`` on ``target`` (the ``--xla_dump_to`` listing of
    every allocation, its size and the values that share it; arguments as in
    :func:`compiled_memory`). The program is compiled for the listing even where JAX's
    persistent compilation cache holds it (a loaded executable dumps nothing)."""
    return read_compile(fn, args, static_argnums, donate_argnums, target, devices, gemm,
                        "buffer_assignment", buffer_assignment_text)


def read_compile(fn, args, static_argnums, donate_argnums, target, devices, gemm, who: str,
                 reader: Callable[[Any, str, str], Any]) -> Any:
    """``reader(lowered, target, gemm)`` of ``fn`` lowered for ``args`` (checked as in
    :func:`compiled_memory`); a compile that fails raises ``TraceError`` naming ``who``."""
    lowered, target, name = _prepare(fn, args, static_argnums, donate_argnums, target,
                                     devices, gemm, who)
    try:
        return reader(lowered, target, gemm)
    except Exception as e:
        raise TraceError(f"{who}: could not compile {name} for target {target!r}: "
                         f"{type(e).__name__}: {e}") from e
