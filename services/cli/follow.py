"""Following a job from Redis: a live progress bar, then its final state.

Reads the job's hash and its metrics and events streams (never the
coordinator's sockets), so any number of people can watch one job and
watching never slows it down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from common.errors import ConfigError
from common.job import JobSpec, load_job
from common.lifecycle import TERMINAL
from common.messages import SubmitJob
from common.records.events import EventEntry, read_events_after
from common.records.jobs import JobRecord, read_job
from common.records.metrics import read_metrics_after
from common.secrets import mask_text
from common.settings import CommonSettings
from common.store import Store
from services.cli.client import ask_coordinator
from services.cli.console import shown
from services.coordinator.checks import check_job

__all__ = ["JobView", "follow", "load_checked", "progress_bar", "submit_and_follow"]


@dataclass
class JobView:
    """What following a job saw."""

    state: str = "unknown"
    error: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def _describe(job: JobRecord, last: dict[str, Any] | None, ev: dict[str, Any] | None) -> str:
    if job.waiting_line:
        return job.waiting_line
    parts = [job.state]
    if last is not None:
        parts.append(f"loss {last['loss']:.3f}")
        parts.append(f"{last['samples_per_s']:.0f} samples/s")
    if ev is not None:
        parts.append(f"held-out acc {ev['eval_accuracy']:.0%}")
    return " | ".join(parts)


class EtaColumn(TimeRemainingColumn):
    """``eta 0:02:00``: the time remaining at the rounds' pace, blank until there is one."""

    def render(self, task: Task) -> Text:
        """The remaining time, labelled; nothing before a pace is known or once done."""
        left = task.time_remaining
        if left is None or task.finished:
            return Text("")
        return Text(f"eta {timedelta(seconds=int(left))}", style="progress.remaining")


def progress_bar(console: Console, get_time: Callable[[], float] | None = None) -> Progress:
    """The bar `follow` shows: rounds done of the total, time taken and time remaining.

    The remaining time is rich's estimate from the pace of the rounds of the
    last five minutes (rich's default of 30 s would hold no round of a slow job).
    """
    return Progress(
        TextColumn("[cyan]{task.fields[job]}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        EtaColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
        speed_estimate_period=300.0,
        get_time=get_time,
    )


def _say(console: Console, text: str) -> None:
    """A line above the bar, with the time: the stages a job goes through.

    Printed, not `console.log`-ged: rich's log ends every line in the source
    location it was called from, which is no use to a person following a job.
    """
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {shown(text)}", highlight=False)


def follow(
    store: Store,
    job_id: str,
    console: Console,
    timeout_s: float = 24 * 3600.0,
    poll_s: float = 0.25,
) -> JobView:
    """Show the job's progress until it ends (or `timeout_s`); returns what was seen.

    A wait for workers shows live in the bar and as a line each time it
    changes; so do the job's stages (profiling, planning, running).
    """
    view = JobView()
    after_m, after_e = "0", "0"
    waited, started = "", False
    deadline = time.monotonic() + timeout_s
    with progress_bar(console) as bar:
        task = bar.add_task("submitted", total=None, job=shown(job_id))
        while True:
            job = read_job(store, job_id) or JobRecord()
            new, after_m = read_metrics_after(store, job_id, after_m)
            events, after_e = read_events_after(store, job_id, after_e)
            view.events += [e.fields() for e in events]
            if job.waiting_line and job.waiting_line != waited:
                _say(console, f"{job_id}: {job.waiting_line}")
            waited = job.waiting_line
            for e in events:
                if e.event in ("profiling", "planning", "running"):
                    _say(console, f"{job_id}: {e.event}" + _detail(e))
            view.rounds += [m.fields() for m in new if m.loss is not None]
            view.evals += [m.fields() for m in new if m.eval_accuracy is not None]
            if not started and job.state == "running":
                # a resumed job starts at its checkpoint: the rounds before it are no pace
                bar.reset(task, completed=job.round or 0, total=job.total_rounds)
                started = True
            bar.update(
                task,
                total=job.total_rounds,
                completed=job.round or 0,
                description=shown(
                    _describe(
                        job,
                        view.rounds[-1] if view.rounds else None,
                        view.evals[-1] if view.evals else None,
                    )
                ),
            )
            view.state = job.state
            if view.state in TERMINAL or time.monotonic() > deadline:
                # a worker's error may quote what it was sent (a URL); shown, it is masked
                view.error = mask_text(job.note)
                return view
            time.sleep(poll_s)


def _detail(event: EventEntry) -> str:
    if event.event == "profiling":
        return f" on {', '.join(event.workers or [])}"
    if event.event == "planning":
        return f" with {event.planner or '?'}"
    return f" ({'?' if event.total_rounds is None else event.total_rounds} rounds)"


def load_checked(path: Path, workers: int) -> JobSpec:
    """The job at `path`, checked as the coordinator will, for a cluster of `workers`.

    The cluster is started along with the job, its workers joining one by one:
    a job without `min_workers` waits for all `workers`, rather than settling
    on the first to join.
    """
    job = load_job(path)
    check_job(job, CommonSettings().model_modules)
    if job.min_workers is None:
        return job.model_copy(update={"min_workers": workers})
    if job.min_workers > workers:
        raise ConfigError(f"min_workers: the job wants {job.min_workers}, there are {workers}")
    return job


def submit_and_follow(
    coordinator: str,
    redis_url: str,
    cluster: str,
    job: JobSpec,
    console: Console,
    replace: bool = False,
) -> JobView:
    """Submit `job` (the coordinator may still be starting) and follow it to its end.

    With `replace`, an earlier run of the same job id (the state directory keeps
    it) is deleted first, as `asteroid train --replace` does.
    """
    reply = ask_coordinator(coordinator, SubmitJob(job=job, replace=replace), timeout_s=60)
    if not reply.ok:
        raise ConfigError(reply.error)
    store = Store(redis_url, cluster)
    try:
        return follow(store, job.job_id, console)
    finally:
        store.close()
