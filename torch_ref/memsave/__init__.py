"""torch_ref.memsave -- PyTorch reference of selective differentiation (Bhatia & Dangel):
layers that store for backward only what ``ctx.needs_input_grad`` says is needed, and
``convert(model)`` that swaps them into an existing model."""
from torch_ref.memsave import functional
from torch_ref.memsave.layers import *  # noqa: F401,F403
from torch_ref.memsave.layers import __all__ as _layers_all

__all__ = ["functional", *_layers_all]
