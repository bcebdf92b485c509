"""A multilayer perceptron on flattened images: the cheapest model to reason about."""

import math
from collections import OrderedDict

from torch import nn

from common.zoo._options import Options
from common.zoo._types import IMAGE_INPUT, ModelSpec, ZooModel

__all__ = ["build_mlp"]


def build_mlp(spec: ModelSpec) -> ZooModel:
    """Build ``depth`` Linear+ReLU layers of width ``hidden``, then a linear classifier.

    Layer 0 also flattens the image, so every layer has parameters worth placing.
    Options: ``hidden`` (default 256), ``depth`` (hidden layers, default 3, may be 0).
    """
    opts = Options(spec, {"hidden", "depth"})
    hidden = opts.get_int("hidden", 256)
    depth = opts.get_int("depth", 3, minimum=0)
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
