"""Reference Flax (Linen) models, twins of ``torch_ref.models`` (same names, same parameters).

Images are NHWC here (NCHW in torch). Activations are called inline (``nn.relu(x)``,
``nn.gelu(x, approximate=...)``) so that interception tools see realistic code. Weight
transfer, exact both ways: ``torch_ref.convert.torch_to_jax`` / ``jax_to_torch``.

Models (see each docstring for the exact layout):

* :class:`ConvChain` -- selective-differentiation paper, Figure 1: 3x3 bias-free size-preserving
  convs (+ ReLU unless ``relu=False``).
* :class:`MLP` -- Dense stack with an inline activation.
* :class:`VGG` / :class:`VGGFeatures` / :func:`vgg16` -- VGG trunk (+BatchNorm optional) and head.
* :class:`ResNet` / :func:`resnet18` / :func:`resnet50` -- BasicBlock / Bottleneck, BatchNorm.
* :class:`GPT` / :class:`GPTConfig` -- GPT-2-style decoder with a tied LM head.
* :class:`ViT` / :class:`ViTConfig` / :func:`vit_tiny` -- ViT encoder.
* :class:`TorchBatchNorm` -- BatchNorm with torch's running-variance rule (unbiased).
* ``jaxmem.models.nnx`` -- Flax NNX versions of ConvChain and MLP.
"""
from .batchnorm import TorchBatchNorm
from .convchain import ConvChain, conv_chain
from .gpt import GPT, GPTConfig, gpt
from .mlp import MLP, MLP_ACTIVATIONS
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50, resnet101
from .transformer import Block, MLPBlock, SelfAttention
from .vgg import VGG, VGG_CFGS, VGGFeatures, vgg, vgg11, vgg16, vgg_features
from .vit import ViT, ViTConfig, vit_tiny

__all__ = [
    "GPT",
    "MLP",
    "MLP_ACTIVATIONS",
    "VGG",
    "VGG_CFGS",
    "BasicBlock",
    "Block",
    "Bottleneck",
    "ConvChain",
    "GPTConfig",
    "MLPBlock",
    "ResNet",
    "SelfAttention",
    "TorchBatchNorm",
    "VGGFeatures",
    "ViT",
    "ViTConfig",
    "conv_chain",
    "gpt",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "vgg",
    "vgg11",
    "vgg16",
    "vgg_features",
    "vit_tiny",
]
