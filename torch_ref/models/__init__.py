"""Torch twins of ``jaxmem.models``: same architectures, same parameter names and layout
(up to the kernel transposes that ``torch_ref.convert`` does), NCHW images.

Activations are ``nn.Module`` instances (``self.relu``, ``self.act``; not in-place) so that
module-swapping tools (the selective-differentiation paper's drop-in layers) can replace them.
"""
from .convchain import ConvChain, conv_chain
from .gpt import GPT, GPTConfig, gpt
from .mlp import MLP_ACTIVATIONS, MLP
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50, resnet101
from .transformer import Block, MLPBlock, SelfAttention
from .vgg import VGG, VGG_CFGS, VGGFeatures, vgg, vgg11, vgg16, vgg_features
from .vit import ViT, ViTConfig, vit_tiny

__all__ = [
    "MLP_ACTIVATIONS",
    "GPT",
    "MLP",
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
