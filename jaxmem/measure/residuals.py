"""Level 1 of docs/design.md: **residual bytes** — what reverse-mode autodiff keeps for backward.

``residual_bytes(fn, *args, argnums=0)`` traces ``jax.vjp`` of ``fn`` w.r.t. the arguments in
``argnums`` (the others stay inputs of the trace but are not differentiated — exactly like
``jax.grad(fn, argnums)``) and lists the residuals of the linearised function, i.e. the
arrays the VJP closure holds between the forward and the backward pass.

The analysis is the one of ``jax._src.ad_checkpoint.saved_residuals`` (whose public printer is
``jax.ad_checkpoint.print_saved_residuals``) with two differences:

* ``saved_residuals`` differentiates *every* argument. Here only ``argnums`` are
  differentiated, which matters: JAX does not store a layer input when no requested gradient
  needs it (the selective-differentiation effect).
* every residual is classified by **kind**:

  - ``"activation"`` — produced by an operation of the forward pass: memory that exists only
    because of the backward pass (``activation_bytes``);
  - ``"argument"`` — a positional argument of ``fn`` (differentiated or not) that backward
    keeps alive (``argument_bytes``). Such memory usually exists anyway (parameters, batch);
  - ``"constant"`` — an array ``fn`` closes over, or a literal (``constant_bytes``).

Bytes are ``prod(shape) * itemsize`` of the jaxpr value (``bool`` is 1 byte). This is the
autodiff view *before* XLA: XLA may fuse, rematerialise or CSE residuals, so always confirm a
residual trick with :func:`jaxmem.measure.compiled_memory` (level 2) and its
:func:`jaxmem.measure.slope`.

Deduplication: the residual list of a VJP holds each *value* (jaxpr variable) once per use;
if the same variable appears several times it is one buffer, so it is reported as **one**
entry with ``count > 1`` and counted once in the totals. Distinct variables are never merged,
even when they hold equal values (e.g. ``sin(x)`` computed twice is two entries — XLA may CSE
them later, the jaxpr does not). Nothing else is merged.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._compat import core, lax_internal, source_info_util
from jaxmem.measure._validate import (
    TraceError,
    check_array_args,
    check_callable,
    fn_name,
    normalize_argnums,
)

__all__ = ["ResidualEntry", "ResidualReport", "residual_bytes"]

KINDS = ("activation", "argument", "constant")

# Report the user's frames as sources, not this module's wrappers (as JAX does for its own).
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class ResidualEntry:
    """One array kept for the backward pass.

    Attributes:
      shape, dtype: of the array.
      nbytes: ``prod(shape) * dtype.itemsize`` (counted once even if ``count > 1``).
      kind: ``"activation"``, ``"argument"`` or ``"constant"`` (see module docstring).
      source: human-readable origin, e.g. ``"output of cos from model.py:12 (f)"`` or
        ``"argument args[0]['params']['Dense_0']['kernel']"``.
      primitive: the producing primitive for activations (``"cos"``, ``"jit"``, ...), else None.
      argument: the pytree path of the argument (``"args[1]"``, ...) for arguments, else None.
      count: how many times the VJP closure references this same value (>= 1).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    kind: str
    source: str
    primitive: str | None = None
    argument: str | None = None
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype)
        d["shape"] = list(self.shape)
        return d


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """All residuals of ``fn`` w.r.t. ``argnums``; byte totals split by kind."""

    fn_name: str
    argnums: tuple[int, ...]
    entries: list[ResidualEntry]

    def _sum(self, kind: str) -> int:
        return sum(e.nbytes for e in self.entries if e.kind == kind)

    @property
    def activation_bytes(self) -> int:
        """Bytes of residuals produced by forward operations (the backward-only memory)."""
        return self._sum("activation")

    @property
    def argument_bytes(self) -> int:
        """Bytes of positional arguments (any of them) that backward keeps alive."""
        return self._sum("argument")

    @property
    def constant_bytes(self) -> int:
        """Bytes of closed-over arrays and literals that backward keeps alive."""
        return self._sum("constant")

    @property
    def total_bytes(self) -> int:
        """``activation_bytes + argument_bytes + constant_bytes``."""
        return sum(e.nbytes for e in self.entries)

    def by_kind(self, kind: str) -> list[ResidualEntry]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return [e for e in self.entries if e.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {
            "fn": self.fn_name,
            "argnums": list(self.argnums),
            "activation_bytes": self.activation_bytes,
            "argument_bytes": self.argument_bytes,
            "constant_bytes": self.constant_bytes,
            "total_bytes": self.total_bytes,
            "entries": [e.to_dict() for e in self.entries],
        }

    def __str__(self) -> str:
        lines = [
            (f"residuals of {self.fn_name} w.r.t. argnums={self.argnums}: "
            f"activations {self.activation_bytes} B, arguments {self.argument_bytes} B, "
            f"constants {self.constant_bytes} B, total {self.total_bytes} B")
        ]
        for e in self.entries:
            times = f" x{e.count}" if e.count > 1 else ""
            lines.append(
                f"  {e.kind:<10} {e.dtype!s}{list(e.shape)} {e.nbytes} B{times}  {e.source}"
            )
        return "\n".join(lines)


def _aval_nbytes(aval: Any) -> int:
    shape = tuple(getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys): use their physical size
        itemsize = getattr(dtype, "itemsize", 0)
    return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def _eqn_name(eqn: Any) -> str | None:
    """The name given with ``jax.ad_checkpoint.checkpoint_name``, if any."""
    if eqn.primitive.name == "name":
        return eqn.params.get("name")
    p = eqn.params.get("_prim")
    if p is not None and type(p).__name__ == "CheckpointName":
        return getattr(p, "name", None)
    return None


def residual_bytes(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
) -> ResidualReport:
    """Residuals reverse-mode autodiff keeps for backward, in bytes, split by kind.

    Args:
      fn: the function to differentiate; returns a float array / scalar (or a pytree of
        them). Integer or boolean outputs are rejected (not differentiable).
      *args: positional arguments: arrays, Python numbers, or pytrees of them (e.g. a Flax
        ``variables`` dict). Non-array arguments must be listed in ``static_argnums``.
      argnums: which positional arguments are differentiated, as in ``jax.grad``. Every leaf
        of those must have a floating dtype.
      static_argnums: positional arguments passed through untraced (hashability not needed).

    Returns:
      A :class:`ResidualReport`. ``report.activation_bytes`` is the headline figure.

    Raises:
      TypeError: non-callable ``fn``, non-array arguments, integer differentiated arguments,
        non-float outputs.
      ValueError: bad ``argnums``; :class:`TraceError` (a ``ValueError``) when ``fn`` fails to
        trace with these arguments (message names ``fn``; original error chained).
    """
    who = "residual_bytes"
    check_callable(fn, who)
    name = fn_name(fn)
    nargs = len(args)
    if nargs == 0:
        raise ValueError(f"{who}: {name} needs at least one positional argument to differentiate")
    static = normalize_argnums(static_argnums, nargs, who, "static_argnums") \
        if static_argnums != () else ()
    diff = normalize_argnums(argnums, nargs, who, "argnums")
    both = set(static) & set(diff)
    if both:
        raise ValueError(f"{who}: arguments {sorted(both)} are both in argnums and static_argnums")
    dynamic = [i for i in range(nargs) if i not in static]
    check_array_args(args, dynamic, diff, who)

    dyn_args = [args[i] for i in dynamic]
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(dyn_args)
    leaves = [leaf for _, leaf in leaves_with_path]
    arg_paths = [
        f"args[{dynamic[p[0].idx]}]{jax.tree_util.keystr(tuple(p[1:]))}"
        for p, _ in leaves_with_path
    ]

    def full_args(dyn: Sequence[Any]) -> list[Any]:
        out = list(args)
        for i, a in zip(dynamic, dyn):
            out[i] = a
        return out

    def primal(*flat: Any) -> Any:
        return fn(*full_args(jax.tree_util.tree_unflatten(treedef, flat)))

    # 1) output check (cheap abstract trace).
    try:
        out_shape = jax.eval_shape(primal, *leaves)
    except Exception as e:
        raise TraceError(f"{who}: could not trace {name}: {type(e).__name__}: {e}") from e
    for path, o in jax.tree_util.tree_leaves_with_path(out_shape):
        if not jax.numpy.issubdtype(o.dtype, jax.numpy.inexact):
            raise TypeError(
                f"{who}: output{jax.tree_util.keystr(path)} of {name} has dtype {o.dtype}, which "
                "is not differentiable; fn must return float arrays (e.g. the loss)"
            )

    # 2) trace the VJP with the non-differentiated arguments as plain (traced) inputs.
    def linearize(*flat: Any) -> Any:
        full = full_args(jax.tree_util.tree_unflatten(treedef, flat))

        def of_diff(*d: Any) -> Any:
            a = list(full)
            for i, v in zip(diff, d):
                a[i] = v
            return fn(*a)

        return jax.vjp(of_diff, *[full[i] for i in diff])

    try:
        closed, shapes = jax.make_jaxpr(linearize, return_shape=True)(*leaves)
    except Exception as e:
        raise TraceError(f"{who}: could not trace the VJP of {name}: {type(e).__name__}: {e}") \
            from e
    jaxpr = closed.jaxpr
    num_res = len(jax.tree_util.tree_leaves(shapes[1]))
    res_outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res:]
    entries = _classify(jaxpr, res_outvars, arg_paths)
    return ResidualReport(fn_name=name, argnums=diff, entries=list(entries))


def _classify(jaxpr: Any, res_outvars: Sequence[Any], arg_paths: Sequence[str]) -> list[ResidualEntry]:
    # Look through reduce_precision (as saved_residuals does): the producer is its input.
    subst = {
        e.outvars[0]: e.invars[0]
        for e in jaxpr.eqns
        if e.primitive is lax_internal.reduce_precision_p
    }
    counts: dict[Any, int] = {}
    literals: list[Any] = []
    for v in res_outvars:
        if isinstance(v, core.Literal):
            literals.append(v)
            continue
        v = subst.get(v, v)
        counts[v] = counts.get(v, 0) + 1

    def entry(aval: Any, kind: str, source: str, count: int, primitive: str | None = None,
              argument: str | None = None) -> ResidualEntry:
        return ResidualEntry(
            shape=tuple(int(d) for d in getattr(aval, "shape", ())),
            dtype=np.dtype(aval.dtype) if not hasattr(aval.dtype, "_rules") else aval.dtype,
            nbytes=_aval_nbytes(aval),
            kind=kind,
            source=source,
            primitive=primitive,
            argument=argument,
            count=count,
        )

    out: list[ResidualEntry] = []
    for lit in literals:
        out.append(entry(lit.aval, "constant", "a literal", 1))
    for v in jaxpr.constvars:
        if v in counts:
            out.append(entry(v.aval, "constant", "a closed-over constant", counts[v]))
    for i, v in enumerate(jaxpr.invars):
        if v in counts:
            out.append(entry(v.aval, "argument", f"argument {arg_paths[i]}", counts[v],
                             argument=arg_paths[i]))
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v in counts:
                src = source_info_util.summarize(eqn.source_info)
                prim = eqn.primitive.name
                label = _eqn_name(eqn)
                if label:
                    desc = f"named {label!r} from {src}"
                elif prim in ("jit", "pjit"):
                    desc = f"output of jitted function {eqn.params.get('name')!r} from {src}"
                else:
                    desc = f"output of {prim} from {src}"
                out.append(entry(v.aval, "activation", desc, counts[v], primitive=prim))
    found = sum(e.count for e in out if e.source != "a literal") + len(literals)
    if found != len(res_outvars):  # pragma: no cover - would be a JAX internals change
        raise RuntimeError(
            f"residual_bytes: classified {found} of {len(res_outvars)} residuals; the JAX "
            f"version ({jax.__version__}) changed its VJP internals"
        )
    return out
