"""A job's ``events`` stream: one entry per state change or milestone, oldest first.

The coordinator appends ``{"event": <state or milestone>, ...fields}`` (a
checkpoint committed, a job submitted); `asteroid train` follows it to show
each phase as it starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.ids import check_job_id
from common.records._base import RecordModel
from common.store import Store

__all__ = ["EVENTS_MAX", "EventEntry", "append_event", "event_fields", "read_events_after"]

EVENTS_MAX = 10000
"""The stream's cap: older entries go first."""


class EventEntry(RecordModel):
    """One entry: what happened, with the fields its state brought (extras kept)."""

    event: str
    round: int | None = None
    total_rounds: int | None = None
    planner: str | None = None
    workers: list[str] | None = None
    reason: str | None = None
    error: str | None = None


def event_fields(event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The entry recording `event` with `fields`."""
    return {"event": event, **fields}


def append_event(store: Store, jid: str, event: str, **fields: Any) -> None:
    """Append ``{"event": event, **fields}`` to the job's events stream."""
    store.append(
        "events",
        check_job_id(jid, "an event's writer"),
        event_fields(event, fields),
        maxlen=EVENTS_MAX,
    )


def read_events_after(store: Store, jid: str, after: str) -> tuple[list[EventEntry], str]:
    """Entries newer than stream id `after` ("0" for all) and the id of the newest one read.

    An entry without an `event` (written by no coordinator) is skipped.
    """
    raw, newest = store.read_after("events", check_job_id(jid, "an event's reader"), after)
    entries = [EventEntry.model_validate(e) for e in raw if isinstance(e.get("event"), str)]
    return entries, newest
