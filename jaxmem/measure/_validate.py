"""Argument checking shared by the measurement functions (clear errors at the boundary)."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


class TraceError(ValueError):
    """The measured function could not be traced with the given arguments.

    Raised by :func:`jaxmem.measure.residual_bytes` and :func:`jaxmem.measure.compiled_memory`
    with a message that names the function; the original exception is chained
    (``__cause__``).
    """


def fn_name(fn: Callable) -> str:
    """A readable name for ``fn`` (used in error messages and reports)."""
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and not hasattr(fn, "__qualname__"):
        return f"partial({fn_name(inner)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        name = type(fn).__name__
    mod = getattr(fn, "__module__", None)
    return f"{mod}.{name}" if mod and mod not in ("__main__", "builtins") else name


def check_callable(fn: Any, who: str) -> None:
    if not callable(fn):
        raise TypeError(f"{who}: `fn` must be callable, got {type(fn).__name__}: {fn!r:.80}")


def normalize_argnums(argnums: Any, nargs: int, who: str, name: str = "argnums") -> tuple[int, ...]:
    """``int`` or sequence of ints -> tuple of non-negative ints, like ``jax.grad``."""
    if isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool):
        seq: Sequence[Any] = (int(argnums),)
    elif isinstance(argnums, (tuple, list)):
        seq = argnums
    else:
        raise TypeError(
            f"{who}: `{name}` must be an int or a tuple of ints, got {type(argnums).__name__}"
        )
    out = []
    for a in seq:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
            raise TypeError(f"{who}: `{name}` entries must be ints, got {a!r}")
        a = int(a)
        if not -nargs <= a < nargs:
            raise ValueError(
                f"{who}: `{name}`={a} is out of range for {nargs} positional argument(s) "
                f"(allowed: {-nargs}..{nargs - 1})"
            )
        out.append(a % nargs)
    if len(set(out)) != len(out):
        raise ValueError(f"{who}: `{name}` has repeated entries: {tuple(seq)}")
    return tuple(out)


def is_array_leaf(x: Any) -> bool:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return True
    return isinstance(x, numbers.Number)


def leaf_dtype(x: Any) -> np.dtype:
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype)
    return np.asarray(x).dtype


def check_array_args(
    args: Sequence[Any],
    dynamic: Sequence[int],
    diff: Sequence[int],
    who: str,
) -> None:
    """Every leaf of a dynamic argument must be an array or a Python number; every leaf of a
    differentiated argument must have a floating (or complex) dtype."""
    for i in dynamic:
        leaves = jax.tree_util.tree_leaves_with_path(args[i])
        if i in diff and not leaves:
            raise ValueError(f"{who}: argument {i} is differentiated (in argnums) but has no array "
                             "leaves")
        for path, leaf in leaves:
            where = f"args[{i}]{jax.tree_util.keystr(path)}"
            if not is_array_leaf(leaf):
                raise TypeError(
                    f"{who}: {where} is a {type(leaf).__name__}, not an array; positional "
                    "arguments must be arrays, Python numbers or pytrees of them (mark "
                    "non-array arguments with `static_argnums` or close over them with "
                    "functools.partial)"
                )
            if i in diff:
                dt = leaf_dtype(leaf)
                if not jax.numpy.issubdtype(dt, jax.numpy.inexact):
                    raise TypeError(
                        f"{who}: {where} has dtype {dt}, which is not differentiable; arguments "
                        "in `argnums` must have floating dtypes (float16/bfloat16/float32/"
                        "float64) — move integer arguments out of `argnums`"
                    )
