"""Peak memory of a pipeline stage on one device (Asteroid's Eq. 3), shared by every service.

The planner sizes stages with it and the coordinator checks a re-planned
pipeline against the survivors' budgets with it; one formula in one place
keeps the two from disagreeing about what fits. Per-layer byte counts come
from a profile: they describe the model, not the device, so any profile of
the job's model serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from common.errors import ConfigError
from common.profile import Profile

__all__ = ["LayerMemory", "replica_bytes", "stage_bytes", "stashed_copies"]


def stage_bytes(
    param_bytes: int, optimizer_bytes: int, activation_bytes: int, samples: int, in_flight: int
) -> int:
    """Peak bytes of a device holding a layer range whose byte counts are given.

    Weights and their gradients (twice the parameter bytes) and the optimizer
    state stay resident; the per-sample activations are kept for backward for
    each of the `in_flight` micro-batch shares of `samples` samples.
    """
    return 2 * param_bytes + optimizer_bytes + activation_bytes * samples * in_flight


def stashed_copies(k0: int, aggregate: bool) -> int:
    """Weight copies a stage keeps in `mode: async` (`services.worker.stash`), at most.

    Vertical sync runs micro-batch g on the version the update of g - K_0
    made, on every stage: after its update of g a stage still needs the
    versions of g+1 .. g+K_0 (in flight or still to forward), K_0 of them,
    whatever its own K_s; the new one is stashed before older ones are dropped
    (one more), and with FTPipeHD's aggregation the last `k0` updated versions
    it averages are kept too. The stream across windows changes none of this.
    """
    return k0 + 1 + (k0 if aggregate else 0)


def replica_bytes(param_bytes: int, optimizer_bytes: int) -> int:
    """Bytes a backup node keeps for another stage's replica (Asteroid §3.4 (2)).

    Only what recovery must restore: weights and optimizer state. Gradients
    and activations are rebuilt by the round that resumes, so none are kept.
    """
    return param_bytes + optimizer_bytes


@dataclass(frozen=True)
class LayerMemory:
    """Per-layer byte counts as prefix sums, so a layer range's peak is an O(1) lookup."""

    params: tuple[int, ...]
    optimizer: tuple[int, ...]
    activations: tuple[int, ...]

    @classmethod
    def of(
        cls, params: Sequence[int], optimizer: Sequence[int], activations: Sequence[int]
    ) -> LayerMemory:
        """From per-layer parameter, optimizer and per-sample activation bytes."""
        if not len(params) == len(optimizer) == len(activations):
            raise ConfigError(
                f"byte counts for {len(params)}, {len(optimizer)} and {len(activations)} layers"
            )
        return cls(
            params=(0, *accumulate(params)),
            optimizer=(0, *accumulate(optimizer)),
            activations=(0, *accumulate(activations)),
        )

    @classmethod
    def from_profile(cls, profile: Profile) -> LayerMemory:
        """The byte counts a profile measured for each layer."""
        return cls.of(
            [lp.param_bytes for lp in profile.layers],
            [lp.optimizer_bytes for lp in profile.layers],
            [lp.activation_bytes for lp in profile.layers],
        )

    @property
    def num_layers(self) -> int:
        """How many layers the counts describe."""
        return len(self.params) - 1

    def stage(self, start: int, end: int, samples: int, in_flight: int) -> int:
        """Peak bytes of a device running layers [start, end) (see `stage_bytes`)."""
        return stage_bytes(
            self.params[end] - self.params[start],
            self.optimizer[end] - self.optimizer[start],
            self.activations[end] - self.activations[start],
            samples,
            in_flight,
        )

    def replica(self, start: int, end: int) -> int:
        """Bytes of the replica of layers [start, end) on its backup node (see `replica_bytes`)."""
        return replica_bytes(
            self.params[end] - self.params[start], self.optimizer[end] - self.optimizer[start]
        )
