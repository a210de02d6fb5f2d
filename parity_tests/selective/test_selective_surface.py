"""The public surface of jaxmem.selective: every exported function is type-annotated, and
``nnx_value_and_grad`` spells ``argnums`` as jax does (``argnum`` a deprecated alias)."""
from __future__ import annotations

import inspect
import typing

import jax.numpy as jnp
import pytest

from jaxmem import selective as S
from jaxmem.selective import linen as S_linen
from jaxmem.selective import nnx as S_nnx


def test_every_exported_function_is_annotated():
    fns = [getattr(S, n) for n in S.__all__ if inspect.isfunction(getattr(S, n))]
    fns += [S_linen.convert, S_linen.scope, S_linen.wrap, S_nnx.convert, S_nnx.einsum]
    for fn in fns:
        fn = inspect.unwrap(fn)
        hints = typing.get_type_hints(fn)
        missing = [p for p in inspect.signature(fn).parameters if p not in hints]
        assert not missing and "return" in hints, f"{fn.__name__}: no hints for {missing}"
    assert len(fns) >= 25


def test_nnx_value_and_grad_refuses_conflicting_argnum():
    f = lambda m, x: jnp.sum(m(x))  # noqa: E731
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="argnums=1.*argnum=0"):
        S.nnx_value_and_grad(f, argnums=1, argnum=0)
