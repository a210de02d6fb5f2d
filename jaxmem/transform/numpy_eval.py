"""Jaxpr equations evaluated in NumPy, every float in float64.

The matchers check what a traced region computes by evaluating it on random probe points
(:mod:`~jaxmem.transform.match_norm` compares a candidate normalisation with its definition
in float64). Binding each primitive eagerly in JAX compiles one XLA program per primitive and
shape, which made that check most of a transformation's trace time; the handful of
primitives such regions consist of are evaluated here in NumPy instead, with JAX's
semantics (``lax.div`` of integers rounds toward zero, ``select_n`` picks ``cases[which]``,
``broadcast_in_dim`` maps operand dimensions to ``broadcast_dimensions``). Anything else
raises :class:`Unsupported`, and the caller evaluates the region with JAX.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._compat import core
from jaxmem.transform.graph import is_literal

__all__ = ["Unsupported", "as_float64", "eval_eqn"]


class Unsupported(NotImplementedError):
    """An equation :func:`eval_eqn` does not evaluate (the caller falls back to JAX)."""


def as_float64(val) -> np.ndarray:
    """``val`` as a NumPy array, floats (and complex: unsupported) widened to float64."""
    a = np.asarray(val)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise Unsupported("complex values")
    if jnp.issubdtype(a.dtype, jnp.floating):      # bfloat16 & co. included
        return a.astype(np.float64)
    if a.dtype.kind == "V":                        # int4 & co.
        raise Unsupported(f"values of {a.dtype}")
    return a


def _rsqrt(a):
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 / np.sqrt(a)


def _logistic(a):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a))


_UNARY = {
    "neg": np.negative, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log1p": np.log1p,
    "expm1": np.expm1, "tanh": np.tanh, "logistic": _logistic, "sqrt": np.sqrt,
    "rsqrt": _rsqrt, "cbrt": np.cbrt, "abs": np.abs, "sign": np.sign, "square": np.square,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh,
    "acosh": np.arccosh, "atanh": np.arctanh, "floor": np.floor, "ceil": np.ceil,
    "is_finite": np.isfinite, "copy": np.copy, "copy_p": np.copy,
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
    "min": np.minimum, "pow": np.power, "atan2": np.arctan2, "rem": np.fmod,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "gt": np.greater,
    "ge": np.greater_equal, "lt": np.less, "le": np.less_equal, "eq": np.equal,
    "ne": np.not_equal, "nextafter": np.nextafter,
}
#: identities on values (casts of ``shard_map``'s varying mesh axes)
_IDENTITY = {"pvary", "pcast"}
#: calls whose body is evaluated equation by equation
_CALLS = {"custom_jvp_call", "jit", "pjit", "closed_call"}


def _div(a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):    # lax.div: rounds toward zero
        q = np.abs(a) // np.abs(b)
        return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(a, b)


def _convert(a, params):
    new = params["new_dtype"]
    if _is_extended(new) or jnp.issubdtype(new, jnp.complexfloating):
        raise Unsupported(f"conversion to {new}")
    new = np.dtype(new)
    if jnp.issubdtype(new, jnp.floating):
        return a.astype(np.float64)
    if new.kind == "V":
        raise Unsupported(f"conversion to {new}")
    if new == np.bool_:
        return a != 0
    if np.issubdtype(a.dtype, np.floating):             # lax: float -> int truncates
        if not np.all(np.isfinite(a)):
            raise Unsupported("a non-finite float converted to an integer")
        return np.trunc(a).astype(new)
    return a.astype(new)


def _is_extended(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)     # PRNG key types


def _broadcast_in_dim(a, params, root_shape, x_shape):
    shape = tuple(params["shape"])
    if shape == tuple(root_shape):
        shape = tuple(x_shape)
    dims = tuple(params["broadcast_dimensions"])
    expanded = [1] * len(shape)
    for d, n in zip(dims, a.shape):
        expanded[d] = n
    return np.broadcast_to(a.reshape(expanded), shape)


def _reduce(fn, a, params):
    return fn(a, axis=tuple(params["axes"]))


def _slice(a, params):
    strides = params.get("strides") or (1,) * a.ndim
    return a[tuple(slice(s, e, st) for s, e, st in
                   zip(params["start_indices"], params["limit_indices"], strides))]


def _call(eqn, invals, root_shape, x_shape):
    closed = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    body = closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed
    env = dict(zip(body.invars, invals))
    if isinstance(closed, core.ClosedJaxpr):
        env.update(zip(body.constvars, (as_float64(c) for c in closed.consts)))
    for e in body.eqns:
        ins = [as_float64(v.val) if is_literal(v) else env[v] for v in e.invars]
        env.update(zip(e.outvars, eval_eqn(e, ins, root_shape, x_shape)))
    return [as_float64(v.val) if is_literal(v) else env[v] for v in body.outvars]


def eval_eqn(eqn, invals: list, root_shape=(), x_shape=()) -> list[np.ndarray]:
    """``eqn``'s outputs for NumPy inputs ``invals`` (floats already float64), as a list.

    A ``broadcast_in_dim`` to ``root_shape`` broadcasts to ``x_shape`` instead (a region
    evaluated at another shape than it was traced at). Raises :class:`Unsupported` for a
    primitive or parameter it does not evaluate."""
    name = eqn.primitive.name
    p = eqn.params
    if name in _CALLS:
        return _call(eqn, invals, root_shape, x_shape)
    if name in _IDENTITY:
        return list(invals)
    if name in _UNARY:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return [np.asarray(_UNARY[name](invals[0]))]
    if name in _BINARY:
        a, b = invals
        if name in {"and", "or", "xor"} and (a.dtype.kind == "f" or b.dtype.kind == "f"):
            raise Unsupported(f"{name} of floats")
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return [np.asarray(_BINARY[name](a, b))]
    if name == "div":
        return [np.asarray(_div(*invals))]
    if name == "not":
        a = invals[0]
        return [np.logical_not(a) if a.dtype == np.bool_ else np.invert(a)]
    if name == "integer_pow":
        a, y = invals[0], int(p["y"])
        if a.dtype.kind != "f" and y < 0:
            raise Unsupported("a negative integer power of integers")
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return [np.asarray(np.power(a, y))]
    if name == "select_n":
        which, *cases = invals
        if which.dtype == np.bool_:
            which = which.astype(np.int32)
        shape = np.broadcast_shapes(which.shape, *(c.shape for c in cases))
        return [np.choose(np.broadcast_to(which, shape),
                          [np.broadcast_to(c, shape) for c in cases])]
    if name == "clamp":
        lo, a, hi = invals
        return [np.minimum(np.maximum(a, lo), hi)]
    if name == "convert_element_type":
        return [_convert(invals[0], p)]
    if name == "reduce_sum":
        return [np.asarray(_reduce(np.sum, invals[0], p))]
    if name == "reduce_max":
        return [np.asarray(_reduce(np.max, invals[0], p))]
    if name == "reduce_min":
        return [np.asarray(_reduce(np.min, invals[0], p))]
    if name == "broadcast_in_dim":
        return [_broadcast_in_dim(invals[0], p, root_shape, x_shape)]
    if name == "reshape":
        if p.get("dimensions") is not None:
            raise Unsupported("reshape with dimensions")
        new = tuple(p["new_sizes"])
        if math.prod(new) != invals[0].size:      # traced at another shape
            raise Unsupported("reshape of a region evaluated at another shape")
        return [invals[0].reshape(new)]
    if name == "squeeze":
        return [np.squeeze(invals[0], axis=tuple(p["dimensions"]))]
    if name == "expand_dims":
        return [np.expand_dims(invals[0], tuple(p["dimensions"]))]
    if name == "transpose":
        return [np.transpose(invals[0], tuple(p["permutation"]))]
    if name == "slice":
        return [_slice(invals[0], p)]
    if name == "stack":
        return [np.stack(invals, axis=p["axis"])]
    if name == "concatenate":
        return [np.concatenate(invals, axis=p["dimension"])]
    raise Unsupported(f"primitive {name}")
