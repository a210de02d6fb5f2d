"""Flax NNX versions of :class:`~jaxmem.models.ConvChain` and :class:`~jaxmem.models.MLP`.

Same layers, same attribute names (``conv_0 ..``, ``dense_0 ..``) and the same parameter
layout as the Linen modules, so a Linen ``params`` tree (and hence a torch twin, through
``torch_ref.convert.torch_to_jax``) loads into them with :func:`load_params`, and
:func:`params_of` gives the Linen-layout tree back (e.g. for ``jax_to_torch``)::

    chain = ConvChainNNX(depth=8, channels=8, rngs=nnx.Rngs(0))
    load_params(chain, torch_to_jax(torch_chain)["params"])
    y = chain(x)                     # == ConvChain(8, 8).apply(variables, x)

Activations are called inline (``nnx.relu``, ``nnx.gelu`` -- the same functions as
``flax.linen``'s). Only these two models have NNX versions; the others are Linen only.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .convchain import chain_kernel_init
from .mlp import MLP_ACTIVATIONS


class ConvChainNNX(nnx.Module):
    """NNX twin of :class:`~jaxmem.models.ConvChain` (NHWC, 3x3 bias-free convs [+ ReLU])."""

    def __init__(self, depth: int = 8, channels: int = 8, relu: bool = True, *,
                 dtype: Any = None, rngs: nnx.Rngs):
        if not (isinstance(depth, int) and depth >= 1):
            raise ValueError(f"ConvChainNNX: depth must be an int >= 1, got {depth!r}")
        self.depth, self.channels, self.relu = depth, channels, relu
        for i in range(depth):
            setattr(self, f"conv_{i}", nnx.Conv(
                channels, channels, (3, 3), strides=1, padding=((1, 1), (1, 1)), use_bias=False,
                dtype=dtype, kernel_init=chain_kernel_init(relu), rngs=rngs))

    def __call__(self, x):
        if x.ndim != 4 or x.shape[-1] != self.channels:
            raise ValueError(f"ConvChainNNX: input must be NHWC with {self.channels} channels, "
                             f"got shape {tuple(x.shape)}")
        for i in range(self.depth):
            x = getattr(self, f"conv_{i}")(x)
            if self.relu:
                x = nnx.relu(x)
        return x


def _act(name: str, x):
    if name == "relu":
        return nnx.relu(x)
    if name == "gelu":
        return nnx.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return nnx.gelu(x, approximate=True)
    if name == "silu":
        return nnx.silu(x)
    if name == "tanh":
        return nnx.tanh(x)
    if name == "sigmoid":
        return nnx.sigmoid(x)
    if name == "none":
        return x
    raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {name!r}")


class MLPNNX(nnx.Module):
    """NNX twin of :class:`~jaxmem.models.MLP`; needs ``in_features`` (NNX is eager)."""

    def __init__(self, in_features: int, features: Sequence[int] = (256, 256, 10),
                 activation: str = "relu", use_bias: bool = True, *, dtype: Any = None,
                 rngs: nnx.Rngs):
        if len(features) == 0:
            raise ValueError("MLPNNX: features must name at least one layer width")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MLPNNX: activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
        self.n, self.activation = len(features), activation
        d = in_features
        for i, f in enumerate(features):
            setattr(self, f"dense_{i}", nnx.Linear(d, int(f), use_bias=use_bias, dtype=dtype,
                                                   rngs=rngs))
            d = int(f)

    def __call__(self, x):
        for i in range(self.n):
            x = getattr(self, f"dense_{i}")(x)
            if i < self.n - 1:
                x = _act(self.activation, x)
        return x


def params_of(model: nnx.Module) -> dict:
    """The model's parameters as a plain Linen-layout dict (``{'conv_0': {'kernel': ...}}``)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_params(model: nnx.Module, params: Any) -> nnx.Module:
    """Load a Linen-layout ``params`` tree into ``model`` in place (and return it).

    Raises ``ValueError`` naming the parameter when names or shapes differ.
    """
    state = nnx.state(model, nnx.Param)
    want = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    have = dict(jax.tree_util.tree_leaves_with_path(params))
    want_d = dict(want)
    for path, leaf in want:
        name = jax.tree_util.keystr(path)
        if path not in have:
            raise ValueError(f"load_params: params lack {name}")
        if tuple(jnp.shape(have[path])) != tuple(leaf.shape):
            raise ValueError(f"load_params: shape mismatch for {name}: got "
                             f"{tuple(jnp.shape(have[path]))}, model has {tuple(leaf.shape)}")
    extra = [jax.tree_util.keystr(p) for p in have if p not in want_d]
    if extra:
        raise ValueError(f"load_params: {extra[0]} has no counterpart in {type(model).__name__}")
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


__all__ = ["MLPNNX", "ConvChainNNX", "load_params", "params_of"]
