"""The recovery bench's faults and checks on a testbed device: SIGSTOP/SIGCONT, the
detection timeouts in force, the ledger, and the survivors' own recovery seconds.

A SIGSTOPped device is the silent loss: its processes stop where they stand,
its sockets stay open (the kernel still acknowledges TCP), so no connection
closes and only missed heartbeats and an unanswered probe declare it lost.
Let go (SIGCONT) after the job recovered, its messages carry an old plan
epoch: the coordinator must ignore them, and the ledger must still hold every
committed round exactly once.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
from pathlib import Path
from typing import Any

from common.ledger import effective_rounds
from common.settings import CoordinatorSettings
from common.store import Store
from services.testbed.bed import Testbed
from tests.bench.recovery_report import Run

__all__ = [
    "cont_pids",
    "ignored_from",
    "ledger_verdict",
    "stop_device",
    "timeouts_in_force",
    "worker_side",
]

STOP_PASSES = 3
"""Passes over the device's processes: one started meanwhile is stopped by the next pass."""


def stop_device(bed: Testbed, dev: str) -> list[int]:
    """SIGSTOP every process of device `dev`; returns their ids (to SIGCONT them later)."""
    stopped: list[int] = []
    for _ in range(STOP_PASSES):
        fresh = [p for p in bed.cgroup(dev).pids() if p not in stopped]
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
    return stopped


def cont_pids(pids: list[int]) -> None:
    """SIGCONT each of `pids` (those that still exist)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def ledger_verdict(store: Store, jid: str, rounds: int) -> str:
    """ "ok" when the job's ledger holds rounds 0..rounds-1 exactly once, else what is wrong."""
    try:
        kept = [int(e["round"]) for e in effective_rounds(store.read("ledger", jid))]
    except (ValueError, KeyError, TypeError) as exc:
        return f"bad: {exc}"
    if kept != list(range(rounds)):
        return f"bad: rounds {kept[:3]}...{kept[-3:]} ({len(kept)} of {rounds})"
    return "ok"


def timeouts_in_force(store: Store, jid: str, heartbeat_s: float) -> tuple[float, float, str]:
    """(heartbeat deadline, probe timeout, a line saying where they came from) for job `jid`.

    The coordinator's record of the timeouts it derived when it wrote one, else
    the settings' upper bounds (heartbeat_s x heartbeat_misses, probe_timeout_s).
    """
    try:
        from common.records.detection import read_effective

        rec = read_effective(store, jid)
    except (ImportError, Exception):  # an older coordinator writes no such record
        rec = None
    if rec is not None:
        why = "; ".join(f"{k} {v}" for k, v in sorted(rec.why.items()))
        text = (
            f"derived: heartbeat deadline {rec.heartbeat_deadline_s:.2f} s, probe "
            f"{rec.probe_timeout_s:.2f} s, flap grace {rec.flap_grace_s:.2f} s, peer "
            f"{rec.peer_timeout_s:.2f} s ({why})"
        )
        return rec.heartbeat_deadline_s, rec.probe_timeout_s, text
    fields = CoordinatorSettings.model_fields
    misses = int(fields["heartbeat_misses"].default)
    probe = float(fields["probe_timeout_s"].default)
    deadline = heartbeat_s * misses
    text = f"settings: heartbeat deadline {heartbeat_s:g} s x {misses} = {deadline:g} s"
    text += f", probe {probe:g} s"
    return deadline, probe, text


IGNORED_WORDS = ("ignored", "dropped", "stale", "refused")
"""Words of the coordinator's log events that say it set a message aside."""


def ignored_from(log: Path, dev: str, since: float, until: float) -> dict[str, int]:
    """The coordinator's log events between `since` and `until` that set aside something
    of device `dev` (an old probe answer, a stale reply, a report of an old epoch), counted."""
    found: dict[str, int] = {}
    if not log.exists():
        return found
    for raw in log.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
            stamp = datetime.datetime.fromisoformat(str(line.get("timestamp", ""))).timestamp()
        except (ValueError, AttributeError):
            continue
        event = str(line.get("event", ""))
        if not since <= stamp <= until or not any(w in event for w in IGNORED_WORDS):
            continue
        if dev in (str(line.get(k, "")) for k in ("device", "peer", "worker", "about")):
            found[event] = found.get(event, 0) + 1
    return found


WORKER_PARTS = ("send_s", "wait_s", "build_s", "read_s", "load_s")
"""Where a worker's recovery time goes: sending layers, waiting for its own, building
the model, reading the state, loading it into the model and optimizer."""


def worker_side(logs: Path, run: Run) -> None:
    """The slowest survivor's own seconds for its recovery assignment, from the worker logs.

    Each worker logs "stage assigned" with its timings; the first such line of
    the job after the fault is the recovery's. The lost device's log is left
    out: a stopped device let go may be assigned again later.
    """
    if run.t_kill is None:
        return
    slowest: tuple[float, str, dict[str, Any]] | None = None
    for path in sorted(logs.glob("*.worker.log")):
        dev = path.name.split(".")[0]
        if dev == run.device:
            continue
        line = _first_assignment(path, run.job_id, run.t_kill)
        if line is not None and (slowest is None or line["total_s"] > slowest[0]):
            slowest = (float(line["total_s"]), dev, line)
    if slowest is None:
        return
    run.worker_s, dev, line = slowest
    parts = " ".join(f"{k[:-2]} {float(line.get(k, 0.0)):.3f}" for k in WORKER_PARTS)
    run.worker_parts = f"{dev}: {parts}"


def _first_assignment(path: Path, job: str, after: float) -> dict[str, Any] | None:
    """The first "stage assigned" line of `job` in a worker log written after `after`."""
    for raw in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict) or line.get("event") != "stage assigned":
            continue
        if line.get("job") != job or "total_s" not in line:
            continue
        stamp = datetime.datetime.fromisoformat(str(line.get("timestamp", ""))).timestamp()
        if stamp >= after:
            return line
    return None
