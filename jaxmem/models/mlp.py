"""Multi-layer perceptron: Dense -> act -> Dense -> act -> ... -> Dense.

``features=(h1, ..., hk, out)``: ``len(features)`` Dense layers named ``dense_0 ..``, the
activation (called inline, e.g. ``nn.relu(x)``) after every layer but the last. Kernels are
``(in, out)`` (torch ``nn.Linear.weight`` is ``(out, in)``; ``torch_ref.convert`` transposes).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn

MLP_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "none")


def apply_activation(name: str, x):
    """Call the named activation inline through ``flax.linen`` (so it can be intercepted).

    ``gelu`` is the exact (erf) GELU, ``gelu_tanh`` the tanh approximation.
    """
    if name == "relu":
        return nn.relu(x)
    if name == "gelu":
        return nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return nn.gelu(x, approximate=True)
    if name == "silu":
        return nn.silu(x)
    if name == "tanh":
        return nn.tanh(x)
    if name == "sigmoid":
        return nn.sigmoid(x)
    if name == "none":
        return x
    raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {name!r}")


class MLP(nn.Module):
    """Dense stack with an inline activation between layers.

    Attributes:
      features: output width of each Dense layer; the last entry is the output size.
      activation: one of ``MLP_ACTIVATIONS`` ('relu' default; 'gelu' = erf GELU).
      use_bias: Dense biases.
      dtype: computation dtype.

    Call: ``model.apply(variables, x)`` with ``x`` of shape ``(..., in_features)``.
    """

    features: Sequence[int] = (256, 256, 10)
    activation: str = "relu"
    use_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        if len(self.features) == 0:
            raise ValueError("MLP: features must name at least one layer width")
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MLP: activation must be one of {MLP_ACTIVATIONS}, got {self.activation!r}")
        n = len(self.features)
        for i, f in enumerate(self.features):
            x = nn.Dense(int(f), use_bias=self.use_bias, dtype=self.dtype, name=f"dense_{i}")(x)
            if i < n - 1:
                x = apply_activation(self.activation, x)
        return x


__all__ = ["MLP", "MLP_ACTIVATIONS", "apply_activation"]
