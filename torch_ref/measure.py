"""PyTorch twin of :mod:`jaxmem.measure`.

* :func:`saved_bytes` — level 1 (residual bytes): the tensors autograd saves for backward,
  captured with ``torch.autograd.graph.saved_tensors_hooks`` while ``fn(*args)`` runs its
  forward, **deduplicated by storage** (``untyped_storage().data_ptr()``): a storage saved
  by several ops (or as several views) is counted once, with its full ``nbytes`` (a saved
  view keeps its whole storage alive). Storages are classified as

  - ``"argument"`` — the storage of a tensor in ``args`` (any pytree of lists/tuples/dicts)
    or of a parameter/buffer of an ``nn.Module`` that is ``fn`` or in ``args``;
  - ``"activation"`` — everything else (memory that exists because of backward).

* :func:`peak_memory` — level 3, the measured peak of a torch step in a fresh subprocess
  (same protocol as :func:`jaxmem.measure.peak_memory` with ``backend="torch"``: CPU VmHWM
  delta, or ``torch.cuda.max_memory_allocated`` delta on GPU).

Level 2 (compiled bytes) has no eager-PyTorch counterpart.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SavedEntry", "SavedReport", "peak_memory", "saved_bytes"]


@dataclasses.dataclass(frozen=True)
class SavedEntry:
    """One storage saved for backward.

    Attributes:
      shape, dtype: of the first tensor seen on this storage.
      nbytes: the storage's size in bytes (counted once).
      kind: ``"activation"`` or ``"argument"``.
      source: name of the autograd node that saved it first (e.g. ``"ConvolutionBackward0"``)
        or the argument/parameter name.
      count: how many times tensors on this storage were saved.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    source: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class SavedReport:
    entries: list[SavedEntry]

    @property
    def activation_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.kind == "activation")

    @property
    def argument_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.kind == "argument")

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "activation_bytes": self.activation_bytes,
            "argument_bytes": self.argument_bytes,
            "total_bytes": self.total_bytes,
            "entries": [dataclasses.asdict(e) for e in self.entries],
        }

    def __str__(self) -> str:
        lines = [(f"saved for backward: activations {self.activation_bytes} B, arguments "
                 f"{self.argument_bytes} B, total {self.total_bytes} B")]
        for e in self.entries:
            times = f" x{e.count}" if e.count > 1 else ""
            lines.append(f"  {e.kind:<10} {e.dtype}{list(e.shape)} {e.nbytes} B{times}  "
                         f"{e.source}")
        return "\n".join(lines)


def _collect_arguments(obj: Any, name: str, out: dict[int, str]) -> None:
    if isinstance(obj, torch.nn.Module):
        for n, p in obj.named_parameters():
            out.setdefault(p.untyped_storage().data_ptr(), f"{name}.{n}")
        for n, b in obj.named_buffers():
            if b is not None and b.numel():
                out.setdefault(b.untyped_storage().data_ptr(), f"{name}.{n}")
    elif isinstance(obj, torch.Tensor):
        if obj.numel():
            out.setdefault(obj.untyped_storage().data_ptr(), name)
    elif isinstance(obj, (list, tuple)):
        for i, o in enumerate(obj):
            _collect_arguments(o, f"{name}[{i}]", out)
    elif isinstance(obj, dict):
        for k, o in obj.items():
            _collect_arguments(o, f"{name}[{k!r}]", out)


def saved_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> SavedReport:
    """Bytes autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    ``fn`` typically computes the loss (a forward pass); nothing is differentiated here —
    which tensors require grad (``requires_grad_``, frozen parameters) decides what torch
    saves. Nothing is saved under ``torch.no_grad()``.

    Raises:
      TypeError: ``fn`` not callable.
    """
    if not callable(fn):
        raise TypeError(f"saved_bytes: `fn` must be callable, got {type(fn).__name__}")
    arguments: dict[int, str] = {}
    _collect_arguments(fn, "fn", arguments)
    for i, a in enumerate(args):
        _collect_arguments(a, f"args[{i}]", arguments)
    for k, a in kwargs.items():
        _collect_arguments(a, k, arguments)

    order: list[int] = []
    info: dict[int, dict[str, Any]] = {}
    keep: list[Any] = []  # hold storages so no data_ptr is reused during the forward

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0 and st.nbytes() == 0:
            return t
        if ptr not in info:
            node = t.grad_fn
            src = arguments.get(ptr)
            info[ptr] = {
                "shape": tuple(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "nbytes": int(st.nbytes()),
                "kind": "argument" if src is not None else "activation",
                "source": src if src is not None else
                (f"output of {type(node).__name__}" if node is not None else "saved tensor"),
                "count": 0,
            }
            order.append(ptr)
            keep.append(st)
        info[ptr]["count"] += 1
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    del out
    entries = [SavedEntry(**info[p]) for p in order]
    keep.clear()
    return SavedReport(entries=entries)


def peak_memory(target: Any, *args: Any, device: str = "cpu", **kw: Any):
    """Measured peak of a torch step in a fresh subprocess; see
    :func:`jaxmem.measure.peak_memory` (this is it with ``backend="torch"``)."""
    from jaxmem.measure.peak import peak_memory as _peak

    return _peak(target, *args, backend="torch", device=device, **kw)
