"""The federated-learning CNN: two 5x5 convolutions, max pooling, two linear layers.

This is the model FedAvg introduced and Eco-FL, FedAT and Astraea evaluate with
("CNN with two 5x5 convolution layers"), so accuracy curves compare with theirs.
"""

from collections import OrderedDict

import torch
from torch import nn

from common.zoo._model import InputSpec, ZooModel
from common.zoo._sizes import fl_cnn_options
from common.zoo._types import ModelSpec

__all__ = ["build_fl_cnn"]


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(in_channels, out_channels, 5, padding=2),
            act=nn.ReLU(),
            pool=nn.MaxPool2d(2),
        )
    )


def build_fl_cnn(spec: ModelSpec) -> ZooModel:
    """Build conv5x5 -> ReLU -> maxpool, twice, then a hidden linear layer and a classifier.

    Padding 2 keeps each convolution size-preserving, so the same net takes 8x8
    one-channel digits (``channels=1, size=8``) and 32x32 RGB CIFAR (the default).
    Options: ``channels`` (3), ``size`` (32, a multiple of 4), ``width`` (first conv's
    channels, 32; the second has twice as many), ``hidden`` (512), as in FedAvg's CNN;
    each has a ceiling (`common.zoo._sizes.fl_cnn_options`).

    Raises:
        ConfigError: An unknown option, or ``size`` not a multiple of 4.

    """
    channels, size, width, hidden = fl_cnn_options(spec)
    flat = 2 * width * (size // 4) ** 2
    layers: list[nn.Module] = [
        _conv_block(channels, width),
        _conv_block(width, 2 * width),
        nn.Sequential(OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(flat, hidden), act=nn.ReLU())),
        nn.Linear(hidden, spec.num_classes),
    ]
    spec_in = InputSpec(kind="image", shape=(channels, size, size), dtype=torch.float32)
    return ZooModel(layers, spec_in, spec.num_classes, has_batchnorm=False)
