"""What the planner may do with a unit: an :class:`Option`, and a :class:`Candidate` (an
option over one or more consecutive units with its bytes and cost)."""
from __future__ import annotations

import dataclasses
import re

from jaxmem.planner import trace as _trace

__all__ = ["EXACT", "KINDS", "NESTED", "Candidate", "Option", "partial_children",
           "partial_mask", "recomputed_runs"]

#: option kinds; ``fewbit`` and ``rows`` carry a parameter (bits, row tiles), ``segment`` may
#: carry :data:`NESTED` (``"segment2"``: nested, two-level recomputation), ``partial`` the
#: children it stores (:func:`partial_mask`)
KINDS = ("store", "dots", "recompute", "segment", "fewbit", "rows", "offload", "partial")
#: kinds that change how a layer is traced (:class:`jaxmem.planner.trace.Conversion`)
_CONVERSIONS = ("fewbit", "rows")
#: kinds run under ``jax.checkpoint`` (recompute before their backward, fenced on CPU)
_CHECKPOINTED = ("dots", "recompute", "segment", "partial")
#: per-unit options whose bytes come from the unit's own VJP under a checkpoint policy
EXACT = ("store", "dots", "recompute")
#: ``Option("segment", NESTED)``: the segment is recomputed as one chunk before its backward,
#: and inside that recomputation each of its units is checkpointed again (keeps only its
#: inputs, recomputed once more just before that unit's own backward): two-level checkpointing
NESTED = 2


def partial_mask(stored: tuple[bool, ...]) -> int:
    """The ``param`` of ``Option("partial", ...)`` over a unit's children: bit ``i`` set when
    child ``i`` is stored, and a leading bit ``1 << len(stored)`` that records their number
    (``(True, False, True)`` -> ``0b1101`` = 13)."""
    return (1 << len(stored)) | sum(1 << i for i, s in enumerate(stored) if s)


def partial_children(param: int) -> tuple[bool, ...]:
    """Per child of a ``partial`` unit, whether it is stored (:func:`partial_mask` inverted)."""
    n = param.bit_length() - 1
    return tuple(bool(param >> i & 1) for i in range(n))


def recomputed_runs(stored: tuple[bool, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` child index ranges of the consecutive recomputed children (each run
    is recomputed as one chunk)."""
    runs, start = [], None
    for i, s in enumerate((*stored, True)):
        if not s and start is None:
            start = i
        elif s and start is not None:
            runs.append((start, i))
            start = None
    return runs


@dataclasses.dataclass(frozen=True, order=True)
class Option:
    """One option: ``kind`` in :data:`KINDS`, ``param`` the bit count of ``fewbit``, the
    tile count of ``rows``, :data:`NESTED` for a nested ``segment`` (``None`` for every other
    kind, and for a plain segment); ``stages`` (``rows`` only) the trunk's pooling stages
    tiled (``None``: all). ``str`` gives its text (``"store"``, ``"fewbit3"``, ``"rows8"``,
    ``"rows8s2"``, ``"segment2"``), :meth:`parse` reads it back. ``partial`` (one unit with
    children): the children marked stored in ``param`` (:func:`partial_mask`) keep their
    residuals and each run of the others is recomputed as one chunk: a unit's costly layers
    kept, its cheap ones recomputed."""

    kind: str
    param: int | None = None
    stages: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Option: kind must be one of {KINDS}, got {self.kind!r}")
        if self.stages is not None and not (self.kind == "rows" and type(self.stages) is int
                                            and self.stages >= 1):
            raise ValueError(f"Option: stages must be None or an int >= 1 of kind 'rows', "
                             f"got stages={self.stages!r} for {self.kind!r}")
        if self.kind == "partial":
            if not (type(self.param) is int and self.param >= 4
                    and any(partial_children(self.param))
                    and not all(partial_children(self.param))):
                raise ValueError(f"Option: param of kind 'partial' must be a partial_mask of "
                                 f"two or more children, some stored and some recomputed, "
                                 f"got {self.param!r}")
            return
        if self.kind == "segment":
            if self.param is not None and not (type(self.param) is int
                                               and self.param == NESTED):
                raise ValueError(f"Option: param of kind 'segment' must be None or {NESTED} "
                                 f"(nested), got {self.param!r}")
            return
        wants = self.kind in _CONVERSIONS
        ok = (isinstance(self.param, int) and not isinstance(self.param, bool)
              and self.param >= 1) if wants else self.param is None
        if not ok:
            need = "an int >= 1" if wants else "None"
            raise ValueError(f"Option: param of kind {self.kind!r} must be {need}, got "
                             f"{self.param!r}")

    def __str__(self) -> str:
        text = self.kind if self.param is None else f"{self.kind}{self.param}"
        return text if self.stages is None else f"{text}s{self.stages}"

    @classmethod
    def parse(cls, text: str) -> Option:
        """The option whose ``str`` is ``text`` (``"recompute"``, ``"fewbit2"``, ``"rows4"``,
        ``"rows4s2"``)."""
        mt = re.fullmatch(r"([a-z]+)([0-9]*)(?:s([0-9]+))?", text) \
            if isinstance(text, str) else None
        if mt is None:
            raise ValueError(f"Option.parse: text must be an option name such as 'store' or "
                             f"'fewbit2', got {text!r}")
        return cls(mt.group(1), int(mt.group(2)) if mt.group(2) else None,
                   int(mt.group(3)) if mt.group(3) else None)

    @property
    def tiled_stages(self) -> str:
        """What a ``rows`` option tiles: ``"first pooling stage"``, ``"first 2 pooling
        stages"``, ``"whole trunk"`` (``stages`` None); empty for every other kind."""
        if self.kind != "rows":
            return ""
        if self.stages is None:
            return "whole trunk"
        return "first pooling stage" if self.stages == 1 else \
            f"first {self.stages} pooling stages"

    @property
    def checkpointed(self) -> bool:
        """Whether the unit runs under ``jax.checkpoint`` (its cost carries the fence)."""
        return self.kind in _CHECKPOINTED

    @property
    def nested(self) -> bool:
        """Whether this is a nested segment (two-level recomputation)."""
        return self.kind == "segment" and self.param == NESTED

    @property
    def run_as(self) -> str:
        """How :func:`jaxmem.planner.trace.run_chunks` runs the unit: a converted unit is run
        stored (the conversion is in its trace), a segment recomputed as one chunk, a nested
        segment (``"segment2"``) as one chunk whose units are checkpointed again inside."""
        return "store" if self.kind in _CONVERSIONS else str(self)

    def conversion(self) -> _trace.Conversion | None:
        """The tracing conversion of a ``fewbit`` / ``rows`` option, else ``None``."""
        if self.kind not in _CONVERSIONS:
            return None
        return _trace.Conversion(self.kind, self.param, self.stages)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """``option`` over the consecutive units ``cover``: ``keep_bytes`` held for the backward
    pass (jaxpr level), ``work_bytes`` recomputed while its own backward runs, ``cost`` the
    predicted extra FLOPs (fence included); ``converts`` the label of the layer call the
    option's conversion applies to (``None``: the last covered unit's; a ``rows`` option
    over a trunk's first stages converts the trunk, whose last units it does not cover);
    ``children`` the labels of a ``partial`` candidate's children."""

    cover: tuple[int, ...]
    option: Option
    keep_bytes: int
    work_bytes: int
    cost: float
    converts: str | None = None
    #: a ``partial`` candidate's unit's children, by label
    children: tuple[str, ...] = ()

    @property
    def checkpoints(self) -> int:
        """``jax.checkpoint`` calls the candidate runs (each behind its own fence on CPU): 0
        unless checkpointed, 1 + one per covered unit for a nested segment, else 1."""
        if not self.option.checkpointed:
            return 0
        if self.option.kind == "partial":
            return len(recomputed_runs(partial_children(self.option.param)))
        return 1 + len(self.cover) if self.option.nested else 1

    def __post_init__(self):
        c = self.cover
        if not c or tuple(c) != tuple(range(c[0], c[0] + len(c))):
            raise ValueError(f"Candidate: cover must be consecutive unit indices, got {c!r}")
        if not isinstance(self.option, Option):
            raise TypeError(f"Candidate: option must be an Option, got {self.option!r}")
