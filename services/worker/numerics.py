"""Numerics checked where they enter a worker and where this worker makes them.

A part from a peer (activations with their labels, gradients, all-reduce
chunks) must hold finite values and labels the loss can index: one bad part
would otherwise turn every later loss and the committed weights into nan, or
crash the last stage inside `cross_entropy`. Values this worker computes (its
loss, the activations and gradients it sends, its gradients and weights around
the optimizer step) are checked too, so that an honest worker never sends nor
commits inf or nan and a receiver's refusal always names the device at fault.

Each check is one `isfinite` pass per micro-batch tensor (or per round for the
weights), never a per-sample loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.errors import NonFiniteError

__all__ = ["PAST_END", "describe_nonfinite", "label_fault", "part_fault", "require_finite"]

PAST_END = -100
"""Label of a held-out position past the data's end: cross_entropy's default ignore_index
(`services.worker.evaluate` fills it in); only evaluation parts may carry it."""


def describe_nonfinite(t: torch.Tensor) -> str | None:
    """How many nan and inf values `t` holds ("2 nan, 1 inf of 40 values"), or None if none."""
    if not (t.is_floating_point() or t.is_complex()):
        return None  # integers are always finite
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    nan = int(torch.isnan(t).sum())
    inf = t.numel() - int(finite.sum()) - nan
    return f"{nan} nan, {inf} inf of {t.numel()} values"


def label_fault(
    labels: torch.Tensor, samples: int, num_classes: int, evaluation: bool
) -> str | None:
    """Why `labels` cannot be the class indices of `samples` samples, or None when they can.

    They must be int64 (what every dataset makes and `cross_entropy` indexes with),
    one per sample, each in [0, num_classes); held-out positions past the data's
    end carry `PAST_END`, which only an evaluation part may.
    """
    if labels.dtype != torch.int64:
        return f"labels of dtype {labels.dtype}, want torch.int64"
    if tuple(labels.shape) != (samples,):
        return f"labels of shape {tuple(labels.shape)}, want ({samples},)"
    bad = (labels < 0) | (labels >= num_classes)
    if evaluation:
        bad &= labels != PAST_END
    if not bool(bad.any()):
        return None
    first = int(labels[bad][0])
    return f"{int(bad.sum())} labels outside [0, {num_classes}) (e.g. {first})"


def part_fault(
    kind: str, tensors: list[torch.Tensor], samples: int, num_classes: int | None
) -> str | None:
    """Why a part of `kind` ("F", "E": activations and labels, "B": gradients) is poison.

    None when every value is finite and the labels fit; `num_classes` None
    leaves the labels unchecked (a harness without a model).
    """
    what = "gradients" if kind == "B" else "activations"
    bad = describe_nonfinite(tensors[0])
    if bad:
        return f"non-finite {what}: {bad}"
    if kind != "B" and num_classes is not None:
        if len(tensors) < 2:
            return "activations without labels"
        return label_fault(tensors[1], samples, num_classes, kind == "E")
    return None


def require_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise NonFiniteError naming the first of `tensors` (name, tensor) that is not finite.

    Raises:
        NonFiniteError: `what` (e.g. "the loss of micro-batch 2 in round 5") is inf or nan.

    """
    for name, t in tensors:
        bad = describe_nonfinite(t.detach())
        if bad:
            where = f" ({name})" if name else ""
            raise NonFiniteError(f"{what}{where} is not finite: {bad}")
