"""The ``job:<id>`` hash (`JobRecord`) and the ``jobs`` index of job ids by submission time.

One hash per job, training or serving, written by the coordinator: its
lifecycle state with the fields that state brings (the workers it profiles, the
planner, the rounds committed, why it failed), and the newest round's loss and
held-out scores. The CLI's `status` and `train`'s progress read it. Every state
change is also an entry of the job's events stream (`common.records.events`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from common.errors import ConfigError, StoreError
from common.ids import JobId, check_job_id
from common.records._base import RecordModel, known_fields
from common.records.events import event_fields
from common.store import Store

__all__ = [
    "RECENT_JOBS",
    "WAITING_NAMED",
    "JobRecord",
    "Waiting",
    "commit_round",
    "forget_job",
    "index_job",
    "job_state",
    "read_job",
    "recent_jobs",
    "write_job",
    "write_job_state",
]

RECENT_JOBS = 50
"""How many of the newest jobs `status` lists."""

WAITING_NAMED = 8
"""How many of the vetted devices a wait for workers names (the others are counted)."""

_JOB_KEYS = ("job", "events", "metrics", "plan", "cluster", "timeouts")
"""A job's exact keys besides its checkpoints and spec: what `forget_job` deletes."""


class Waiting(RecordModel):
    """A submitted job's wait for workers: how many are vetted, of how many it needs.

    Written by the coordinator each time the vetted devices change, so a
    person sees a wait that would otherwise look like a hang.
    """

    vetted: int = 0
    need: int | None = None
    """The job's `min_workers` (None: it starts on those present once they settle)."""
    devices: list[str] = []
    """The first `WAITING_NAMED` vetted devices, by name."""

    @classmethod
    def of(cls, vetted: Sequence[str], need: int | None) -> Waiting:
        """The wait with `vetted` devices, naming the first `WAITING_NAMED` of them."""
        return cls(vetted=len(vetted), need=need, devices=list(vetted[:WAITING_NAMED]))

    @property
    def line(self) -> str:
        """One line for a person: ``waiting for workers 3/4 (dev-0, dev-1, dev-2)``."""
        have = f"{self.vetted}" if self.need is None else f"{self.vetted}/{self.need}"
        names = ", ".join(self.devices)
        if self.vetted > len(self.devices):
            names += f", +{self.vetted - len(self.devices)} more"
        return f"waiting for workers {have}" + (f" ({names})" if names else "")


class JobRecord(RecordModel):
    """A job's hash: its state and what the coordinator last recorded of it.

    Every field is optional: a hash gains its fields state by state (`round`
    once training starts, `error` only if it fails), and a serving job has no
    rounds. Fields an older release wrote and this one does not name load as
    extras.
    """

    state: str = "unknown"
    """Its lifecycle state (`common.lifecycle`): submitted, profiling, ... finished."""
    kind: str | None = None
    """``serve`` for a serving job; absent for a training job."""
    submitted: float | None = None
    """When it was submitted (seconds since the epoch)."""
    updated: float | None = None
    """When its state or round was last written."""
    total_rounds: int | None = None
    round: int | None = None
    """Rounds committed so far."""
    epoch: int | None = None
    """The plan epoch its rounds run under."""
    loss: float | None = None
    """The training loss of the newest committed round."""
    samples_per_s: float | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    """The newest held-out accuracy (0-1)."""
    planner: str | None = None
    workers: list[str] | None = None
    """The devices it profiles on (`profiling`)."""
    lost: list[str] | None = None
    """The devices whose loss it recovers from (`recovering`)."""
    draining: list[str] | None = None
    joining: list[str] | None = None
    reason: str | None = None
    """Why it was cancelled or is re-planned."""
    error: str | None = None
    """Why it failed."""
    federation: str | None = None
    home: str | None = None
    pieces: int | None = None
    """Pieces a federated job trained."""
    plan: dict[str, Any] | None = None
    """A running serving job's plan."""
    profiles: dict[str, Any] | None = None
    """The block profiles a running serving job's plan was priced on, by device."""
    waiting: Waiting | None = None
    """A submitted job's wait for workers (None once it has them)."""

    @property
    def note(self) -> str:
        """What went wrong, why it stopped or what it waits for: the error, reason or wait."""
        if self.error is not None:
            return self.error
        if self.reason is not None:
            return self.reason
        return self.waiting_line

    @property
    def waiting_line(self) -> str:
        """The wait for workers of a job still submitted, as one line ("" when none)."""
        if self.state != "submitted" or self.waiting is None:
            return ""
        return self.waiting.line


def read_job(store: Store, jid: str) -> JobRecord | None:
    """The job's record, or None when Redis holds no hash for it.

    Raises StoreError when the hash holds a field of the wrong type (written
    by no coordinator).
    """
    raw = store.get_fields("job", check_job_id(jid, "a job record's reader"))
    if not raw:
        return None
    try:
        return JobRecord.model_validate(raw)
    except ValidationError as exc:
        raise StoreError(f"job {jid}'s record in Redis is malformed: {exc}") from exc


def job_state(store: Store, jid: str) -> str | None:
    """The job's state, or None when it has no record."""
    record = read_job(store, jid)
    return None if record is None else record.state


def write_job(store: Store, jid: str, **fields: Any) -> None:
    """Set fields of the job's hash (each one `JobRecord` names), leaving the others."""
    store.set_fields(known_fields(JobRecord, fields, "a job record"), "job", _checked(jid))


def write_job_state(store: Store, jid: str, state: str, **extra: Any) -> None:
    """Move the job to `state` with `extra` fields: its hash, then an events entry.

    The hash gets `updated` (now); the entry is ``{"event": state, **extra}``.
    """
    jid = _checked(jid)
    fields = known_fields(JobRecord, {"state": state, **extra}, "a job record")
    store.set_fields({**fields, "updated": time.time()}, "job", jid)
    store.append("events", jid, event_fields(state, extra))


def commit_round(
    store: Store,
    jid: str,
    fields: Mapping[str, Any],
    entries: dict[str, tuple[dict[str, Any], int]],
    now: float,
) -> None:
    """Set the job's hash `fields` (with `updated` = `now`) and append `entries` atomically.

    `entries` maps a stream (``metrics``, ``ledger``) to its entry and cap: a
    round is committed by its hash's `round` and its metrics entry together.
    """
    checked = known_fields(JobRecord, {**fields, "updated": now}, "a job record")
    store.update_job(_checked(jid), checked, entries)


def index_job(store: Store, jid: str, when: float | None = None) -> None:
    """List the job in the ``jobs`` index at `when` (now): `recent_jobs` shows newest first."""
    store.add_ranked(_checked(jid), time.time() if when is None else when, "jobs")


def recent_jobs(store: Store, count: int = RECENT_JOBS) -> list[JobId]:
    """The ids of the `count` newest indexed jobs, newest first (malformed ids skipped)."""
    out = []
    for jid in store.top_ranked(count, "jobs"):
        try:
            out.append(check_job_id(jid, "the jobs index"))
        except ConfigError:  # an index entry no coordinator wrote
            continue
    return out


def forget_job(store: Store, jid: str) -> None:
    """Delete an earlier run of job `jid`: its hash, streams, plan, cluster and checkpoints.

    Only an operator's explicit replace calls this. The spec and the index
    entry are rewritten by the new submission.
    """
    jid = _checked(jid)
    store.delete(*(store.key(part, jid) for part in _JOB_KEYS))
    store.delete_prefix("ckpt", jid, "")


def _checked(jid: str) -> JobId:
    return check_job_id(jid, "a job record's writer")
