"""Following a job as a person sees it: the wait for workers, an ETA, lines without source paths.

`follow` reads the job's hash, metrics and events; here those reads are
scripted poll by poll (no Redis, no sleeping), and what the console printed
is read back. `status`'s jobs table and the example job's fit to the cluster
it is started on are checked too.
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from rich.console import Console

from common.job import load_job
from common.logging import configure_logging, get_logger
from common.records.events import EventEntry
from common.records.jobs import JobRecord, Waiting, write_job
from common.records.metrics import MetricsEntry
from common.store import Store
from services.cli import follow as follow_mod
from services.cli.console import CliConsole
from services.cli.example_files import DEMO_JOB, example_path
from services.cli.follow import follow, load_checked, progress_bar
from services.cli.jobs import jobs_table

WAIT = Waiting.of(["dev-0", "dev-1", "dev-2"], 4).model_dump()


@dataclass
class Poll:
    """What one of `follow`'s polls reads: the job's hash, new metrics, new events."""

    job: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def _scripted(monkeypatch: pytest.MonkeyPatch, polls: list[Poll]) -> None:
    """`follow`'s reads answer `polls` in turn (the last one repeats)."""
    it: Iterator[Poll] = iter(polls)
    now: list[Poll] = []

    def read_job(_: object, __: str) -> JobRecord:
        now[:] = [next(it, polls[-1])]
        return JobRecord.model_validate(now[0].job)

    def metrics(_: object, __: str, after: str) -> tuple[list[MetricsEntry], str]:
        return [MetricsEntry.model_validate(m) for m in now[0].metrics], after

    def events(_: object, __: str, after: str) -> tuple[list[EventEntry], str]:
        return [EventEntry.model_validate(e) for e in now[0].events], after

    monkeypatch.setattr(follow_mod, "read_job", read_job)
    monkeypatch.setattr(follow_mod, "read_metrics_after", metrics)
    monkeypatch.setattr(follow_mod, "read_events_after", events)


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return CliConsole(file=out, width=160, force_terminal=False), out


def _round(n: int) -> dict[str, Any]:
    return {"round": n, "loss": 2.0 - n / 10, "samples_per_s": 100.0, "round_s": 0.5}


def test_a_wait_for_workers_shows_as_a_line_and_its_timeout_says_who_was_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = "min_workers: 4 workers wanted, 3 joined and vetted within 60 s"
    _scripted(
        monkeypatch,
        [
            Poll({"state": "submitted", "waiting": Waiting.of([], 4).model_dump()}),
            Poll({"state": "submitted", "waiting": WAIT}),
            Poll({"state": "submitted", "waiting": WAIT}),  # unchanged: no second line
            Poll({"state": "failed", "waiting": None, "error": error}),
        ],
    )
    console, out = _console()
    view = follow(Store.__new__(Store), "demo", console, poll_s=0.0)
    assert view.state == "failed" and view.error == error
    lines = out.getvalue().splitlines()
    waits = [line for line in lines if "waiting for workers" in line]
    assert [w.split(" ", 1)[1] for w in waits] == [
        "demo: waiting for workers 0/4",
        "demo: waiting for workers 3/4 (dev-0, dev-1, dev-2)",
    ]


def test_stage_lines_carry_the_time_and_no_source_location(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _scripted(
        monkeypatch,
        [
            Poll({"state": "submitted"}),
            Poll(
                {"state": "profiling", "workers": ["a", "b"]},
                events=[{"event": "profiling", "workers": ["a", "b"]}],
            ),
            Poll(
                {"state": "running", "round": 0, "total_rounds": 4},
                events=[
                    {"event": "planning", "planner": "asteroid"},
                    {"event": "running", "total_rounds": 4},
                ],
            ),
            Poll({"state": "finished", "round": 4, "total_rounds": 4}, [_round(3)]),
        ],
    )
    console, out = _console()
    view = follow(Store.__new__(Store), "demo", console, poll_s=0.0)
    assert view.state == "finished" and len(view.rounds) == 1
    text = out.getvalue()
    stages = [line for line in text.splitlines() if "demo: " in line]
    assert [s.split(" ", 1)[1] for s in stages] == [
        "demo: profiling on a, b",
        "demo: planning with asteroid",
        "demo: running (4 rounds)",
    ]
    assert ".py:" not in text  # rich's console.log ended each line in follow.py:NN


def test_the_bar_shows_the_time_remaining_from_the_rounds_pace() -> None:
    clock = [0.0]
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=False)
    bar = progress_bar(console, get_time=lambda: clock[0])
    task = bar.add_task("running", total=80, job="demo")
    for done in range(1, 21):  # 20 rounds in 40 s: 60 left at 2 s each
        clock[0] = 2.0 * done
        bar.update(task, completed=done)
    console.print(bar.make_tasks_table(bar.tasks))
    row = out.getvalue()
    assert "20/80" in row and "eta 0:02:00" in row, row


def test_status_lists_a_waiting_job_with_its_wait(store: Store) -> None:
    write_job(store, "demo", state="submitted", round=0, total_rounds=80, waiting=WAIT)
    out = io.StringIO()
    CliConsole(file=out, width=200).print(jobs_table(store, "demo"))
    assert "waiting for workers 3/4 (dev-0, dev-1, dev-2)" in out.getvalue()


def test_the_example_job_fits_the_cluster_it_is_started_on() -> None:
    with example_path(DEMO_JOB) as path:
        assert load_job(path).min_workers is None  # `asteroid up --workers 3`: runs on 3
        # the demo starts its workers with the job: it waits for all of them
        assert load_checked(path, 3).min_workers == 3
        assert load_checked(path, 5).min_workers == 5


def test_a_service_line_for_a_person_names_no_source_location(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # configure_logging installs masking exception hooks; put the originals back afterwards
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    configure_logging("info", "console", job="demo")
    get_logger("follow-test").info("job state", state="running")
    structlog.reset_defaults()
    line = capsys.readouterr().err.strip()
    assert "job state" in line and "state=running" in line and "job=demo" in line, line
    assert ".py" not in line and "follow-test" not in line, line
