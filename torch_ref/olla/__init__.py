"""torch_ref.olla — OLLA on PyTorch: torch.fx importer into :class:`jaxmem.schedule.Graph`,
PyTorch-order baseline, and re-execution of the reordered FX graph."""
from .fx_graph import FxGraph, fx_to_graph, pytorch_peak, reorder, trace_training_step

__all__ = ["FxGraph", "fx_to_graph", "pytorch_peak", "reorder", "trace_training_step"]
