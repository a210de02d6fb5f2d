"""Products scaled by a parameter: the product's output materialised once.

A layer scale ``gamma * (x W + b)`` (BEiT, DINOv2, CaiT, ConvNeXt), or any ``mul`` of a
matrix product's output by an input of the function, makes autodiff keep that output ``h`` for
the factor's gradient ``d gamma = sum(g * h)``. XLA:GPU computes a GEMM with a small output
and a long contraction as a split-K GEMM: ``S`` partial products ``(S, M, N)`` and a reduction
over them. It fuses that reduction (and the bias add) into every consumer of ``h`` -- the
backward's ``sum(g * h)`` too -- so what stays alive until the backward pass is the
``S``-times larger partial sums, not ``h`` (measured on the H100 plan: Hugging Face BEiT kept
``(8, 520, 256)`` and ``(4, 520, 256)`` float32 partials per layer, 6 MiB where ``h`` is 1).

:func:`scaled_products` finds such ``mul`` equations; the interpreter binds them with the
product's output passed through :func:`materialised` (``lax.optimization_barrier`` off CPU,
:func:`jaxmem._prims.ties.barrier_off_cpu`): the reduction runs once, in the forward pass,
and the barrier's output -- ``h`` itself, bit for bit -- is what both the forward's product
and the factor's gradient read. On XLA:CPU it is nothing (no split-K there; XLA:CPU drops the
barrier anyway). Exact: no value changes.
"""
from __future__ import annotations

import math

import numpy as np

from jaxmem._compat import core
from jaxmem.transform.graph import Graph, call_location, is_literal, name_stack
from jaxmem.transform.match import aval_str
from jaxmem.transform.report import Row, record

__all__ = ["materialised", "scaled_products"]

#: equations between a product and the ``mul`` that move or cast its output unchanged
_MOVES = {"reshape", "convert_element_type", "transpose", "copy"}
#: equations between a function input and the factor that spread or cast it
_BROADCASTS = {"broadcast_in_dim", "reshape", "convert_element_type", "copy", "squeeze",
               "expand_dims"}
#: how many such steps (and bias adds) :func:`_from_product` looks through
_MAX_STEPS = 4


def _from_product(graph: Graph, v) -> bool:
    """Whether ``v`` is a ``dot_general``'s output, possibly moved, cast or with a bias (an
    ``add`` / ``sub`` with one operand of the result's own shape) added on the way."""
    for _ in range(_MAX_STEPS + 1):
        eqn = graph.eqn(v)
        if eqn is None:
            return False
        name = eqn.primitive.name
        if name == "dot_general":
            return True
        if name in _MOVES:
            v = eqn.invars[0]
        elif name in ("add", "sub"):
            shape = eqn.outvars[0].aval.shape
            whole = [u for u in eqn.invars if not is_literal(u) and u.aval.shape == shape]
            if len(whole) != 1:
                return False
            v = whole[0]
        else:
            return False
    return False


def _input_factor(graph: Graph, v) -> bool:
    """Whether ``v`` is a float input of the function (a parameter: a layer scale's
    ``gamma``), possibly broadcast, reshaped, cast or multiplied by constants -- not a value
    computed from other traced values (a rotary embedding's ``cos``, which has no gradient
    to read the product for)."""
    if not np.issubdtype(v.aval.dtype, np.inexact):
        return False
    for _ in range(_MAX_STEPS + 1):
        if is_literal(v):
            return False
        eqn = graph.eqn(v)
        if eqn is None:
            return v not in graph.consts
        if eqn.primitive.name in _BROADCASTS:
            v = eqn.invars[0]
        elif eqn.primitive.name in ("mul", "div"):   # a constant multiple of a parameter
            traced = [u for u in eqn.invars if not (is_literal(u) or graph.is_const(u))]
            if len(traced) != 1:
                return False
            v = traced[0]
        else:
            return False
    return False


def scaled_products(graph: Graph) -> dict[int, tuple]:
    """``{equation index: operand positions}`` of every ``mul`` whose operand at those
    positions is a float product's output (:func:`_from_product`) of more than one element
    and whose other operand is an input of the function (:func:`_input_factor`: a
    parameter, whose gradient autodiff keeps that output for). The interpreter reads it for
    the equations it binds unchanged only (a match re-emits its own)."""
    out = {}
    for i, eqn in enumerate(graph.jaxpr.eqns):
        if eqn.primitive.name != "mul" or len(eqn.invars) != 2:
            continue
        a, b = eqn.invars
        which = tuple(k for k, (x, other) in enumerate(((a, b), (b, a)))
                      if _input_factor(graph, other) and math.prod(x.aval.shape) > 1
                      and np.issubdtype(x.aval.dtype, np.inexact) and _from_product(graph, x))
        if which:
            out[i] = which
    return out


def materialised(eqn, invals: list, which: tuple, path: str) -> list:
    """``invals`` of the ``mul`` ``eqn`` with the operands at ``which`` passed through one
    ``lax.optimization_barrier`` off CPU (unchanged on CPU); its ``"scale"`` report row."""
    from jaxmem._prims.ties import barrier_off_cpu
    record(Row("scale", f"mul {aval_str(eqn.outvars[0])} of a product's output by a "
               "parameter", "the product's output materialised once (optimization_barrier off "
               "CPU; exact)", True, "the factor's gradient reads the product's output, not "
               "the partial sums of a split-K GEMM (XLA:GPU)", call_location(eqn),
               name_stack(eqn), path))
    vals = list(invals)
    for k in which:
        if isinstance(vals[k], core.Tracer):
            vals[k] = barrier_off_cpu(vals[k])
    return vals
