"""The cluster as the dashboard shows it: one read-only look at Redis, as plain JSON.

`ClusterReader.state` is what ``/api/state`` answers and the page draws:
devices, recent jobs and one job in detail (plan, rounds, events, requests).
The Prometheus collector reads the same records through `ClusterReader.jobs`.
Everything goes through the typed records (`common.records`); nothing is
written, and the only input that reaches a key is a job id checked by
`common.ids.check_job_id`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from common.errors import ConfigError, StoreError
from common.ids import check_job_id
from common.lifecycle import TERMINAL
from common.plan import Plan
from common.records.devices import DeviceRecord, read_devices
from common.records.documents import read_plan
from common.records.jobs import JobRecord, read_job, recent_jobs
from common.secrets import mask_text
from common.store import OUTAGE, Store
from services.dashboard.tails import JobTail, fold_events, fold_metrics

__all__ = [
    "JOBS_SHOWN",
    "ClusterReader",
    "JobLook",
    "accelerator_of",
    "device_row",
    "plan_view",
    "safe_state",
]

JOBS_SHOWN = 20
"""Newest jobs the page lists (Prometheus sees `common.records.jobs.RECENT_JOBS`)."""
POINTS_SHOWN = 300
"""Newest rounds the page's charts and timeline get."""


def accelerator_of(fingerprint: str) -> str:
    """The accelerator a device fingerprint names, or "cpu".

    A fingerprint reads ``<arch>-<N>c-<N>t[-q<quota>][-<gpu label>]-<mem>g-<digest>``
    (`common.device.device_fingerprint`): what sits between the threads (or
    quota) and the memory is the GPU's label.
    """
    parts = fingerprint.split("-")
    if len(parts) < 5:
        return "cpu" if fingerprint else "?"
    middle = parts[3:-2]
    if middle and middle[0].startswith("q"):
        middle = middle[1:]
    return "-".join(middle) or "cpu"


def device_row(d: DeviceRecord, now: float, stale_after_s: float) -> dict[str, Any]:
    """One device as the page shows it; `up` only while its heartbeat is fresh."""
    age = None if d.seen is None else max(0.0, now - d.seen)
    return {
        "device": d.device,
        "state": d.state or "?",
        "age_s": age,
        "up": age is not None and age <= stale_after_s,
        "stage": d.stage,
        "round": d.round,
        "memory_budget": d.memory_budget,
        "threads": d.threads,
        "host": d.host,
        "version": d.version,
        "accelerator": accelerator_of(d.fingerprint),
    }


def plan_view(plan: Plan | None) -> dict[str, Any] | None:
    """A plan as the page draws it: its stages' layers and each device's share."""
    if plan is None:
        return None
    return {
        "planner": plan.planner,
        "global_batch": plan.global_batch,
        "microbatches": plan.microbatches,
        "predicted_round_s": plan.predicted_round_s,
        "stages": [
            {
                "stage": i,
                "layers": [st.start, st.end],
                "devices": [{"device": a.device, "share": a.share} for a in st.devices],
            }
            for i, st in enumerate(plan.stages)
        ],
    }


@dataclass(frozen=True)
class JobLook:
    """One job as read now: its record and its tail (streams read so far)."""

    job: str
    record: JobRecord
    tail: JobTail


class ClusterReader:
    """Reads the cluster's records for the page and for Prometheus, one look at a time.

    Stream tails are kept between looks (see `services.dashboard.tails`); a
    lock makes looks from the HTTP server's threads take turns.
    """

    def __init__(
        self,
        store: Store,
        cluster: str,
        stale_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Read `store` (cluster `cluster`); a device silent for `stale_after_s` is down."""
        self.store = store
        self.cluster = cluster
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._tails: dict[str, JobTail] = {}
        self._lock = threading.Lock()

    def devices(self) -> list[dict[str, Any]]:
        """Every device with a record, freshest first."""
        now = self.clock()
        return [device_row(d, now, self.stale_after_s) for d in read_devices(self.store)]

    def jobs(self, count: int) -> list[JobLook]:
        """The `count` newest jobs with records, newest first, their tails brought up to date."""
        with self._lock:
            looks = []
            for jid in recent_jobs(self.store, count):
                record = read_job(self.store, jid)
                if record is None:
                    continue
                looks.append(JobLook(jid, record, self._update(jid, record)))
            return looks

    def _update(self, jid: str, record: JobRecord) -> JobTail:
        tail = self._tails.get(jid)
        if tail is None or tail.submitted != record.submitted:  # new, or replaced since
            tail = self._tails[jid] = JobTail(submitted=record.submitted)
        now = self.clock()
        entries, tail.metrics_after = self._read("metrics", jid, tail.metrics_after, now)
        fold_metrics(tail, entries)
        events, tail.events_after = self._read("events", jid, tail.events_after, now)
        fold_events(tail, events)
        return tail

    def _read(
        self, stream: str, jid: str, after: str | None, now: float
    ) -> tuple[list[tuple[float, dict[str, Any]]], str]:
        """Entries of `stream` newer than `after`, each with when it was made.

        The first read takes the whole stream with its ids, which Redis stamps
        in milliseconds; later reads take only newer entries, stamped with
        their own `time` field or now (the page looks every second).
        """
        if after is None:
            pairs = self.store.read_entries(stream, jid)
            stamped = [(_stamp(f, int(i.split("-", 1)[0]) / 1000), f) for i, f in pairs]
            return stamped, pairs[-1][0] if pairs else "0"
        raw, newest = self.store.read_after(stream, jid, after)
        return [(_stamp(f, now), f) for f in raw], newest

    def forget_except(self, keep: set[str]) -> None:
        """Drop the tails of jobs no longer listed (the index keeps only the newest)."""
        with self._lock:
            for jid in set(self._tails) - keep:
                del self._tails[jid]

    def state(self, job: str | None = None) -> dict[str, Any]:
        """What ``/api/state`` answers: devices, recent jobs, and `job` (default: newest) in detail.

        Raises ConfigError for a malformed `job`, StoreError for a record no
        coordinator wrote, and Redis's own errors while it is away.
        """
        wanted = None if job is None else check_job_id(job, "the dashboard's ?job=")
        looks = self.jobs(JOBS_SHOWN)
        self.forget_except({look.job for look in looks})
        chosen = _choose(looks, wanted)
        if wanted is not None and chosen is None:  # not among the newest: read it alone
            record = read_job(self.store, wanted)
            if record is not None:
                with self._lock:
                    chosen = JobLook(wanted, record, self._update(wanted, record))
        return {
            "cluster": self.cluster,
            "redis": self.store.where,
            "now": self.clock(),
            "stale_after_s": self.stale_after_s,
            "devices": self.devices(),
            "jobs": [_job_row(look) for look in looks],
            "job": None if chosen is None else self._detail(chosen),
        }

    def _detail(self, look: JobLook) -> dict[str, Any]:
        tail, record = look.tail, look.record
        try:
            plan = read_plan(self.store, look.job)
            if plan is None and record.plan is not None:  # a serving job keeps it in its hash
                plan = Plan.model_validate(record.plan)
        except ValidationError:
            plan = None  # a serving plan of another shape: the page says none
        series = list(tail.series)[-POINTS_SHOWN:]
        p50, p95 = tail.latency.quantile(0.5), tail.latency.quantile(0.95)
        serving = None
        if tail.latency.count:
            serving = {
                "requests": tail.latency.count,
                "mean_latency_s": tail.latency.total / tail.latency.count,
                "p50_le_s": p50,
                "p95_le_s": p95,
                "recent": list(tail.requests)[-50:],
            }
        return {
            **_job_row(look),
            "plan": plan_view(plan),
            "series": series,
            "events": list(tail.events)[-50:],
            "recoveries": tail.recoveries,
            "replans": tail.replans,
            "samples": tail.samples,
            "serving": serving,
        }


def _stamp(fields: dict[str, Any], default: float) -> float:
    when = fields.get("time")
    return float(when) if isinstance(when, int | float) and not isinstance(when, bool) else default


def _choose(looks: list[JobLook], wanted: str | None) -> JobLook | None:
    """The job asked for, else the newest one still active, else the newest one."""
    if wanted is not None:
        return next((look for look in looks if look.job == wanted), None)
    active = [look for look in looks if look.record.state not in TERMINAL]
    return (active or looks)[0] if looks else None


def _job_row(look: JobLook) -> dict[str, Any]:
    r = look.record
    return {
        "job": look.job,
        "state": r.state,
        "kind": r.kind or "train",
        "round": r.round,
        "total_rounds": r.total_rounds,
        "loss": r.loss,
        "samples_per_s": r.samples_per_s,
        "eval_accuracy": r.eval_accuracy,
        "note": r.note[:200],
    }


def safe_state(reader: ClusterReader, job: str | None) -> tuple[int, dict[str, Any]]:
    """`reader.state(job)` as (HTTP status, body): 400 for a bad id, 503 while Redis is away."""
    try:
        return 200, reader.state(job)
    except ConfigError as exc:
        return 400, {"error": str(exc)}
    except (StoreError, *OUTAGE) as exc:
        return 503, {"error": mask_text(str(exc)), "redis": reader.store.where}
