"""A job that passed its checks, as one value: the spec and what the check derived.

Its own module, free of the model build that derives it (`checks`), so the pure
cores that queue and run a checked job (`cluster`) import the value without the
effect that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.job import JobSpec

__all__ = ["CheckedJob", "id_taken"]


@dataclass(frozen=True)
class CheckedJob:
    """A job spec that passed `checks.check_job`, with what the check derived from it.

    Checked once where the job enters (a submission, a run), then passed on as
    one value, so nothing downstream builds the model or sizes the data again.

    Attributes:
        spec: The job as submitted.
        rounds: Rounds it runs (its `epochs` turned into rounds, or `rounds`).
        train_size: Training samples (None: an unbounded synthetic stream).
        eval_size: Held-out samples one evaluation covers.
        layers: The model's placeable layers (what a plan must cover).

    """

    spec: JobSpec
    rounds: int
    train_size: int | None
    eval_size: int
    layers: int

    @property
    def job_id(self) -> str:
        """The job's id, as the queue and the records name it."""
        return self.spec.job_id

    def piece(self, spec: JobSpec) -> CheckedJob:
        """The same checks for `spec`, a federated home's piece of this job.

        A piece differs only in its id, seed and round count (its `epochs` over
        the same data), so the model and data sizes carry over.
        """
        return CheckedJob(
            spec, spec.total_rounds(self.train_size), self.train_size, self.eval_size, self.layers
        )


def id_taken(jid: str, held: str, how: str) -> str:
    """Why job id `jid` is refused: Redis holds an earlier run (`held`); `how` replaces it."""
    return (
        f"job_id: job {jid} exists ({held}); pick another job_id, or {how} to "
        "delete its checkpoints and metrics and start afresh"
    )
