"""A multilayer perceptron on flattened images: the cheapest model to reason about."""

import math
from collections import OrderedDict

from torch import nn

from common.zoo._model import IMAGE_INPUT, ZooModel
from common.zoo._sizes import MLP_MAX_DEPTH as MAX_DEPTH
from common.zoo._sizes import MLP_MAX_HIDDEN as MAX_HIDDEN
from common.zoo._sizes import mlp_options
from common.zoo._types import ModelSpec

__all__ = ["MAX_DEPTH", "MAX_HIDDEN", "build_mlp"]


def build_mlp(spec: ModelSpec) -> ZooModel:
    """Build ``depth`` Linear+ReLU layers of width ``hidden``, then a linear classifier.

    Layer 0 also flattens the image, so every layer has parameters worth placing.
    Options: ``hidden`` (default 256, at most `MAX_HIDDEN`), ``depth`` (hidden layers,
    default 3, may be 0, at most `MAX_DEPTH`).
    """
    hidden, depth = mlp_options(spec)
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
