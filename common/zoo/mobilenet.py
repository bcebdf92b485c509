"""MobileNetV2 for 32x32 inputs.

Follows the common CIFAR adaptation: the stem and the first 24-channel stage keep
stride 1 (ImageNet uses 2 for both), so feature maps go 32->16->8->4 instead of
shrinking to 1 px.
"""

import torch
from torch import nn

from common.zoo._count import make_divisible
from common.zoo._layers import ConvBNAct, PoolClassifier, init_conv_bn
from common.zoo._model import IMAGE_INPUT, ZooModel
from common.zoo._sizes import MOBILENET_MAX_WIDTH_MULT as MAX_WIDTH_MULT
from common.zoo._sizes import MOBILENET_SETTINGS, mobilenet_width_mult
from common.zoo._types import ModelSpec

__all__ = ["MAX_WIDTH_MULT", "InvertedResidual", "build_mobilenet_v2"]


class InvertedResidual(nn.Module):
    """Expand 1x1, depthwise 3x3, linear project 1x1; skip when shapes allow."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = round(in_channels * expand)
        parts: list[nn.Module] = []
        if expand != 1:
            parts.append(ConvBNAct(in_channels, hidden, 1, activation=nn.ReLU6))
        parts += [
            ConvBNAct(hidden, hidden, 3, stride=stride, groups=hidden, activation=nn.ReLU6),
            ConvBNAct(hidden, out_channels, 1, activation=None),
        ]
        self.conv = nn.Sequential(*parts)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block, adding the input back when the shapes match."""
        out: torch.Tensor = self.conv(x)
        return x + out if self.use_residual else out


def build_mobilenet_v2(spec: ModelSpec) -> ZooModel:
    """Build stem, 17 inverted residual blocks, the 1x1 head conv and the classifier.

    20 layers. Options: ``width_mult`` (default 1.0, at most `MAX_WIDTH_MULT`) scales
    every channel count.
    """
    width_mult = mobilenet_width_mult(spec)
    channels = make_divisible(32 * width_mult)
    last_channels = make_divisible(1280 * max(1.0, width_mult))

    layers: list[nn.Module] = [ConvBNAct(IMAGE_INPUT.shape[0], channels, 3, activation=nn.ReLU6)]
    for expand, c, repeats, stride in MOBILENET_SETTINGS:
        out_channels = make_divisible(c * width_mult)
        for i in range(repeats):
            layers.append(InvertedResidual(channels, out_channels, stride if i == 0 else 1, expand))
            channels = out_channels
    layers.append(ConvBNAct(channels, last_channels, 1, activation=nn.ReLU6))
    layers.append(PoolClassifier(last_channels, spec.num_classes))
    init_conv_bn(layers)
    return ZooModel(layers, IMAGE_INPUT, spec.num_classes, has_batchnorm=True)
