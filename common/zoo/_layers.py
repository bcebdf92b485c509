"""Building blocks shared by the convolutional models of the zoo.

Activations are never in-place: a pipeline stage's input is a leaf tensor that
requires grad, and an in-place op on it would fail at the stage boundary.
"""

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["ConvBNAct", "PoolClassifier", "init_conv_bn"]


class ConvBNAct(nn.Sequential):
    """Conv (no bias, BN supplies it), batch-norm, then an optional activation."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        activation: type[nn.Module] | None = nn.ReLU,
    ) -> None:
        parts: OrderedDict[str, nn.Module] = OrderedDict(
            conv=nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size,
                stride=stride,
                padding=(kernel_size - 1) // 2,
                groups=groups,
                bias=False,
            ),
            bn=nn.BatchNorm2d(out_channels),
        )
        if activation is not None:
            parts["act"] = activation()
        super().__init__(parts)


class PoolClassifier(nn.Module):
    """Global average pool, flatten and a linear classifier: the last layer of a CNN."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map feature maps ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        out: torch.Tensor = self.fc(torch.flatten(self.pool(x), 1))
        return out


def init_conv_bn(layers: list[nn.Module]) -> None:
    """Initialise convolutions and batch-norms as torchvision does for these models.

    Kaiming-normal (fan-out) convolutions and unit/zero batch-norm affine parameters;
    linear layers keep PyTorch's default initialisation.
    """
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
