"""`asteroid status`'s detection lines: the timeouts in force for each active job.

The coordinator derives them from what it measures (the settings are upper
bounds) and records them per job (`common.records.detection`); a person who
wonders how soon a silent device will be noticed reads them here instead of
guessing from the settings. Everything shown comes from Redis, so it passes
`shown` like every other record's text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.errors import StoreError
from services.cli.console import shown

if TYPE_CHECKING:
    from common.records.detection import TimeoutsRecord
    from common.store import Store

__all__ = ["LABELS", "detection_line", "detection_lines"]

LABELS = (
    ("heartbeat_deadline_s", "heartbeat"),
    ("probe_timeout_s", "probe"),
    ("flap_grace_s", "grace"),
    ("peer_timeout_s", "neighbour"),
)
"""Each timeout's field and its name on the line, in the order a detection meets them."""
_ACTIVE = frozenset({"submitted", "profiling", "planning", "running", "recovering", "replanning"})
"""Job states whose timeouts are in force (`common.lifecycle.ACTIVE`, without its import)."""


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1.0 else f"{value:.3g} s"


def detection_line(jid: str, rec: TimeoutsRecord, now: float | None = None) -> str:
    """One line: ``detection of job J: heartbeat 1.65 s measured (3 x p99 gap 550 ms) · ...``."""
    parts = []
    for name, label in LABELS:
        why = rec.why.get(name)
        text = f"{label} {_seconds(getattr(rec, name))}"
        parts.append(f"{text} {shown(why)}" if why else text)
    line = f"detection of job {shown(jid)}: " + " · ".join(parts)
    if rec.updated is not None:
        age = max(0.0, (time.time() if now is None else now) - rec.updated)
        line += f" (derived {age:.0f} s ago)"
    return line


def detection_lines(store: Store, jobs: Sequence[str]) -> list[str]:
    """The detection line of each of `jobs` that is active and has timeouts recorded.

    A record no coordinator could have written is named on its line rather
    than failing the whole status: the devices and jobs above still help.
    """
    from common.records.detection import read_effective
    from common.records.jobs import read_job

    lines = []
    for jid in jobs:
        try:
            job = read_job(store, jid)
            if job is None or job.state not in _ACTIVE:
                continue
            rec = read_effective(store, jid)
        except StoreError as exc:
            lines.append(f"detection of job {shown(jid)}: unreadable ({shown(exc)[:200]})")
            continue
        if rec is not None:
            lines.append(detection_line(jid, rec))
    return lines
