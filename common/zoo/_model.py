"""Types of a built model: what it eats, and its layer view.

The planner places *layers*, not parameters, so a model is handed around as an ordered
list of modules whose composition is the whole network; a stage is a contiguous slice.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from common.errors import ConfigError, PlanError
from common.zoo._types import IMAGE_SHAPE

__all__ = ["IMAGE_INPUT", "InputSpec", "ZooModel", "has_batchnorm"]

_BATCHNORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
)


@dataclass(frozen=True)
class InputSpec:
    """What one sample fed to layer 0 looks like, so data and profiling can match it.

    Attributes:
        kind: ``"image"`` (float pixels) or ``"tokens"`` (integer token ids).
        shape: Per-sample shape without the batch dimension, e.g. ``(3, 32, 32)``.
        dtype: ``torch.float32`` for images, ``torch.int64`` for tokens.
        vocab_size: Number of distinct token ids; required for tokens, ``None`` else.

    """

    kind: Literal["image", "tokens"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("image", "tokens"):
            raise ConfigError(f"input kind must be 'image' or 'tokens', got {self.kind!r}")
        if not self.shape or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ConfigError(f"input shape must be non-empty positive ints, got {self.shape!r}")
        if self.kind == "tokens" and (self.vocab_size is None or self.vocab_size < 1):
            raise ConfigError(f"token input needs vocab_size >= 1, got {self.vocab_size!r}")
        if self.kind == "image" and self.vocab_size is not None:
            raise ConfigError(f"image input takes no vocab_size, got {self.vocab_size!r}")


IMAGE_INPUT = InputSpec(kind="image", shape=IMAGE_SHAPE, dtype=torch.float32)
"""CIFAR-sized images, the default input of every image model in the zoo."""


@dataclass
class ZooModel:
    """A built model as an ordered list of placeable layers.

    Each layer maps one tensor to one tensor and the last one produces logits of shape
    ``(batch, num_classes)``, so any contiguous slice can run on its own device.

    Attributes:
        layers: The partitionable view; layer ``i`` is one unit of placement.
        input: What layer 0 consumes.
        num_classes: Width of the logits.
        has_batchnorm: Whether any layer holds batch-norm, whose batch statistics make
            micro-batched training differ from single-device training.

    """

    layers: list[nn.Module]
    input: InputSpec
    num_classes: int
    has_batchnorm: bool

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a model needs at least one layer, got none")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise ConfigError(f"layer {i} must be an nn.Module, got {type(layer).__name__}")
        if self.num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {self.num_classes}")

    def stage(self, start: int, end: int) -> nn.Sequential:
        """Return ``layers[start:end]`` as one module that shares their parameters.

        The modules are not copied: training a stage trains this model, and the stage's
        ``state_dict`` keys are ``"{i - start}.{name}"``.

        Raises:
            PlanError: If ``[start, end)`` is not a non-empty range of layers.

        """
        n = len(self.layers)
        if not 0 <= start < end <= n:
            raise PlanError(
                f"stage [{start}, {end}) is not a non-empty layer range of this "
                f"{n}-layer model (need 0 <= start < end <= {n})"
            )
        return nn.Sequential(*self.layers[start:end])

    def full(self) -> nn.Sequential:
        """Return all layers as one module: the single-device reference model."""
        return self.stage(0, len(self.layers))


def has_batchnorm(layers: list[nn.Module]) -> bool:
    """Tell whether any of ``layers`` contains a batch-norm module at any depth."""
    return any(isinstance(m, _BATCHNORM_TYPES) for layer in layers for m in layer.modules())
