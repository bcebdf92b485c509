"""What the dashboard keeps of each job's streams between two looks, read incrementally.

The page polls every second and Prometheus scrapes every few: re-reading a
job's whole metrics stream (up to 10,000 entries) each time would cost Redis
more than the job's own commits. A `JobTail` remembers the last stream id it
read and folds only newer entries into running totals (counters, histogram
buckets) and short windows of recent points (the charts). The folds are pure
functions of (tail, entries, now), tested without Redis.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LATENCY_BUCKETS",
    "ROUND_BUCKETS",
    "SERIES_MAX",
    "Histogram",
    "JobTail",
    "fold_events",
    "fold_metrics",
]

SERIES_MAX = 600
"""Newest round points kept per job for the charts (10 minutes of 1 s rounds)."""
EVENTS_MAX = 200
"""Newest events kept per job for the page."""
REQUESTS_MAX = 200
"""Newest inference requests kept per serving job for the page."""

ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of asteroid_round_duration_seconds: a CPU toy round to a slow edge one."""
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of asteroid_inference_latency_seconds."""


@dataclass
class Histogram:
    """A Prometheus-style histogram: per-bucket counts (not cumulative), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf

    def observe(self, value: float) -> None:
        """Count `value` in the first bucket whose bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """Buckets as Prometheus exposes them: (upper bound, observations <= it), +Inf last."""
        out, running = [], 0
        for bound, n in zip((*[repr(b) for b in self.bounds], "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q` (None with no observations)."""
        if self.count == 0:
            return None
        rank, running = q * self.count, 0
        for i, n in enumerate(self.counts):
            running += n
            if running >= rank and n:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return None


@dataclass
class JobTail:
    """One job's streams as read so far: where reading stopped and what it added up to."""

    submitted: float | None = None
    """The job record's `submitted` when the tail began: a replaced job starts a new tail."""
    metrics_after: str | None = None
    """The newest metrics stream id read (None: never read, so the first read is whole)."""
    events_after: str | None = None
    series: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=SERIES_MAX))
    """Newest training rounds: round, time, loss, samples_per_s, round_s, eval points."""
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=EVENTS_MAX))
    requests: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=REQUESTS_MAX))
    rounds: Histogram = field(default_factory=lambda: Histogram(ROUND_BUCKETS))
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    samples: float = 0.0
    """Samples trained in every committed round read (replayed rounds too: work done)."""
    recoveries: int = 0
    replans: int = 0


def _num(value: object) -> float | None:
    """A finite JSON number as float, else None (entries are peers' writes: not trusted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if number == number and abs(number) != float("inf") else None


def fold_metrics(tail: JobTail, entries: list[tuple[float, dict[str, Any]]]) -> None:
    """Add metrics `entries` (each with the time it was made) to `tail`.

    A training round's entry (it has `round_s`) adds a chart point, one
    observation of the round duration and its samples; an evaluation's entry
    adds its held-out scores to the newest point; a serving request's entry
    (it has `latency_s`) adds one request and its latency.
    """
    for when, entry in entries:
        latency = _num(entry.get("latency_s"))
        if latency is not None:
            tail.latency.observe(max(0.0, latency))
            tail.requests.append(
                {
                    "request": entry.get("request"),
                    "time": when,
                    "latency_s": latency,
                    "queued_s": _num(entry.get("queued_s")),
                    "tokens_out": _num(entry.get("tokens_out")),
                }
            )
            continue
        round_s, rate = _num(entry.get("round_s")), _num(entry.get("samples_per_s"))
        if round_s is not None:
            tail.rounds.observe(max(0.0, round_s))
            tail.samples += max(0.0, round_s * (rate or 0.0))
            tail.series.append(
                {
                    "round": entry.get("round"),
                    "time": when,
                    "loss": _num(entry.get("loss")),
                    "samples_per_s": rate,
                    "round_s": round_s,
                    "devices": sorted(entry.get("devices") or {}),
                }
            )
        elif _num(entry.get("eval_accuracy")) is not None and tail.series:
            tail.series[-1] = {
                **tail.series[-1],
                "eval_accuracy": _num(entry.get("eval_accuracy")),
                "eval_loss": _num(entry.get("eval_loss")),
            }


EVENT_FIELDS = ("round", "total_rounds", "lost", "reason", "error", "from_round", "replayed")
"""The fields of an event the page shows (the rest, such as whole plans, stay in Redis)."""


def fold_events(tail: JobTail, entries: list[tuple[float, dict[str, Any]]]) -> None:
    """Add events `entries` to `tail`, counting recoveries and re-plans."""
    for when, entry in entries:
        name = entry.get("event")
        if not isinstance(name, str):
            continue
        if name == "recovered":
            tail.recoveries += 1
        elif name == "replanned":
            tail.replans += 1
        kept = {k: entry[k] for k in EVENT_FIELDS if k in entry}
        stages = entry.get("stages")
        if isinstance(stages, list):  # [[lo, hi, [devices]], ...] of a recovery or re-plan
            kept["stages"] = stages[:32]
        tail.events.append({"event": name, "time": when, **kept})
