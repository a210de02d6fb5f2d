"""``fewbit=b`` where a product reads the activation: a code or the exact op, decided once
for the whole program.

A smooth activation ``f(x)`` read by a product that is re-emitted as a selective bilinear op
can be stored two ways under ``fewbit=b``:

* **exact** (:func:`jaxmem.selective.smooth_activation`): ``x`` is kept and the product
  recomputes ``f(x)`` from it -- ``E * s`` bytes per site (``E`` elements of ``s`` bytes);
* **code**: the product keeps ``f(x)`` and the activation a ``b``-bit code of ``x`` --
  ``E * (s + b / 8)``: ``b / 8`` bytes per element more, at every site (times a ``scan``'s
  length).

But the exact op's backward holds the recomputed ``f(x)`` beside the cotangents, once, at
the peak (the last layer's backward, where every stored residual is still alive); the code
needs no such buffer. Measured on XLA:CPU and the H100 plan (Linen LM, NNX ViT at depth 2 to
12, ``benchmarks/results/third_party/fewbit_after_product.md``), that working-set term is
about ``0.75 E s`` of the largest site, and the code wins below 8 f32 sites at 3 bits. So
the whole program is counted first (:func:`count`: the matchers run without emitting
anything, every site the rule would make exact weighted by its enclosing ``scan`` lengths)
and the code is kept after products iff ``sum(E b / 8) < 0.75 max(E s)`` and no site is
inside a ``scan`` body (:func:`code_after_products` is then true while the program is
re-emitted). Inside a ``scan`` the layers' residuals are stacked and the body's backward runs
per iteration, and the code measured larger (a scanned two-layer Linen GELU LM on XLA:CPU:
78.1 vs 73.1 KB). A program the count cannot re-trace gets the exact op. The rule does not
see where XLA puts the peak: where it is elsewhere (Hugging Face BERT and GPT-2 at 4 layers,
H100 plan) the codes cost their bytes, 0.5-1.5 MiB there.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import numpy as np

from jaxmem._compat import core

__all__ = ["WORKING_SET", "code_after_products", "count", "deciding", "note_site"]

#: the backward working-set term the exact op adds at the peak, as a fraction of the
#: largest site's ``f(x)`` bytes (measured: 0.75 on XLA:CPU, 0.7-0.9 on the H100 plan)
WORKING_SET = 0.75

_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxmem_transform_code_after_products", default=False)
#: while :func:`count` runs: ``[multiplicity, in a scan, [(elements x multiplicity, bytes,
#: in a scan), ...]]``
_SITES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxmem_transform_fewbit_sites", default=None)


def code_after_products() -> bool:
    """Whether a few-bit code is kept where a product reads the activation (this trace)."""
    return _CODE.get()


def note_site(x) -> None:
    """Count an activation input ``x`` that the product rule would keep exact."""
    acc = _SITES.get()
    if acc is not None:
        n = int(np.prod(x.aval.shape))
        acc[2].append((n * acc[0], n * np.dtype(x.aval.dtype).itemsize, acc[1]))


def _bodies(eqn):
    """``(closed jaxpr, multiplicity)`` of the bodies the interpreter enters and re-emits
    with the product rule (a checkpoint without a policy is recomputed whole: the rule does
    not apply there; ``cond`` branches all counted: an upper bound)."""
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        return [(p["jaxpr"], int(p["length"]))]
    if name == "while":
        return [(p["body_jaxpr"], 1)]
    if name == "cond":
        return [(b, 1) for b in p["branches"]]
    if name in ("remat2", "checkpoint"):
        return [] if p.get("policy") is None else [(core.ClosedJaxpr(p["jaxpr"], ()), 1)]
    if name == "shard_map":
        return [(core.ClosedJaxpr(p["jaxpr"], ()), 1)]
    return []


def count(interp, closed, avals, mult: int = 1, in_scan: bool = False,
          path: str = "") -> list:
    """The sites of ``closed`` (and the bodies it enters) the product rule would make exact:
    ``[(elements x multiplicity, bytes of f(x), inside a scan), ...]``; nothing is emitted
    or recorded."""
    from jaxmem.transform.graph import Graph, inline_calls
    from jaxmem.transform.report import muted

    sites: list = [mult, in_scan, []]
    token = _SITES.set(sites)
    try:
        with muted():
            flat = inline_calls(closed, avals)
            interp.plan(Graph.build(flat.jaxpr, flat.consts), path)
    finally:
        _SITES.reset(token)
    out = list(sites[2])
    for eqn in flat.jaxpr.eqns:
        for body, k in _bodies(eqn):
            avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals]
            out += count(interp, body, avals, mult * k,
                         in_scan or eqn.primitive.name == "scan", path)
    return out


@contextlib.contextmanager
def deciding(interp, closed, avals) -> Iterator[None]:
    """Re-emit ``closed`` with the code kept after products iff it keeps fewer bytes
    (module docstring); nothing to decide without ``fewbit``."""
    opts = interp.options
    if opts.fewbit is None or not (opts.products and opts.activations):
        yield
        return
    try:
        sites = count(interp, closed, avals)
    except Exception:  # noqa: BLE001 -- a body the count cannot re-trace: the exact op
        sites = []
    code = (bool(sites) and not any(s for _, _, s in sites)
            and sum(n for n, _, _ in sites) * opts.fewbit / 8
            < WORKING_SET * max(b for _, b, _ in sites))
    token = _CODE.set(code)
    try:
        yield
    finally:
        _CODE.reset(token)
