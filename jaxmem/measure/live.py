"""What is live at the peak of XLA's temp allocation, read from its buffer assignment.

XLA packs every intermediate value of a compiled program into one (or a few) temp allocations:
``memory_analysis().temp_size_in_bytes``. Which values set that size, and at which point of
the schedule, is in the compile's dump (``--xla_dump_to``): the buffer assignment gives each
value's ``offset`` and ``size`` inside its allocation, the live-range file each value's
``[start, end]`` interval on XLA's instruction schedule. The bytes live at instruction ``t``
are the measure of the union of the address ranges of the values live there::

    live(t) = | U_{v : start_v <= t <= end_v} [offset_v, offset_v + size_v) |

(a union, not a sum: values sharing a buffer -- an in-place update, a bitcast, a tuple and its
elements -- occupy the same bytes and count once). The peak is ``max_t live(t)``; what the
allocation holds beyond it is the heap's packing loss, ``temp_bytes - live_bytes``. Values
XLA places in an output's buffer before the output is written (XLA:CPU puts small residuals
in the parameter gradients' buffers) are output bytes, not temp, and are not counted.

The dump's own ``Live ranges at N (peak)`` section is not that maximum, and its sum is not a
live size: on XLA:GPU plans it lists a point where far fewer bytes are live (a ResNet-50 step
with 44.6 MiB live at its true peak lists 24.2 MiB of temp values), and it sums values that
share bytes (a small XLA:CPU step lists 1.57 MB of temp values in a 1.31 MB allocation). It
is kept only as :attr:`LivePeak.xla_listed_bytes`, for comparison.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LiveBuffer", "LivePeak", "live_peak", "live_peak_of_lowered", "parse_live_peak",
           "read_live_peak"]

_ALLOC = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): "
                    r"(.*)$")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")
_SEQ = re.compile(r"^\s+(\d+):(\S+)$")
_LISTED = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative: \d+ bytes\)$")
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"")


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One value of a temp allocation live at the peak: its HLO name (``fusion.3``, a tuple
    element ``fusion.3{1}``), ``bytes``, HLO ``shape`` and the JAX ``op_name`` of the
    instruction that defines it (``""`` where the HLO carries none)."""

    name: str
    bytes: int
    shape: str
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class LivePeak:
    """The peak of a compiled program's temp allocations (see the module docstring).

    temp_bytes: the temp allocations' size (``memory_analysis().temp_size_in_bytes``).
    live_bytes: the most temp bytes live together at one instruction.
    instruction: that instruction's position in XLA's schedule; ``instruction_name`` its name.
    buffers: the temp values live there, largest first (values sharing the same bytes: the
      first one defined).
    xla_listed_bytes: the summed temp values of the dump's own ``Live ranges at N (peak)``
      list (neither the peak nor a live size; for comparison), or ``None`` where there is none.
    """

    temp_bytes: int
    live_bytes: int
    instruction: int
    instruction_name: str
    buffers: tuple[LiveBuffer, ...]
    xla_listed_bytes: int | None = None

    @property
    def packing_bytes(self) -> int:
        """Bytes of the temp allocations not live at the peak (the heap's packing loss)."""
        return self.temp_bytes - self.live_bytes

    def top(self, n: int = 10) -> str:
        """The ``n`` largest live buffers, one per line (MiB, shape, op name or HLO name)."""
        rows = [f"{b.bytes / 2**20:9.3f} MiB  {b.shape:32s} {b.op_name or b.name}"
                for b in self.buffers[:n]]
        return "\n".join(rows)

    def __str__(self) -> str:
        mib = 2.0**20
        return (f"LivePeak({self.live_bytes / mib:.2f} MiB live of {self.temp_bytes / mib:.2f} "
                f"MiB temp at {self.instruction}:{self.instruction_name}, "
                f"{len(self.buffers)} buffers)")


def _temp_values(ba_text: str) -> tuple[int, dict[str, tuple[int, int, int, str]]]:
    """``(temp bytes, {value: (allocation, offset, size, shape)})`` of the temp allocations."""
    temp, values, alloc = 0, {}, None
    for line in ba_text.splitlines():
        m = _ALLOC.match(line)
        if m:
            alloc = int(m.group(1)) if "preallocated-temp" in m.group(3) else None
            if alloc is not None:
                temp += int(m.group(2))
            continue
        if not line.startswith(" "):   # the end of an allocation's listing
            alloc = None
        if alloc is None:
            continue
        m = _VALUE.match(line)
        if m and int(m.group(2)) > 0:
            values[m.group(1)] = (alloc, int(m.group(3)), int(m.group(2)), m.group(4).strip())
    return temp, values


def _ranges(lr_text: str) -> tuple[dict[str, tuple[int, int]], dict[int, str]]:
    """``({value: (start, end)}, {position: instruction})`` of the live-range dump."""
    ranges, seq, section = {}, {}, ""
    for line in lr_text.splitlines():
        s = line.strip()
        if s in ("InstructionSequence:", "BufferLiveRange:") or s.startswith("Live ranges at"):
            section = s
            continue
        if section == "InstructionSequence:":
            m = _SEQ.match(line)
            if m:
                seq[int(m.group(1))] = m.group(2)
        elif section == "BufferLiveRange:":
            m = _RANGE.match(line)
            if m:
                # an array value is named ``name{}``, a tuple element ``name{i}``
                ranges[m.group(1).removesuffix("{}")] = (int(m.group(2)), int(m.group(3)))
    return ranges, seq


def _listed(lr_text: str, values) -> int | None:
    """Temp bytes of the dump's ``Live ranges at N (peak)`` list, or ``None``."""
    on, total, found = False, 0, False
    for line in lr_text.splitlines():
        if line.strip().startswith("Live ranges at") and "(peak)" in line:
            on, found = True, True
            continue
        if on:
            m = _LISTED.match(line)
            if not m:
                break
            if m.group(1).removesuffix("{}") in values:
                total += int(m.group(2))
    return total if found else None


def _union(spans: list[tuple[int, int]]) -> int:
    total, lo, hi = 0, None, None
    for a, b in sorted(spans):
        if hi is None or a > hi:
            total += 0 if hi is None else hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    return total + (0 if hi is None else hi - lo)


def parse_live_peak(buffer_assignment: str, live_range: str, hlo: str = "") -> LivePeak:
    """The :class:`LivePeak` of one compile's dump: the text of its
    ``*after_optimizations-buffer-assignment.txt`` and ``*after_optimizations-live-range.txt``
    files, and optionally its optimized HLO (``*after_optimizations.txt``) for op names.
    Raises ``ValueError`` when the two files share no temp value."""
    temp, values = _temp_values(buffer_assignment)
    ranges, seq = _ranges(live_range)
    live = [(ranges[n], n) for n in values if n in ranges]
    if not live:
        if temp == 0:
            return LivePeak(0, 0, 0, "", (), _listed(live_range, values))
        raise ValueError("parse_live_peak: no temp value of the buffer assignment has a live "
                         "range (were the two files written by the same compile?)")
    live.sort()
    best, at, active, i = -1, 0, [], 0
    # the live set only grows where a value starts: the peak is at one of the starts
    while i < len(live):
        t = live[i][0][0]
        while i < len(live) and live[i][0][0] == t:
            active.append(live[i])
            i += 1
        active = [v for v in active if v[0][1] >= t]
        by_alloc: dict[int, list[tuple[int, int]]] = {}
        for _, n in active:
            a, off, size, _ = values[n]
            by_alloc.setdefault(a, []).append((off, off + size))
        b = sum(_union(sp) for sp in by_alloc.values())
        if b > best:
            best, at = b, t
    ops = {m.group(1): m.group(2) for m in map(_OP_NAME.match, hlo.splitlines()) if m}
    bufs, seen = [], set()
    for (s, e), n in live:   # in order of definition: a value sharing bytes is listed once
        a, off, size, shape = values[n]
        if s <= at <= e and (a, off, size) not in seen:
            seen.add((a, off, size))
            bufs.append(LiveBuffer(n, size, shape, ops.get(n.split("{")[0], "")))
    bufs.sort(key=lambda b: (-b.bytes, b.name))
    return LivePeak(temp, best, at, seq.get(at, ""), tuple(bufs), _listed(live_range, values))


def read_live_peak(folder: str, module: str = "") -> LivePeak:
    """The :class:`LivePeak` of a compile dumped to ``folder`` (``--xla_dump_to``): the newest
    module whose file names contain ``module`` (e.g. ``"jit_loss"``; default: any)."""
    def newest(suffix: str) -> str:
        found = [f for f in glob.glob(os.path.join(folder, "*" + suffix))
                 if module in os.path.basename(f)]
        if not found:
            raise FileNotFoundError(f"read_live_peak: no *{suffix} of module {module!r} in "
                                    f"{folder}")
        with open(max(found, key=os.path.getmtime)) as fh:
            return fh.read()

    try:
        hlo = newest("after_optimizations.txt")
    except FileNotFoundError:
        hlo = ""
    return parse_live_peak(newest("after_optimizations-buffer-assignment.txt"),
                           newest("after_optimizations-live-range.txt"), hlo)


def live_peak_of_lowered(lowered: Any, target: str = "cpu", gemm: str = "auto") -> LivePeak:
    """:func:`live_peak` of an already lowered program (``jax.jit(f).lower(...)``, or a
    sharded step's ``.lower(...)`` on a :func:`jaxmem.measure.target_mesh`), compiled for
    ``target``."""
    from jaxmem._compat import persistent_cache_off
    from jaxmem.measure.target import compile_lowered

    # a persistent-cache hit would load an executable and dump nothing
    with tempfile.TemporaryDirectory(prefix="jaxmem-live-") as d, persistent_cache_off():
        compile_lowered(lowered, target, gemm, {"xla_dump_to": d})
        return read_live_peak(d)


def live_peak(fn: Callable[..., Any], *args: Any, static_argnums: int | Sequence[int] = (),
              donate_argnums: int | Sequence[int] = (), target: str = "cpu",
              devices: int = 1, gemm: str = "auto") -> LivePeak:
    """The peak of ``fn``'s temp allocation compiled for ``target`` (arguments as in
    :func:`jaxmem.measure.compiled_memory`): how many bytes are live together there, at
    which instruction, and which values.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.measure import live_peak
    >>> p = live_peak(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)),
    ...               jnp.ones((64, 64)), jnp.ones((256, 64)))
    >>> 0 < p.live_bytes <= p.temp_bytes
    True
    """
    from jaxmem.measure.compiled import read_compile

    return read_compile(fn, args, static_argnums, donate_argnums, target, devices, gemm,
                        "live_peak", live_peak_of_lowered)
