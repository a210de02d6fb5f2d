"""Unit profile and candidates: what each unit keeps for the backward pass under each option,
read from its own VJP jaxpr, and the :class:`~jaxmem.planner.options.Candidate` of every
option kind (``store``/``dots``/``recompute`` per unit, ``segment`` over several units,
``fewbit``, ``rows``, ``offload``)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxmem._compat import core
from jaxmem.planner import trace as _trace
from jaxmem.planner.options import EXACT, NESTED, Candidate, Option, partial_mask, recomputed_runs

__all__ = ["FEWBIT_BITS", "ROW_COUNTS", "UnitProfile", "exact_candidates",
           "fewbit_candidates", "offload_candidates", "partial_candidates", "profile_units",
           "row_candidates"]

FEWBIT_BITS = (1, 2, 3, 4)
ROW_COUNTS = (2, 4, 8)


def nbytes(aval) -> int:
    """Bytes of an abstract value (extended dtypes such as typed PRNG keys included)."""
    return int(np.prod(aval.shape)) * _trace.itemsize(aval.dtype) if hasattr(aval, "shape") \
        else 0


def _residual_jaxpr(f, ins_avals, policy):
    """The jaxpr from ``f``'s inputs to the residuals ``vjp(f)`` keeps under ``policy``
    (``None``: store)."""
    g = f if policy is None else jax.checkpoint(f, policy=policy, prevent_cse=True)

    def res(*a):
        _, vjp = jax.vjp(g, *a)
        return jax.tree_util.tree_leaves(vjp)

    return jax.make_jaxpr(res)(*ins_avals).jaxpr


def _residual_split(f, ins_avals, policy):
    """(internal residual bytes, set of input positions kept) of ``vjp(f)``."""
    jx = _residual_jaxpr(f, ins_avals, policy)
    pos = {v: i for i, v in enumerate(jx.invars)}
    internal, kept, seen = 0, set(), set()
    for v in jx.outvars:
        if isinstance(v, core.Literal) or v in seen:
            continue
        seen.add(v)
        if v in pos:
            kept.add(pos[v])
        elif v not in jx.constvars:
            internal += nbytes(v.aval)
    return internal, kept


def _needed_eqns(jaxpr, outs) -> tuple[list, set]:
    """The equations of ``jaxpr`` that ``outs`` depend on (in order) and every variable they
    read (dead-code elimination, as JAX's own does for a checkpoint's recomputation)."""
    need = {v for v in outs if not isinstance(v, core.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(not isinstance(v, core.DropVar) and v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if not isinstance(v, core.Literal))
    kept.reverse()
    return kept, need


def recompute_need(jaxpr, u) -> tuple[float, frozenset]:
    """``(FLOPs, inputs)`` of recomputing unit ``u``'s stored residuals from its inputs: only
    the equations those residuals depend on (a trailing matmul whose output the backward
    pass does not read is not run again), and the unit's input variables they read."""
    ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
    f = _trace.chunk_fn(jaxpr, u.start, u.stop, ins, outs)
    jx = _residual_jaxpr(f, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins],
                         None)
    kept, need = _needed_eqns(jx, jx.outvars)
    fl, _ = _trace.flops_of(core.Jaxpr([], list(jx.invars), [], kept))
    return fl, frozenset(v for v, w in zip(ins, jx.invars) if w in need)


def chunk_recompute_flops(prof: UnitProfile, i: int, j: int, nested: bool = False) -> float:
    """FLOPs the backward pass recomputes for units ``i .. j-1`` checkpointed as one chunk
    (their inputs kept). Walking back from the last unit: a unit whose outputs a later unit
    of the chunk needs runs whole, one whose outputs none needs runs only what its own
    residuals need (:func:`recompute_need`). ``nested``: each unit is checkpointed again
    inside, so the chunk's recomputation runs only the units whose outputs are needed, and
    every unit then recomputes its own residuals before its backward."""
    need: set = set()
    fl = 0.0
    for u in range(j - 1, i - 1, -1):
        ins, outs = prof.io[u]
        if any(v in need for v in outs):
            fl += prof.flops[u][0]
            need.update(ins)
        elif not nested:
            fl += prof.recompute[u][0]
        need.update(prof.recompute[u][1])
        if nested:
            fl += prof.recompute[u][0]
    return fl


def keep_bytes(jaxpr, u, outer, policy=None) -> tuple[int, int]:
    """(bytes kept for the backward pass, internal residual bytes) of unit ``u`` of
    ``jaxpr`` under ``policy`` (``None``: store); inputs in ``outer`` are not counted."""
    ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
    f = _trace.chunk_fn(jaxpr, u.start, u.stop, ins, outs)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
    internal, kept = _residual_split(f, avals, policy)
    return internal + sum(nbytes(ins[i].aval) for i in kept if ins[i] not in outer), internal


def _outer(tr) -> set:
    jx = tr.closed.jaxpr
    return set(jx.invars) | set(jx.constvars)


@dataclasses.dataclass
class UnitProfile:
    """The loss cut into ``units``: per unit, ``keep[u][o]`` bytes kept and ``work[u][o]``
    bytes recomputed during its backward under option ``EXACT[o]``, and ``flops[u]`` =
    (all, non-matmul) FLOPs, ``recompute[u]`` = (FLOPs, input variables) of recomputing its
    stored residuals from its inputs (:func:`recompute_need`), ``io[u]`` = its (inputs,
    outputs) variables."""

    traced: _trace.Traced
    units: list[_trace.Unit]
    keep: list[list[int]]
    work: list[list[int]]
    flops: list[tuple[float, float]]
    recompute: list[tuple[float, frozenset]]
    io: list[tuple[list, list]]
    #: per unit with two or more children (:func:`jaxmem.planner.trace.child_units`): the
    #: bytes live while its backward runs when they are checkpointed again inside it (their
    #: inputs + the largest child's stored residuals) and their number; else ``None``
    nested: list[tuple[int, int] | None] | None = None

    @property
    def labels(self) -> list[str]:
        return [u.label for u in self.units]

    @property
    def cut_labels(self) -> list[str]:
        return [lbl for lbl in self.labels if lbl != "(rest)"]

    @property
    def stored(self) -> list[int]:
        return [k[0] for k in self.keep]

    @property
    def total_flops(self) -> float:
        return sum(f[0] for f in self.flops)


def profile_units(tr: _trace.Traced, finer: int = 0) -> UnitProfile:
    """Cut ``tr`` into units (:func:`jaxmem.planner.trace.choose_units`) and measure each."""
    units = _trace.choose_units(tr, finer=finer)
    jaxpr = tr.closed.jaxpr
    outer = _outer(tr)
    keep, work, flops, nested, recompute, io = [], [], [], [], [], []
    for u in units:
        ins, outs = _trace.chunk_io(jaxpr, u.start, u.stop)
        io.append((ins, outs))
        recompute.append(recompute_need(jaxpr, u))
        sub = core.Jaxpr([], list(ins), list(outs), list(jaxpr.eqns[u.start:u.stop]))
        fl, dots = _trace.flops_of(sub)
        measured = [keep_bytes(jaxpr, u, outer, _trace.POLICIES[o]) for o in EXACT]
        full = measured[0][1]
        keep.append([kb for kb, _ in measured])
        work.append([0] + [max(0, full - internal) for _, internal in measured[1:]])
        flops.append((fl, fl - dots))
        nested.append(_nested_work(jaxpr, _trace.child_units(tr, u), outer))
    return UnitProfile(tr, units, keep, work, flops, recompute, io, nested)


def _nested_work(jaxpr, kids, outer) -> tuple[int, int] | None:
    """``(bytes live in the backward of a unit whose children ``kids`` are checkpointed
    again inside it, len(kids))``, or ``None`` for fewer than two children."""
    if len(kids) < 2:
        return None
    stored = [keep_bytes(jaxpr, k, outer)[0] for k in kids]
    inputs = [keep_bytes(jaxpr, k, outer, _trace.POLICIES["recompute"])[0] for k in kids]
    return sum(inputs) + max(stored), len(kids)


def exact_candidates(prof: UnitProfile, fence: float, nested: bool = True) -> list[Candidate]:
    """``store``, ``dots``, ``recompute`` per unit and a ``segment`` over every run of two or
    more consecutive units (keeps the segment's inputs only); ``fence`` is added to the cost
    of every checkpointed candidate (per ``jax.checkpoint`` call).

    With ``nested``, nested (two-level) recomputation is offered too,
    ``Option("segment", NESTED)`` (text ``segment2``), where it lowers the work:

    - over every such run: the same inputs kept, but while its backward runs only its units'
      inputs (as under ``recompute``) plus one unit's stored residuals are live, as each
      unit is checkpointed again inside it: work = sum(keep under recompute) + max(keep
      stored);
    - over one unit with two or more children: kept as under ``recompute``, its children
      checkpointed again inside its backward (:attr:`UnitProfile.nested`).

    Costs are the FLOPs the backward pass runs again (:func:`chunk_recompute_flops`: what the
    kept residuals depend on, not every FLOP of the covered units) plus ``fence`` per
    ``jax.checkpoint``. A nested segment runs the units whose outputs are needed inside the
    chunk, then each unit's residuals again; a nested single unit its forward twice."""
    n, keep, work, flops = len(prof.units), prof.keep, prof.work, prof.flops
    out = []
    for u in range(n):
        out.append(Candidate((u,), Option("store"), keep[u][0], 0, 0.0))
        out.append(Candidate((u,), Option("dots"), keep[u][1], work[u][1], flops[u][1] + fence))
        out.append(Candidate((u,), Option("recompute"), keep[u][2], work[u][2],
                             prof.recompute[u][0] + fence))
        kid = prof.nested[u] if nested and prof.nested else None
        if kid is not None and kid[0] < work[u][2]:
            out.append(Candidate((u,), Option("segment", NESTED), keep[u][2], kid[0],
                                 2.0 * flops[u][0] + fence * (1 + kid[1])))
    jaxpr, outer = prof.traced.closed.jaxpr, _outer(prof.traced)
    for i in range(n):
        for j in range(i + 2, n + 1):
            ins, _ = _trace.chunk_io(jaxpr, prof.units[i].start, prof.units[j - 1].stop)
            kb = sum(nbytes(v.aval) for v in ins if v not in outer)
            wb = sum(keep[u][0] for u in range(i, j))
            fl = chunk_recompute_flops(prof, i, j)
            out.append(Candidate(tuple(range(i, j)), Option("segment"), kb, wb, fl + fence))
            wn = sum(keep[u][2] for u in range(i, j)) + max(keep[u][0] for u in range(i, j))
            if nested and wn < wb:   # otherwise the plain segment keeps as little, for less
                out.append(Candidate(tuple(range(i, j)), Option("segment", NESTED), kb, wn,
                                     chunk_recompute_flops(prof, i, j, nested=True)
                                     + fence * (1 + j - i)))
    return out


def partial_candidates(prof: UnitProfile, fence: float) -> list[Candidate]:
    """``partial`` over each unit with two or more children (:func:`jaxmem.planner.trace.
    child_units`): its children that cost the most FLOPs per byte to recompute stored, the
    others recomputed, each run of them as one chunk (:func:`jaxmem.planner.trace.
    partial_fn`). A child that keeps nothing is always stored and one that recomputes for
    free always recomputed; of the rest the costliest k per byte are stored, k = 1 .. n-1.
    Keep = the jaxpr-level residuals of the unit run so, cost = what each run recomputes
    (:func:`recompute_need` over the run) + ``fence`` per run, work = the largest run's
    stored residuals. Offered where it keeps less than storing the unit and costs less
    than recomputing it: a GPT 4x64 block under the scope (batch 16, ctx 64) with its
    attention stored and its layer norms and MLP recomputed drops 0.77 of its 2.32 MiB for
    35 MFLOP (0.022 of a step), recomputed whole 1.56 MiB for 91 MFLOP."""
    tr = prof.traced
    jaxpr, outer = tr.closed.jaxpr, _outer(tr)
    out = []
    for u, unit in enumerate(prof.units):
        kids = _trace.child_units(tr, unit)
        if len(kids) < 2:
            continue
        held = [keep_bytes(jaxpr, k, outer)[0] for k in kids]
        rec = [recompute_need(jaxpr, k)[0] for k in kids]
        free = {i for i in range(len(kids)) if held[i] and not rec[i]}
        open_ = sorted((i for i in range(len(kids)) if held[i] and rec[i]),
                       key=lambda i: (-rec[i] / held[i], i))
        seen = set()
        for k in range(len(open_) + 1):
            keep_set = set(open_[:k]) | {i for i in range(len(kids)) if not held[i]}
            stored = tuple(i in keep_set and i not in free for i in range(len(kids)))
            if stored in seen or all(stored) or not any(stored):
                continue
            seen.add(stored)
            cand = _partial_candidate(prof, u, unit, kids, stored, fence)
            if cand is not None:
                out.append(cand)
    return out


def _partial_candidate(prof, u, unit, kids, stored, fence) -> Candidate | None:
    tr = prof.traced
    jaxpr, outer = tr.closed.jaxpr, _outer(tr)
    f, ins, _ = _trace.partial_fn(jaxpr, unit, kids, stored, fence=False)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
    internal, kept = _residual_split(f, avals, None)
    kb = internal + sum(nbytes(ins[i].aval) for i in kept if ins[i] not in outer)
    cost, work = 0.0, 0
    for a, b in recomputed_runs(stored):
        run = _trace.Unit(kids[a].label, kids[a].start, kids[b - 1].stop, unit.depth + 1)
        cost += recompute_need(jaxpr, run)[0] + fence
        work = max(work, keep_bytes(jaxpr, run, outer)[0])
    if kb >= prof.keep[u][0] or cost >= prof.recompute[u][0] + fence:
        return None
    return Candidate((u,), Option("partial", partial_mask(stored)), kb, work, cost,
                     children=tuple(k.label for k in kids))


def _aligned(units_c, labels, dropped=()) -> bool:
    """Whether the converted trace's units are the base units (minus ``dropped`` labels)."""
    return [u.label for u in units_c] == [lbl for lbl in labels if lbl not in dropped]


def fewbit_candidates(step, args, factory, prof: UnitProfile,
                      approx_cost: float) -> list[Candidate]:
    """``fewbit`` b: each unit stored with b-bit codes for its smooth activations, where that
    keeps fewer bytes than exact storage (measured on a trace with every unit at b bits);
    cost ``approx_cost * (5 - b) / 4`` of a step."""
    labels, out = prof.labels, []
    for b in FEWBIT_BITS:
        convs = {lbl: _trace.Conversion("fewbit", b) for lbl in prof.cut_labels}
        tr = _trace.trace(step, args, factory() if factory else None, convs)
        units_c = _trace.units_at(tr, prof.cut_labels)
        if not _aligned(units_c, labels):
            continue
        for u, uc in enumerate(units_c):
            if uc.label not in tr.converted:
                continue
            kb, _ = keep_bytes(tr.closed.jaxpr, uc, _outer(tr))
            if kb < prof.keep[u][0]:
                cost = approx_cost * 3.0 * max(prof.total_flops, 1.0) * (5 - b) / 4
                out.append(Candidate((u,), Option("fewbit", b), kb, 0, cost))
    return out


def row_candidates(step, args, factory, prof: UnitProfile) -> list[Candidate]:
    """``rows`` r: a conv trunk (see :func:`jaxmem.planner.trace.row_twin`) that is a unit
    boundary, row-tiled into r tiles; covers the trunk's own units (its layers' units merge
    into it); work = stored bytes / r, cost = the trunk's FLOPs. ``rows`` r over the trunk's
    first s pooling stages (:func:`jaxmem.planner.trace.row_split`, option ``rows{r}s{s}``):
    covers those stages' units only (the rest stay the trunk's own units, each with its own
    options), cost = their FLOPs: the high-resolution stages, where the bytes are, tiled
    without recomputing the whole trunk."""
    labels, out = prof.labels, []
    for r in ROW_COUNTS:
        for stages in (None, *range(1, _MAX_STAGES + 1)):
            convs = {lbl: _trace.Conversion("rows", r, stages) for lbl in prof.traced.ends}
            tr = _trace.trace(step, args, factory() if factory else None, convs)
            trunks = sorted(tr.converted & set(prof.cut_labels))
            if not trunks:
                break   # no trunk has a row twin (or this many stages): the same for any r
            units_c = _trace.units_at(tr, prof.cut_labels)
            for trunk in trunks:
                cand = _row_candidate(tr, units_c, labels, prof, trunk, r, stages)
                if cand is not None:
                    out.append(cand)
    return out


#: most pooling stages a ``rows`` candidate over a trunk's first stages tiles
_MAX_STAGES = 4


def _row_candidate(tr, units_c, labels, prof: UnitProfile, trunk: str, r: int,
                   stages: int | None) -> Candidate | None:
    """The ``rows`` candidate of ``trunk`` in the converted trace ``tr`` (``None`` when its
    units do not line up with the base units or it keeps no less)."""
    inside = [lbl for lbl in labels if lbl.startswith(trunk + "/")]
    dropped = {lbl for lbl in inside if lbl not in tr.ends}
    if stages is None:
        end = trunk
        dropped = set(inside)
    else:   # the tiled stages end at the first of the trunk's layers the trace still has
        end = next((lbl for lbl in inside if lbl in tr.ends), None)
        if end is None:
            return None
    cover = tuple(u for u, lbl in enumerate(labels)
                  if lbl in dropped or lbl == end)
    if not cover or cover != tuple(range(cover[0], cover[-1] + 1)):
        return None
    if not _aligned(units_c, labels, dropped):
        return None
    uc = next(x for x in units_c if x.label == end)
    kb, _ = keep_bytes(tr.closed.jaxpr, uc, _outer(tr))
    held = sum(prof.keep[u][0] for u in cover)
    if kb >= held:
        return None
    return Candidate(cover, Option("rows", r, stages), kb, held // r,
                     sum(prof.flops[u][0] for u in cover),
                     converts=None if stages is None else trunk)


def offload_candidates(prof: UnitProfile, bandwidth: float, flops: float) -> list[Candidate]:
    """``offload``: a unit's matmul and convolution outputs in host memory, the elementwise
    work between them recomputed (:func:`jaxmem.planner.offload.offload_chunk`); the device
    keeps the unit's inputs, as under ``recompute``. Moved bytes = kept under ``dots`` minus
    kept under ``recompute``; work = those bytes brought back plus what ``dots`` recomputes;
    cost = the round trip over a step of ``3 * FLOPs / flops`` seconds, in step FLOPs, plus
    the unit's non-matmul FLOPs."""
    from jaxmem.planner import offload as _offload

    total = 3.0 * max(prof.total_flops, 1.0)
    step_seconds = total / flops
    out = []
    for u, k in enumerate(prof.keep):
        moved = k[1] - k[2]
        if moved > 0:
            t = _offload.transfer_seconds(moved, bandwidth)
            out.append(Candidate((u,), Option("offload"), k[2], moved + prof.work[u][1],
                                 t / step_seconds * total + prof.flops[u][1]))
    return out
