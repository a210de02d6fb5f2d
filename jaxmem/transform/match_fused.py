"""Bodies the backward pass recomputes whole, and the one rule that differs there.

The body of a ``jax.checkpoint`` without a policy (``nn.remat``'s default, a layer of
``nn.scan(nn.remat(Block))``) is recomputed in the backward pass: whatever its equations keep
for their own backward lives only while the body's backward runs.  Two choices made for a
program whose forward pass is stored differ there (:func:`in_recomputed_body` tells the
matchers where they are):

* an activation re-emitted as the exact smooth op (keeps ``x``, recomputes ``f'``) whose
  output ``f(x)`` is read by exactly one equation, the left operand of a ``dot_general`` /
  convolution re-emitted as a selective product, is re-emitted *together* with that product
  (:func:`fuse_activation_products`, :func:`jaxmem.transform.fused.activation_product`):
  the same ``x`` (and ``w``) kept, ``f(x)`` and ``f'(x)`` recomputed once from one ``x``
  tied to the product's cotangent instead of once per rule, each with its own tie, which
  XLA:GPU cannot fuse and schedules apart (the pre-activation then stays alive through the
  rest of the layer's backward pass: Linen LM under ``nn.scan(nn.remat(...))``, H100 plan
  2.16 MiB separately, 2.04 MiB fused, as when ``f`` was left to JAX; CPU unchanged).
  Only with the XLA of jax < 0.11 (:data:`FUSE_PRODUCTS`): jax 0.11's XLA:GPU schedules the
  two rules well apart and the fused op worse (a scanned remat transformer stack on the H100
  plan, ``test_transform_remat_body.py``: 1.81 MB apart, 2.03 MB fused; jax 0.10: 1.81 apart,
  1.77 fused; the larger stack decides: a 2-layer scanned remat LM of 75 KB goes the other
  way, 77.0 KB apart, 75.0 KB fused);
* with ``fewbit``, such an activation keeps its few-bit code.  Outside, it gets the exact
  op (:func:`~jaxmem.transform.match_elementwise._product_keeps_output`: the product would
  keep ``f(x)`` beside the code through the forward pass); inside, ``x`` is dead once the
  recomputed ``f(x)`` and code exist, and the code replaces the recomputation of ``f'``
  (same Linen LM, fewbit=3: H100 plan 2.16 -> 1.85 MiB, CPU 2.65 -> 2.34 MiB).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax

from jaxmem._prims.ties import vary_like
from jaxmem.transform.graph import Graph
from jaxmem.transform.match import Match

__all__ = ["FUSE_PRODUCTS", "fuse_activation_products", "in_recomputed_body",
           "recomputed_body"]

#: Whether activations in recomputed bodies are re-emitted together with their product (see
#: the module docstring: it lowers XLA:GPU's plan with jax < 0.11 and raises it with 0.11).
FUSE_PRODUCTS: bool = jax.__version_info__ < (0, 11)

_RECOMPUTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxmem_transform_recomputed_body", default=False)


def in_recomputed_body() -> bool:
    """Whether the equations being re-emitted belong to a body that the backward pass
    recomputes whole (a ``jax.checkpoint`` without a policy)."""
    return _RECOMPUTED.get()


@contextlib.contextmanager
def recomputed_body(flag: bool) -> Iterator[None]:
    """Re-emit a body under ``in_recomputed_body() == flag``."""
    token = _RECOMPUTED.set(bool(flag))
    try:
        yield
    finally:
        _RECOMPUTED.reset(token)

_PRODUCTS = ("dot_general", "conv_general_dilated")


def _product_fn(eqn):
    prim = eqn.primitive
    params = prim.get_bind_params(dict(eqn.params))

    def product(a, b):
        # inside shard_map both operands must vary over the same mesh axes (a value the
        # backward pass makes, such as a cotangent, may not)
        return prim.bind(vary_like(a, b), vary_like(b, a), **params)

    return product


def fuse_activation_products(graph: Graph, found: list) -> list:
    """``found`` (the matchers' Matches and Rows, in order) with each exact smooth activation
    that feeds one selective product alone merged into that product's Match (the
    activation's row kept, as a Row, with a note)."""
    from jaxmem.transform.fused import activation_product

    eqns = graph.jaxpr.eqns
    products = {item.anchor: k for k, item in enumerate(found)
                if isinstance(item, Match) and item.row.kind in ("dot", "conv")
                and len(item.eqns) == 1 and eqns[item.anchor].primitive.name in _PRODUCTS}
    out = list(found)
    for k, item in enumerate(found):
        if not (isinstance(item, Match) and item.fn is not None and len(item.outputs) == 1):
            continue
        o = item.outputs[0]
        uses = graph.uses(o)
        if o in graph.outvars or len(uses) != 1 or uses[0] not in products:
            continue
        j = uses[0]
        eqn = eqns[j]
        if eqn.invars[0] is not o or eqn.invars[1] is o:
            continue
        prod = found[products[j]]
        f, product = item.fn, _product_fn(eqn)
        late = eqn.primitive.name == "conv_general_dilated"
        name = _name(item)

        def emit(x, w, _f=f, _p=product, _late=late, _name=name):
            return [activation_product(_f, _p, x, w, name=_name, late=_late)]

        row = dataclasses.replace(prod.row, reason=prod.row.reason + "; re-emitted with "
                                  "the activation it reads (jaxmem.transform.fused)")
        out[products[j]] = Match(item.eqns | prod.eqns, j, [item.inputs[0], eqn.invars[1]],
                                 list(prod.outputs), emit, row)
        out[k] = dataclasses.replace(
            item.row, reason=item.row.reason + "; f(x) and f' recomputed together in the "
            "backward of the product that reads it")
    return out


def _name(item: Match) -> str:
    from jaxmem.transform.match_elementwise import _label
    return _label(item.fn)
