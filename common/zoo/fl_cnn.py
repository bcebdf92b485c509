"""The federated-learning CNN: two 5x5 convolutions, max pooling, two linear layers.

This is the model FedAvg introduced and Eco-FL, FedAT and Astraea evaluate with
("CNN with two 5x5 convolution layers"), so accuracy curves compare with theirs.
"""

from collections import OrderedDict

import torch
from torch import nn

from common.zoo._count import conv, linear
from common.zoo._options import Options
from common.zoo._types import InputSpec, ModelSpec, ZooModel

__all__ = ["build_fl_cnn", "count_fl_cnn"]

_MAX_CHANNELS = 1024
_MAX_SIZE = 1024
_MAX_WIDTH = 4096
_MAX_HIDDEN = 1 << 16


def _options(spec: ModelSpec) -> tuple[int, int, int, int]:
    """``(channels, size, width, hidden)``, each bounded far beyond FedAvg's CNN."""
    opts = Options(spec, {"channels", "size", "width", "hidden"})
    channels = opts.get_int("channels", 3, maximum=_MAX_CHANNELS)
    size = opts.get_int("size", 32, minimum=4, maximum=_MAX_SIZE)
    width = opts.get_int("width", 32, maximum=_MAX_WIDTH)
    hidden = opts.get_int("hidden", 512, maximum=_MAX_HIDDEN)
    if size % 4:
        raise opts.error("size", "a multiple of 4 (two 2x2 poolings)", size)
    return channels, size, width, hidden


def count_fl_cnn(spec: ModelSpec) -> int:
    """The parameters `build_fl_cnn` would allocate, without allocating them."""
    channels, size, width, hidden = _options(spec)
    flat = 2 * width * (size // 4) ** 2
    convs = conv(channels, width, 5) + conv(width, 2 * width, 5)
    return convs + linear(flat, hidden) + linear(hidden, spec.num_classes)


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
    each has a ceiling (`_options`).

    Raises:
        ConfigError: An unknown option, or ``size`` not a multiple of 4.

    """
    channels, size, width, hidden = _options(spec)
    flat = 2 * width * (size // 4) ** 2
    layers: list[nn.Module] = [
        _conv_block(channels, width),
        _conv_block(width, 2 * width),
        nn.Sequential(OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(flat, hidden), act=nn.ReLU())),
        nn.Linear(hidden, spec.num_classes),
    ]
    spec_in = InputSpec(kind="image", shape=(channels, size, size), dtype=torch.float32)
    return ZooModel(layers, spec_in, spec.num_classes, has_batchnorm=False)
