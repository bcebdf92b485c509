"""The model zoo: named models exposed as ordered lists of placeable layers.

Each layer maps one tensor to one tensor, so a contiguous slice of layers (a stage)
can run on any device; `build_model` is deterministic in ``(spec, seed)`` so that every
worker constructs identical initial weights without shipping them.
"""

from collections.abc import Collection

from common.zoo import _registry
from common.zoo._registry import model_names, parameter_count
from common.zoo._types import InputSpec, ModelSpec, OptionValue, ZooModel
from common.zoo.custom import check_model_source, model_factory

__all__ = [
    "InputSpec",
    "ModelSpec",
    "OptionValue",
    "ZooModel",
    "build_model",
    "model_factory",
    "model_names",
    "parameter_count",
]


def build_model(spec: ModelSpec, seed: int, allowed_modules: Collection[str] = ()) -> ZooModel:
    """Build the model a spec names, with weights that depend only on ``(spec, seed)``.

    A ``module:factory`` name imports and runs code, so it is built only when its
    module is in `allowed_modules`, which callers take from their service's own
    ``model_modules`` setting, never from the job; the default allows zoo names only.
    The global torch RNG is seeded inside `torch.random.fork_rng`, so the caller's
    RNG stream is left as it was.

    Raises:
        ConfigError: Unknown model name, a module that is not allowed, bad options,
            bad ``num_classes`` or ``seed``, or anything the user's factory raised.

    """
    check_model_source(spec.name, allowed_modules)
    return _registry.build_model(spec, seed)
