"""The ``jax.checkpoint`` policy under which a converted ``lax.scan`` body runs.

Under ``lax.scan`` JAX stacks each iteration's residuals exactly as it chose them, and XLA
cannot recompute elementwise values across the loop as it does in an unrolled network; the
stacked parameter gradients are live for the whole backward loop beside every stacked
residual. :func:`scan_policy` keeps what JAX's autodiff keeps except values that are cheap to
recompute and not smaller than what they are made from (see its docstring).
:func:`has_remat` / effects decide whether a body is left as written.
"""
from __future__ import annotations

__all__ = ["has_remat", "scan_policy"]


#: Primitives whose result a converted scan body recomputes in the backward pass instead of
#: stacking it: elementwise arithmetic and layout changes, none of which makes its result
#: smaller than its largest input (comparisons give ``bool`` and slices crop: those are kept).
_RECOMPUTED = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate", "conj", "copy", "cos", "cosh",
    "digamma", "div", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "imag",
    "integer_pow", "iota", "lgamma", "log", "log1p", "logistic", "max", "min", "mul", "neg",
    "nextafter", "not", "or", "pow", "real", "rem", "reshape", "rev", "round", "rsqrt",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "squeeze", "sub", "tan", "tanh", "transpose", "xor",
})


#: Suffix of the ``checkpoint_name`` tag that a selective layer puts on the input it keeps
#: for its weight gradient (``jaxmem.selective.dense.input``, ``...conv.input``, ...).
_LAYER_INPUT = ".input"
_TAG_PREFIX = "jaxmem.selective."
_NORM_INPUT = "jaxmem.selective.norm.input"


def _nbytes(aval) -> int:
    import numpy as np
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except (AttributeError, TypeError):  # no shape or an extended dtype: count as large
        return 1 << 62


def _dot_expands(avals, params) -> bool:
    """Whether a ``dot_general`` result takes more bytes than its two operands together
    (an expanding projection such as ``d -> 4d`` when the batch is larger than the weight)."""
    import numpy as np
    if len(avals) != 2:
        return False
    lhs, rhs = avals
    try:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        out_dtype = params.get("preferred_element_type") or np.result_type(lhs.dtype, rhs.dtype)
        free_l = [d for i, d in enumerate(lhs.shape) if i not in lc and i not in lb]
        free_r = [d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]
        out = int(np.prod([lhs.shape[i] for i in lb] + free_l + free_r, dtype=np.int64))
        out_bytes = out * np.dtype(out_dtype).itemsize
    except (AttributeError, KeyError, TypeError, ValueError):  # unknown layout: keep
        return False
    return out_bytes > _nbytes(lhs) + _nbytes(rhs)


#: Call primitives whose result is recomputed when everything they call is
#: (``jax.nn.relu`` is a ``custom_jvp`` of ``max(x, 0)``).
_CALLS = frozenset({"custom_jvp_call", "jit", "pjit", "closed_call"})


def _only_recomputed(jaxpr) -> bool:
    """Whether ``scan_policy`` recomputes every equation of ``jaxpr`` (nested calls too)."""
    for eqn in jaxpr.eqns:
        avals = [v.aval for v in eqn.invars]
        if scan_policy(eqn.primitive, *avals, **eqn.params):
            return False
    return True


def scan_policy(prim, *avals, **params) -> bool:
    """The ``jax.checkpoint`` policy of a scan body traced inside a scope: ``True`` = keep.

    Keeps what JAX's autodiff keeps (named residuals, matmuls, convolutions, reductions,
    gathers, comparisons, slices, narrowing casts) except

    * the results of elementwise and layout primitives (``_RECOMPUTED``, widening casts)
      and of calls made only of them (``jax.nn.relu``'s ``custom_jvp``), recomputed from
      what is kept -- what XLA's fusion does in an unrolled network;
    * an expanding ``dot_general`` (result bytes > both operands' bytes together, e.g. the
      ``d -> 4d`` projection of an MLP or attention's ``q k^T``): recomputed from its
      operands, one matmul in the backward pass instead of a stacked result that is larger
      than what it is made from;
    * the input a selective layer tags for its weight gradient (``jaxmem.selective.<layer>
      .input``, other than a normalisation's input): it is not kept under that name but
      rebuilt from what the rules above keep (a ReLU MLP's hidden activation from the
      first Dense's input, through the recomputed projection).

    Why more recomputation than an unrolled network needs: unrolled, XLA places residuals in
    the gradient output buffers of layers whose backward has not run yet; under ``lax.scan``
    the stacked parameter gradients are live for the whole backward loop beside every
    stacked residual, so each per-layer residual byte costs its full size. Values, and hence
    gradients, are unchanged: the backward recomputes the very same operations.
    """
    name = getattr(prim, "name", "")
    if name == "convert_element_type" and avals:
        import numpy as np
        new = params.get("new_dtype")
        try:
            return np.dtype(new).itemsize < np.dtype(avals[0].dtype).itemsize
        except TypeError:  # extended dtypes (keys): keep
            return True
    if name == "dot_general":
        return not _dot_expands(avals, params)
    if name in _CALLS:
        inner = params.get("call_jaxpr", params.get("jaxpr"))
        return not (inner is not None and _only_recomputed(getattr(inner, "jaxpr", inner)))
    if name == "name":
        tag = str(params.get("name", ""))
        return not (tag.startswith(_TAG_PREFIX) and tag.endswith(_LAYER_INPUT)
                    and tag != _NORM_INPUT)
    return name not in _RECOMPUTED


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for u in (v if isinstance(v, (tuple, list)) else (v,)):
            j = getattr(u, "jaxpr", u)
            if hasattr(j, "eqns"):
                yield j


def has_remat(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr it calls) already holds a ``jax.checkpoint``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("remat2", "checkpoint"):
            return True
        if any(has_remat(j) for j in _subjaxprs(eqn)):
            return True
    return False
