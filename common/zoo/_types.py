"""Value types of the model zoo that need no torch: what to build, and its knobs.

A job names its model with a `ModelSpec`, and everything that only reads or sizes a
job (the CLI, the gateway, the job's own checks) must not pay torch's import for it;
the built model's types are in `common.zoo._model`.
"""

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["IMAGE_SHAPE", "ModelSpec", "OptionValue"]

OptionValue = int | float | str | bool
"""A model-specific knob; scalar so that a spec stays trivially serialisable."""

IMAGE_SHAPE: tuple[int, int, int] = (3, 32, 32)
"""CIFAR-sized images (channels, height, width): the input of every image model in the zoo."""


class ModelSpec(BaseModel):
    """What model a job trains, as sent over the wire and stored with checkpoints.

    Attributes:
        name: A zoo name (see `model_names()`) or ``"package.module:factory"``.
        num_classes: Width of the logits the last layer produces.
        options: Model-specific knobs (e.g. ``width_mult``, ``seq_len``); each model
            rejects knobs it does not know so that a typo is not silently ignored.

    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="Zoo model (bert_small, efficientnet_b1, fl_cnn, mlp, mobilenet_v2, "
        "resnet18, resnet50, small_cnn) or package.module:factory."
    )
    num_classes: int = Field(10, description="Width of the logits the last layer produces.")
    options: dict[str, OptionValue] = Field(
        default_factory=dict, description="Model-specific knobs, e.g. width_mult, seq_len."
    )
