"""How a job ends, as its callers see it: a summary, or the error that ended it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.errors import AsteroidError
from common.ids import DeviceId
from services.coordinator import driver

__all__ = ["DeviceLost", "JobCancelled", "JobFailed", "JobSummary"]


class JobFailed(AsteroidError):
    """The job cannot continue; the message says which worker and why."""


class DeviceLost(JobFailed):
    """Devices are gone (dead after an unanswered probe, or hung), outside a job's core."""

    def __init__(self, devices: list[DeviceId], why: str) -> None:
        super().__init__(why)
        self.devices = sorted(devices)


class JobCancelled(AsteroidError):
    """Someone cancelled the job; its last committed checkpoint stays."""


@dataclass
class JobSummary:
    """What a finished job reports."""

    job_id: str
    rounds: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    max_alive: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    """Per device, the most bytes it held at once in a round: task pool plus kept activations."""
    checkpoints: list[int] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(round, held-out loss, held-out accuracy) after each evaluation."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """One record per recovery: devices lost, round resumed from, rounds replayed, seconds."""

    @classmethod
    def of(cls, job_id: str, rounds: int, s: driver.Summary) -> JobSummary:
        """The core's summary, as callers read it."""
        return cls(
            job_id=job_id,
            rounds=rounds,
            losses=list(s.losses),
            accuracies=list(s.accuracies),
            round_s=list(s.round_s),
            max_alive=dict(s.max_alive),
            peak_bytes=dict(s.peak_bytes),
            checkpoints=list(s.checkpoints),
            evals=list(s.evals),
            recoveries=[dict(r) for r in s.recoveries],
        )
