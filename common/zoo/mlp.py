"""A multilayer perceptron on flattened images: the cheapest model to reason about."""

import math
from collections import OrderedDict

from torch import nn

from common.zoo._count import linear
from common.zoo._options import Options
from common.zoo._types import IMAGE_INPUT, ModelSpec, ZooModel

__all__ = ["MAX_DEPTH", "MAX_HIDDEN", "build_mlp", "count_mlp"]

MAX_HIDDEN = 1 << 16
"""Widest hidden layer: 16x the widest MLP layers of the models people train on edge devices."""

MAX_DEPTH = 1024
"""Most hidden layers: every layer is a unit the planner places, so far beyond any plan."""


def _options(spec: ModelSpec) -> tuple[int, int]:
    opts = Options(spec, {"hidden", "depth"})
    hidden = opts.get_int("hidden", 256, maximum=MAX_HIDDEN)
    depth = opts.get_int("depth", 3, minimum=0, maximum=MAX_DEPTH)
    return hidden, depth


def count_mlp(spec: ModelSpec) -> int:
    """The parameters `build_mlp` would allocate, without allocating them."""
    hidden, depth = _options(spec)
    in_features = math.prod(IMAGE_INPUT.shape)
    if depth == 0:
        return linear(in_features, spec.num_classes)
    body = linear(in_features, hidden) + (depth - 1) * linear(hidden, hidden)
    return body + linear(hidden, spec.num_classes)


def build_mlp(spec: ModelSpec) -> ZooModel:
    """Build ``depth`` Linear+ReLU layers of width ``hidden``, then a linear classifier.

    Layer 0 also flattens the image, so every layer has parameters worth placing.
    Options: ``hidden`` (default 256, at most `MAX_HIDDEN`), ``depth`` (hidden layers,
    default 3, may be 0, at most `MAX_DEPTH`).
    """
    hidden, depth = _options(spec)
    in_features = math.prod(IMAGE_INPUT.shape)

    layers: list[nn.Module] = []
    width = in_features
    for i in range(depth):
        parts: OrderedDict[str, nn.Module] = OrderedDict()
        if i == 0:
            parts["flatten"] = nn.Flatten()
        parts["fc"] = nn.Linear(width, hidden)
        parts["act"] = nn.ReLU()
        layers.append(nn.Sequential(parts))
        width = hidden
    head: OrderedDict[str, nn.Module] = OrderedDict()
    if depth == 0:
        head["flatten"] = nn.Flatten()
    head["fc"] = nn.Linear(width, spec.num_classes)
    layers.append(nn.Sequential(head))
    return ZooModel(layers, IMAGE_INPUT, spec.num_classes, has_batchnorm=False)
