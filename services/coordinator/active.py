"""The run the coordinator's loop steps: a training, federated or serving job's, or its crash.

The loop (`service.Coordinator._loop`) holds at most one; each kind has the same
steps (`feed`, `ended`, `stop`, and for training jobs `result`), so the loop
treats them alike. A run that raised what nobody foresaw is replaced by its
`Crashed` end, which ends that job and never the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from services.coordinator.federated import FederatedRun
from services.coordinator.jobs import JobRun
from services.coordinator.outcomes import JobFailed, JobSummary
from services.coordinator.serving import ServeRun

__all__ = ["A", "Active", "Crashed", "Run", "job_of"]


@dataclass(frozen=True)
class Crashed:
    """A run that raised what nobody foresaw: ended, recorded failed, its error its result."""

    job_id: str
    error: JobFailed
    ended: bool = True

    def feed(self, event: object) -> None:
        """Nothing is left to step."""

    def stop(self, reason: str) -> None:
        """Nothing is left to stop."""

    def result(self) -> JobSummary:
        """The crash, raised."""
        raise self.error


Run = JobRun | FederatedRun
"""A training job's run: plain, or as a home of a federation."""
Active = Run | ServeRun | Crashed
"""What the loop steps: the running job's run."""
A = TypeVar("A", bound=Active)


def job_of(active: Active) -> str:
    """The id of the job `active` runs."""
    if isinstance(active, ServeRun):
        return active.spec.serve_id
    return active.job_id if isinstance(active, Crashed) else active.jid
