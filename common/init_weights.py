"""A job's starting weights from a ``.safetensors`` file (``init_from``): fine-tuning.

The file holds the whole model's state dict by the names ``build_model(...).full()``
gives it (``0.weight``, ``3.bias``, ...), as `asteroid export` writes them, so a
finished job's export is a valid start for the next. It is checked from its
header alone (names, shapes, dtypes; no tensor read) when a job is submitted, and
read tensor by tensor (``safe_open``) when the job starts: one tensor is in flight
at a time besides the model it fills. Floating tensors may be stored in another
floating dtype (a half-precision export) and are converted; integer buffers
(a batch norm's ``num_batches_tracked``) must be integers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.errors import ConfigError, DataPathError

__all__ = [
    "InitPathError",
    "WeightsMismatch",
    "init_header",
    "load_init",
    "mismatch",
    "state_shapes",
]

Shapes = dict[str, tuple[int, ...]]

_SHOWN = 4
"""Differing names a mismatch lists (a whole wrong model would list hundreds)."""


class InitPathError(DataPathError):
    """``init_from`` names no readable safetensors file on the coordinator (reason: `detail`)."""

    PUBLIC = (
        "init_from: no readable .safetensors file at that path on the coordinator "
        "(its log says why)"
    )


class WeightsMismatch(ConfigError):
    """The file's tensor names or shapes are not the model's state dict."""


def init_header(path: Path) -> Shapes:
    """Names and shapes of the tensors in `path`, from its header (no tensor is read).

    Raises:
        InitPathError: No such file, not a ``.safetensors`` file, or unreadable.

    """
    if path.suffix != ".safetensors":
        raise InitPathError(f"init_from: {path} is not a .safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise InitPathError(f"init_from: cannot read {path}: {exc}") from None


def state_shapes(module: nn.Module) -> Shapes:
    """The names and shapes of `module`'s state dict (parameters and buffers)."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def mismatch(
    file: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]]
) -> str | None:
    """Why a file of tensors `file` cannot be the state of a model of `model`, or None.

    Names must match exactly (no tensor left out, none extra) and so must each
    shape; the first few of each kind of difference are named.
    """
    missing = sorted(model.keys() - file.keys())
    extra = sorted(file.keys() - model.keys())
    shapes = [
        f"{k} {list(file[k])} (model {list(model[k])})"
        for k in sorted(model.keys() & file.keys())
        if tuple(file[k]) != tuple(model[k])
    ]
    parts = []
    for what, names in (("missing", missing), ("not in the model", extra), ("shape", shapes)):
        if names:
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            parts.append(f"{what}: {', '.join(names[:_SHOWN])}{more}")
    if not parts:
        return None
    return "init_from: the file's tensors are not the model's state dict; " + "; ".join(parts)


def load_init(path: Path, module: nn.Module) -> None:
    """Fill `module`'s state dict from `path`, tensor by tensor, checked first.

    Raises:
        InitPathError: The file is missing or unreadable.
        WeightsMismatch: Its names or shapes are not the module's, or a tensor's
            dtype cannot hold the module's (integer against floating).

    """
    problem = mismatch(init_header(path), state_shapes(module))
    if problem is not None:
        raise WeightsMismatch(problem)
    state = module.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f, torch.no_grad():
            for name, target in state.items():
                value = f.get_tensor(name)
                if value.is_floating_point() != target.is_floating_point():
                    raise WeightsMismatch(
                        f"init_from: {name} is {value.dtype} in the file, the model's is "
                        f"{target.dtype}"
                    )
                target.copy_(value)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise InitPathError(f"init_from: cannot read {path}: {exc}") from None
