"""EfficientNet-B1 for 32x32 inputs.

B1 scaling of the B0 baseline: width 1.0, depth 1.1 (block repeats rounded up, giving
23 MBConv blocks). CIFAR adaptation: the stem and the first 24-channel stage keep
stride 1 (ImageNet uses 2), so feature maps go 32->16->8->4 rather than to 1 px.
Stochastic depth and dropout are off so that training is deterministic.
"""

import math

import torch
from torch import nn

from common.zoo._count import make_divisible
from common.zoo._layers import ConvBNAct, PoolClassifier, init_conv_bn
from common.zoo._model import IMAGE_INPUT, ZooModel
from common.zoo._options import Options
from common.zoo._sizes import EFFICIENTNET_DEPTH_MULT as _DEPTH_MULT
from common.zoo._sizes import EFFICIENTNET_STAGES as _STAGES
from common.zoo._sizes import EFFICIENTNET_WIDTH_MULT as _WIDTH_MULT
from common.zoo._types import ModelSpec

__all__ = ["MBConv", "SqueezeExcitation", "build_efficientnet_b1"]


class SqueezeExcitation(nn.Module):
    """Channel gating from globally pooled features (SiLU squeeze, sigmoid gate)."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.act = nn.SiLU()
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale each channel of ``x`` by a learned function of all channels."""
        scale = self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))
        out: torch.Tensor = x * scale
        return out


class MBConv(nn.Module):
    """Mobile inverted bottleneck with squeeze-excitation and SiLU."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: int, stride: int, expand: int
    ) -> None:
        super().__init__()
        hidden = make_divisible(in_channels * expand)
        parts: list[nn.Module] = []
        if hidden != in_channels:
            parts.append(ConvBNAct(in_channels, hidden, 1, activation=nn.SiLU))
        parts += [
            ConvBNAct(hidden, hidden, kernel, stride=stride, groups=hidden, activation=nn.SiLU),
            SqueezeExcitation(hidden, max(1, in_channels // 4)),
            ConvBNAct(hidden, out_channels, 1, activation=None),
        ]
        self.block = nn.Sequential(*parts)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block, adding the input back when the shapes match."""
        out: torch.Tensor = self.block(x)
        return x + out if self.use_residual else out


def build_efficientnet_b1(spec: ModelSpec) -> ZooModel:
    """Build stem, 23 MBConv blocks, the 1x1 head conv and the classifier (26 layers).

    No options: the point of the model is its fixed B1 scaling.
    """
    Options(spec, set())
    channels = make_divisible(32 * _WIDTH_MULT)
    layers: list[nn.Module] = [ConvBNAct(IMAGE_INPUT.shape[0], channels, 3, activation=nn.SiLU)]
    for expand, kernel, stride, c, repeats in _STAGES:
        out_channels = make_divisible(c * _WIDTH_MULT)
        for i in range(math.ceil(repeats * _DEPTH_MULT)):
            layers.append(MBConv(channels, out_channels, kernel, stride if i == 0 else 1, expand))
            channels = out_channels
    head_channels = 4 * channels
    layers.append(ConvBNAct(channels, head_channels, 1, activation=nn.SiLU))
    layers.append(PoolClassifier(head_channels, spec.num_classes))
    init_conv_bn(layers)
    return ZooModel(layers, IMAGE_INPUT, spec.num_classes, has_batchnorm=True)
