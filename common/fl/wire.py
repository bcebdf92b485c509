"""A model's weights as one safetensors frame, and the checks an incoming one must pass.

A home's update comes from the network: it is parsed (never unpickled or executed),
and taken only if it has exactly the reference model's tensors, shapes and dtypes and
finite values, so one broken or hostile home cannot poison the global model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.errors import ConfigError

__all__ = ["state_frame", "state_from_frame"]


def state_frame(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The state dict as a uint8 tensor holding its safetensors file."""
    blob = st_save({k: v.detach().contiguous() for k, v in state.items()})
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def state_from_frame(
    frames: list[torch.Tensor], reference: Mapping[str, torch.Tensor], sender: str
) -> dict[str, torch.Tensor]:
    """The state dict in the one frame of a message from `sender`, checked against `reference`.

    Raises:
        ConfigError: Not exactly one uint8 frame, not safetensors, other tensor names,
            shapes or dtypes than the reference, or a value that is not finite; the
            message names the sender and what differs.

    """
    if len(frames) != 1 or frames[0].dtype != torch.uint8 or frames[0].dim() != 1:
        raise ConfigError(f"{sender}: expected one uint8 frame holding safetensors")
    try:
        state = st_load(frames[0].numpy().tobytes())
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise ConfigError(f"{sender}: the model frame is not valid safetensors: {exc}") from exc
    if set(state) != set(reference):
        missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
        raise ConfigError(
            f"{sender}: the model's tensors differ (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for name, want in reference.items():
        got = state[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ConfigError(
                f"{sender}: tensor {name} is {got.dtype} {tuple(got.shape)}, expected "
                f"{want.dtype} {tuple(want.shape)}"
            )
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ConfigError(f"{sender}: tensor {name} holds values that are not finite")
    return state
