"""Memory measurement at the three levels of docs/design.md, each named for what it measures.

1. :func:`residual_bytes` — what autodiff keeps for backward (jaxpr level, before XLA).
2. :func:`compiled_memory` — what XLA plans for a jitted function (``memory_analysis()``),
   on this CPU or for a GPU target without a GPU (``target="h100"``; :mod:`.target`).
3. :func:`peak_memory` — what a real run allocates, measured in a fresh subprocess.

:func:`live_peak` says what sets level 2: the values live together at the peak of XLA's temp
allocation, read from the compile's buffer assignment and live ranges.

:func:`slope` turns any of them into bytes per added layer, the headline metric for
layer-wise techniques. The PyTorch twins live in ``torch_ref.measure``.
"""
from jaxmem.measure._validate import TraceError
from jaxmem.measure.compiled import (
    CompiledMemory,
    buffer_assignment,
    compiled_hlo,
    compiled_memory,
)
from jaxmem.measure.live import (
    LiveBuffer,
    LivePeak,
    live_peak,
    live_peak_of_lowered,
    read_live_peak,
)
from jaxmem.measure.peak import PeakMemory, peak_memory
from jaxmem.measure.residuals import ResidualEntry, ResidualReport, residual_bytes
from jaxmem.measure.slope import slope
from jaxmem.measure.target import (
    GPU_TARGETS,
    TARGETS,
    GpuPlanUnavailable,
    gpu_plan_available,
    target_mesh,
)

__all__ = [
    "GPU_TARGETS",
    "TARGETS",
    "CompiledMemory",
    "GpuPlanUnavailable",
    "LiveBuffer",
    "LivePeak",
    "PeakMemory",
    "ResidualEntry",
    "ResidualReport",
    "TraceError",
    "buffer_assignment",
    "compiled_hlo",
    "compiled_memory",
    "gpu_plan_available",
    "live_peak",
    "live_peak_of_lowered",
    "peak_memory",
    "read_live_peak",
    "residual_bytes",
    "slope",
    "target_mesh",
]
