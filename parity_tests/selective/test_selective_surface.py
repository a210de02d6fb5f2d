"""The public surface of jaxmem.selective: every exported function is type-annotated,
``path_str`` writes key paths as ``jax.tree_util.keystr`` does, and ``nnx_value_and_grad``
spells ``argnums`` as jax does (``argnum`` a deprecated alias)."""
from __future__ import annotations

import dataclasses
import inspect
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxmem import JaxmemDeprecationWarning
from jaxmem import selective as S
from jaxmem.selective import nnx as S_nnx


def test_every_exported_function_is_annotated():
    fns = [getattr(S, n) for n in S.__all__ if inspect.isfunction(getattr(S, n))]
    fns += [S_nnx.einsum]
    for fn in fns:
        fn = inspect.unwrap(fn)
        hints = typing.get_type_hints(fn)
        missing = [p for p in inspect.signature(fn).parameters if p not in hints]
        assert not missing and "return" in hints, f"{fn.__name__}: no hints for {missing}"
    assert len(fns) >= 25


def test_nnx_value_and_grad_refuses_conflicting_argnum():
    f = lambda m, x: jnp.sum(m(x))
    with pytest.warns(JaxmemDeprecationWarning), \
            pytest.raises(TypeError, match="argnums=1.*argnum=0"):
        S.nnx_value_and_grad(f, argnums=1, argnum=0)


@dataclasses.dataclass
class _Pair:
    a: jax.Array
    b: list


jax.tree_util.register_dataclass(_Pair, data_fields=["a", "b"], meta_fields=[])


class _Net(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        self.blocks = nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(1))])


@pytest.mark.parametrize("tree", [
    {"params": {"Dense_0": {"kernel": 1, "bias": [2, (3,)]}, "a/b": 4}},
    _Pair(jnp.ones(1), [2, 3]),
    nn.Dense(3).init(jax.random.key(0), jnp.ones((1, 2))),
    nnx.state(_Net()),
], ids=["dict-list-tuple", "dataclass", "linen", "nnx"])
def test_path_str_is_keystr_simple_with_slashes(tree):
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert len(paths) >= 2
    for p in paths:
        assert S.path_str(p) == jax.tree_util.keystr(p, simple=True, separator="/")


def test_path_str_keeps_flattened_index_keys_as_written():
    tree = {"f": jax.tree_util.Partial(lambda a: a, jnp.ones(2))}
    [(path, _)] = jax.tree_util.tree_leaves_with_path(tree)
    assert S.path_str(path) == "f/<flat index 0>/0"
    assert jax.tree_util.keystr(path, simple=True, separator="/") == "f/0/0"
