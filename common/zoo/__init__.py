"""The model zoo: named models exposed as ordered lists of placeable layers.

Each layer maps one tensor to one tensor, so a contiguous slice of layers (a stage)
can run on any device; `build_model` is deterministic in ``(spec, seed)`` so that every
worker constructs identical initial weights without shipping them.
"""

from common.zoo._registry import build_model, model_names
from common.zoo._types import InputSpec, ModelSpec, OptionValue, ZooModel

__all__ = ["InputSpec", "ModelSpec", "OptionValue", "ZooModel", "build_model", "model_names"]
