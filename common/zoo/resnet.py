"""ResNet-18 and ResNet-50 for 32x32 inputs.

CIFAR adaptation: a 3x3 stride-1 stem and no max-pool, so the four stages see
32, 16, 8 and 4 px. Each residual block, skip included, is one placeable layer.
"""

import torch
from torch import nn

from common.zoo._layers import ConvBNAct, PoolClassifier, init_conv_bn
from common.zoo._model import IMAGE_INPUT, ZooModel
from common.zoo._options import Options
from common.zoo._sizes import BASIC_EXPANSION, BOTTLENECK_EXPANSION
from common.zoo._sizes import RESNET18 as _RESNET18
from common.zoo._sizes import RESNET50 as _RESNET50
from common.zoo._sizes import RESNET_PLANES as _PLANES
from common.zoo._types import ModelSpec

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "build_resnet18",
    "build_resnet50",
]


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module | None:
    """Project the skip path when the block changes resolution or width."""
    if stride == 1 and in_channels == out_channels:
        return None
    return ConvBNAct(in_channels, out_channels, 1, stride=stride, activation=None)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or projected) skip."""

    expansion = BASIC_EXPANSION

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = ConvBNAct(in_channels, planes, 3, stride=stride)
        self.conv2 = ConvBNAct(planes, planes, 3, activation=None)
        self.downsample = _shortcut(in_channels, planes, stride)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(F(x) + skip(x))``."""
        skip = x if self.downsample is None else self.downsample(x)
        out: torch.Tensor = self.act(self.conv2(self.conv1(x)) + skip)
        return out


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in ResNet v1.5), 1x1 expand by 4, with a skip."""

    expansion = BOTTLENECK_EXPANSION

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = ConvBNAct(in_channels, planes, 1)
        self.conv2 = ConvBNAct(planes, planes, 3, stride=stride)
        self.conv3 = ConvBNAct(planes, out_channels, 1, activation=None)
        self.downsample = _shortcut(in_channels, out_channels, stride)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(F(x) + skip(x))``."""
        skip = x if self.downsample is None else self.downsample(x)
        out: torch.Tensor = self.act(self.conv3(self.conv2(self.conv1(x))) + skip)
        return out


def _build(
    spec: ModelSpec, block: type[BasicBlock] | type[Bottleneck], repeats: tuple[int, ...]
) -> ZooModel:
    Options(spec, set())
    layers: list[nn.Module] = [ConvBNAct(IMAGE_INPUT.shape[0], 64, 3)]
    channels = 64
    for stage, (planes, n) in enumerate(zip(_PLANES, repeats, strict=True)):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            layers.append(block(channels, planes, stride))
            channels = planes * block.expansion
    layers.append(PoolClassifier(channels, spec.num_classes))
    init_conv_bn(layers)
    return ZooModel(layers, IMAGE_INPUT, spec.num_classes, has_batchnorm=True)


def build_resnet18(spec: ModelSpec) -> ZooModel:
    """Build ResNet-18: stem, 8 basic blocks, pool+fc (10 layers, no options)."""
    return _build(spec, BasicBlock, _RESNET18)


def build_resnet50(spec: ModelSpec) -> ZooModel:
    """Build ResNet-50: stem, 16 bottleneck blocks, pool+fc (18 layers, no options)."""
    return _build(spec, Bottleneck, _RESNET50)
