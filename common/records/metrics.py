"""A job's ``metrics`` stream: one entry per committed round or evaluation.

A round's entry carries its loss, accuracy, duration, throughput and each
device's timings; an evaluation's its held-out loss and accuracy. The CLI's
`export-metrics` and `train`'s progress read it; `common.metrics_export`
turns entries into scalars.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from common.errors import StoreError
from common.ids import check_job_id
from common.records._base import RecordModel
from common.store import Store

__all__ = ["MetricsEntry", "read_metrics", "read_metrics_after"]


class MetricsEntry(RecordModel):
    """One metrics entry; `fields()` gives it back as written (what the files hold)."""

    round: int | None = None
    epoch: int | None = None
    loss: float | None = None
    accuracy: float | None = None
    round_s: float | None = None
    samples_per_s: float | None = None
    devices: dict[str, dict[str, Any]] | None = None
    """Per device: its stage, peak memory and task timings in that round."""
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_samples: int | None = None
    time: float | None = None
    """When the round was committed (seconds since the epoch)."""


def read_metrics(store: Store, jid: str) -> list[MetricsEntry]:
    """Every entry of the job's metrics, oldest first, each with the wall-clock `time` it was made.

    An entry written before entries carried their `time` gets its stream
    entry's, which Redis stamps in milliseconds when it appends. Raises
    StoreError for an entry of the wrong shape.
    """
    out = []
    for entry_id, fields in store.read_entries("metrics", check_job_id(jid, "a metrics reader")):
        if "time" not in fields:
            fields["time"] = int(entry_id.split("-", 1)[0]) / 1000
        out.append(_entry(jid, fields))
    return out


def read_metrics_after(store: Store, jid: str, after: str) -> tuple[list[MetricsEntry], str]:
    """Entries newer than stream id `after` ("0" for all) and the id of the newest one read."""
    raw, newest = store.read_after("metrics", check_job_id(jid, "a metrics reader"), after)
    return [_entry(jid, e) for e in raw], newest


def _entry(jid: str, fields: dict[str, Any]) -> MetricsEntry:
    try:
        return MetricsEntry.model_validate(fields)
    except ValidationError as exc:
        raise StoreError(f"a metrics entry of job {jid} in Redis is malformed: {exc}") from exc
