"""Deterministic construction of a `ZooModel` from a `ModelSpec`: the builders.

Names and sizes need no torch (`common.zoo._sizes`); this module is what imports
every model's layers, so `common.zoo` imports it only when a model is built.
"""

from collections.abc import Callable

import torch

from common.errors import ConfigError
from common.zoo._custom_build import build_custom
from common.zoo._model import ZooModel
from common.zoo._sizes import model_names
from common.zoo._types import ModelSpec
from common.zoo.bert import build_bert_small
from common.zoo.cnn import build_small_cnn
from common.zoo.custom import is_custom_name
from common.zoo.efficientnet import build_efficientnet_b1
from common.zoo.fl_cnn import build_fl_cnn
from common.zoo.mlp import build_mlp
from common.zoo.mobilenet import build_mobilenet_v2
from common.zoo.resnet import build_resnet18, build_resnet50

__all__ = ["build_model"]

_BUILDERS: dict[str, Callable[[ModelSpec], ZooModel]] = {
    "bert_small": build_bert_small,
    "efficientnet_b1": build_efficientnet_b1,
    "fl_cnn": build_fl_cnn,
    "mlp": build_mlp,
    "mobilenet_v2": build_mobilenet_v2,
    "resnet18": build_resnet18,
    "resnet50": build_resnet50,
    "small_cnn": build_small_cnn,
}

_MAX_SEED = 2**63 - 1


def _builder(spec: ModelSpec) -> Callable[[ModelSpec], ZooModel]:
    if is_custom_name(spec.name):
        return build_custom
    try:
        return _BUILDERS[spec.name]
    except KeyError:
        raise ConfigError(
            f"unknown model name {spec.name!r}: expected one of {', '.join(model_names())} "
            "or 'package.module:factory'"
        ) from None


def build_model(spec: ModelSpec, seed: int) -> ZooModel:
    """Build the model a spec names, with weights that depend only on ``(spec, seed)``.

    Every worker builds the same initial weights on its own instead of receiving them,
    and a single-process reference run starts from the same point. The global torch RNG
    is seeded inside `torch.random.fork_rng`, so the caller's RNG stream is left as it
    was (which also makes this unsafe to run concurrently with other threads drawing
    from the global RNG).

    Raises:
        ConfigError: Unknown model name, bad options, bad ``num_classes`` or ``seed``.

    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    if spec.num_classes < 1:
        raise ConfigError(f"model {spec.name!r}: num_classes must be >= 1, got {spec.num_classes}")
    builder = _builder(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(spec)
