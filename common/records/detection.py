"""The ``timeouts:<id>`` document (`TimeoutsRecord`): a job's detection timeouts in force.

The coordinator derives its heartbeat deadline, probe timeout, flap grace and
neighbour timeout from what it measures, the settings being upper bounds, and
writes them here when they change, so `asteroid status` can show what a
person would otherwise have to guess. Every value is checked on the way in
and on the way out: a record is bounded whoever wrote it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Protocol

from pydantic import ConfigDict, Field, ValidationError, field_validator

from common.errors import StoreError
from common.ids import check_job_id
from common.records._base import RecordModel
from common.store import Store

__all__ = [
    "MAX_WHY_CHARS",
    "TIMEOUT_FIELDS",
    "Timeouts",
    "TimeoutsRecord",
    "put_effective",
    "read_effective",
]

TIMEOUT_FIELDS = ("heartbeat_deadline_s", "probe_timeout_s", "flap_grace_s", "peer_timeout_s")
"""The timeouts a record holds, in the order a detection runs into them."""
MAX_WHY_CHARS = 120
"""Longest explanation of one timeout (longer ones are cut, on writing and on reading)."""
_MAX_S = 1e6


class Timeouts(Protocol):
    """What `put_effective` needs of the coordinator's derived timeouts (its `Effective`)."""

    @property
    def heartbeat_deadline_s(self) -> float:
        """Silence after which a worker is a suspect."""

    @property
    def probe_timeout_s(self) -> float:
        """Wait for a suspect's answer to a probe."""

    @property
    def flap_grace_s(self) -> float:
        """Wait for a closed connection to come back."""

    @property
    def peer_timeout_s(self) -> float:
        """Wait for a neighbour's data before a worker reports it silent."""

    @property
    def why(self) -> Mapping[str, str]:
        """Where each came from, by field name."""


class TimeoutsRecord(RecordModel):
    """A job's detection timeouts (seconds, each in (0, 1e6]) and where each came from.

    Unknown fields are ignored rather than kept: nothing else belongs here, and
    a record stays bounded whatever a writer added.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    heartbeat_deadline_s: float = Field(gt=0, le=_MAX_S)
    probe_timeout_s: float = Field(gt=0, le=_MAX_S)
    flap_grace_s: float = Field(gt=0, le=_MAX_S)
    peer_timeout_s: float = Field(gt=0, le=_MAX_S)
    why: dict[str, str] = {}
    """Per timeout, one phrase: ``measured (3 x p99 gap 510 ms)``, ``bound``, ``floor``."""
    updated: float | None = None
    """When the coordinator wrote it (seconds since the epoch)."""

    @field_validator("why", mode="before")
    @classmethod
    def _bounded_why(cls, value: object) -> object:
        # only the four named timeouts, each phrase cut: a record stays small
        if not isinstance(value, dict):
            return value
        return {
            k: v[:MAX_WHY_CHARS]
            for k, v in value.items()
            if k in TIMEOUT_FIELDS and isinstance(v, str)
        }

    @field_validator("updated")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None


def put_effective(store: Store, jid: str, eff: Timeouts, now: float | None = None) -> None:
    """Record job `jid`'s timeouts in force, `eff`, written at `now` (the current time).

    Raises ValueError (pydantic's ValidationError) if a value is out of bounds:
    the writer has a bug, and Redis never gets the record.
    """
    record = TimeoutsRecord.model_validate(
        {
            **{f: getattr(eff, f) for f in TIMEOUT_FIELDS},
            "why": dict(eff.why),
            "updated": time.time() if now is None else now,
        }
    )
    store.put_json(record.model_dump(mode="json"), "timeouts", check_job_id(jid, "a writer"))


def read_effective(store: Store, jid: str) -> TimeoutsRecord | None:
    """Job `jid`'s timeouts in force, or None when none were recorded.

    Raises StoreError naming the job when the document is not a valid record
    (written by no coordinator).
    """
    try:
        doc = store.get_json("timeouts", check_job_id(jid, "a timeouts reader"))
    except ValueError as exc:  # not JSON at all
        raise StoreError(f"job {jid}'s timeouts in Redis are not JSON: {exc}") from exc
    if doc is None:
        return None
    try:
        return TimeoutsRecord.model_validate(doc)
    except ValidationError as exc:
        raise StoreError(f"job {jid}'s timeouts record in Redis is malformed: {exc}") from exc
