"""Who sends a worker which part under its plan: the task pool refuses anyone else.

Its own module beside `services.worker.pool`, which takes parts by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Expected"]


@dataclass(frozen=True)
class Expected:
    """Who the plan says sends this device each part, so a part from anyone else is refused.

    Routes do not depend on the micro-batch, so a sample range names its sender
    for every micro-batch of every round of the plan epoch.

    Attributes:
        activations: Sample range [lo, hi) -> device of the previous stage that
            sends those activations (training and evaluation alike).
        gradients: Sample range [lo, hi) -> device of the next stage that sends
            the gradients of those samples back.
        ring_prev: The device before this one in the group's all-reduce ring;
            None when the group has one device (no reduce chunks at all).
        ring_size: Devices in the ring, which bounds steps and chunk indices.
        microbatches: Micro-batches per round, which bounds a training part's index.
        num_classes: Width of the model's logits, which bounds the labels activations
            carry; None leaves labels unchecked (a harness without a model).

    """

    activations: Mapping[tuple[int, int], str] = field(default_factory=dict)
    gradients: Mapping[tuple[int, int], str] = field(default_factory=dict)
    ring_prev: str | None = None
    ring_size: int = 1
    microbatches: int | None = None
    num_classes: int | None = None

    def part_sender(self, kind: str, lo: int, hi: int) -> str | None:
        """The device that sends samples [lo, hi) of a part of `kind`, or None if none does."""
        routes = self.gradients if kind == "B" else self.activations
        return routes.get((lo, hi))

    def refuse_part(self, kind: str, mb: int, lo: int, hi: int, sender: str) -> str | None:
        """Why a part of `kind` from `sender` does not fit the plan, or None when it does."""
        if kind != "E" and self.microbatches is not None and not 0 <= mb < self.microbatches:
            return f"micro-batch {mb} of a round of {self.microbatches}"
        want = self.part_sender(kind, lo, hi)
        if want is None:
            what = "gradients" if kind == "B" else "activations"
            return f"no route of the plan sends {what} of samples [{lo}, {hi}) to this device"
        if want != sender:
            return f"samples [{lo}, {hi}) of {kind}{mb} come from {want!r}, not from {sender!r}"
        return None

    def refuse_chunk(self, step: int, chunk: int, sender: str) -> str | None:
        """Why a reduce chunk from `sender` does not fit the ring, or None when it does."""
        if self.ring_prev is None:
            return "this device's group has no all-reduce ring (one device)"
        if self.ring_prev != sender:
            return f"reduce chunks come from {self.ring_prev!r}, not from {sender!r}"
        steps = 2 * (self.ring_size - 1)
        if not (0 <= step < steps and 0 <= chunk < self.ring_size):
            return (
                f"reduce chunk step {step} chunk {chunk} outside a ring of {self.ring_size} "
                f"({steps} steps)"
            )
        return None
