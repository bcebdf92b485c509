"""The timeouts in force, recorded per job in a real Redis and shown by `asteroid status`.

The record is checked both ways: a writer cannot store a value out of bounds,
and a reader refuses (naming the job) or trims what no coordinator wrote, so
a hostile or corrupt document never makes `status` print a wall of text or
crash the command.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from common.errors import StoreError
from common.ids import DeviceId
from common.local_cluster import default_state_dir
from common.records.detection import MAX_WHY_CHARS, TimeoutsRecord, put_effective, read_effective
from common.records.jobs import forget_job, write_job
from common.settings import CoordinatorSettings
from common.store import Store
from services.cli import app, jobs
from services.cli.detection import detection_line
from services.coordinator.timeouts import (
    Bounds,
    Effective,
    Observed,
    derive,
    observe_beat,
    observe_round,
    observe_rtt,
)

JOB = "job-t"


def measured() -> Effective:
    """The timeouts of a cluster with 40 heartbeats, 10 probes and 10 rounds measured."""
    obs, dev = Observed(), DeviceId("dev-0")
    for i in range(40):
        obs = observe_beat(obs, dev, i * 0.5 + (0.05 if i % 9 == 0 else 0.0))
    for _ in range(10):
        obs = observe_rtt(obs, dev, 0.002)
        obs = observe_round(obs, 0.8)
    return derive(Bounds.of(CoordinatorSettings()), obs)


def test_a_record_round_trips(store: Store) -> None:
    eff = measured()
    put_effective(store, JOB, eff, now=123.0)
    rec = read_effective(store, JOB)
    assert rec is not None and rec.updated == 123.0
    assert rec.heartbeat_deadline_s == eff.heartbeat_deadline_s
    assert rec.peer_timeout_s == eff.peer_timeout_s == pytest.approx(2.4)
    assert rec.why == dict(eff.why)
    assert read_effective(store, "other-job") is None


def test_forgetting_a_job_forgets_its_timeouts(store: Store) -> None:
    put_effective(store, JOB, measured())
    forget_job(store, JOB)
    assert read_effective(store, JOB) is None


def test_a_writer_cannot_store_a_timeout_out_of_bounds(store: Store) -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e7):
        eff = Effective(bad, 1.0, 1.0, 1.0)
        with pytest.raises(ValidationError):
            put_effective(store, JOB, eff)
    assert read_effective(store, JOB) is None


@pytest.mark.parametrize(
    "doc",
    [
        "not json {",
        json.dumps([1, 2]),
        json.dumps({"heartbeat_deadline_s": "soon"}),
        json.dumps(
            {
                "heartbeat_deadline_s": 1e300,
                "probe_timeout_s": 1,
                "flap_grace_s": 1,
                "peer_timeout_s": 1,
            }
        ),
        json.dumps(
            {
                "heartbeat_deadline_s": -1,
                "probe_timeout_s": 1,
                "flap_grace_s": 1,
                "peer_timeout_s": 1,
            }
        ),
    ],
)
def test_a_malformed_record_is_named(store: Store, doc: str) -> None:
    store.r.set(store.key("timeouts", JOB), doc)
    with pytest.raises(StoreError, match=JOB):
        read_effective(store, JOB)


def test_hostile_content_is_trimmed_on_reading(store: Store) -> None:
    doc = {
        "heartbeat_deadline_s": 1.5,
        "probe_timeout_s": 0.2,
        "flap_grace_s": 0.3,
        "peer_timeout_s": 2.4,
        "why": {"probe_timeout_s": "x" * 100_000, "evil": "y" * 100, "flap_grace_s": 7},
        "updated": None,
        "padding": "z" * 100_000,
    }
    store.put_json(doc, "timeouts", JOB)
    rec = read_effective(store, JOB)
    assert rec is not None
    assert rec.why == {"probe_timeout_s": "x" * MAX_WHY_CHARS}
    assert "padding" not in rec.model_dump()


def test_the_line_names_each_timeout_and_why() -> None:
    rec = TimeoutsRecord(
        heartbeat_deadline_s=1.65,
        probe_timeout_s=0.2,
        flap_grace_s=0.3,
        peer_timeout_s=2.4,
        why={"heartbeat_deadline_s": "measured (3 x p99 gap 550 ms)"},
        updated=100.0,
    )
    line = detection_line("j", rec, now=104.0)
    assert line == (
        "detection of job j: heartbeat 1.65 s measured (3 x p99 gap 550 ms) · probe 200 ms"
        " · grace 300 ms · neighbour 2.4 s (derived 4 s ago)"
    )


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No ASTEROID_* variable and a private state folder: the options alone say where."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    for name in [k for k in os.environ if k.startswith("ASTEROID_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(jobs.console, "width", 400)
    return default_state_dir()


def _status(redis_url: str, cluster: str) -> str:
    res = CliRunner().invoke(app, ["status", "--redis-url", redis_url, "--cluster", cluster])
    assert res.exit_code == 0, res.output
    return res.output


def test_status_shows_the_running_jobs_timeouts(
    store: Store, redis_url: str, cluster_name: str, clean_env: Path
) -> None:
    write_job(store, JOB, state="running", round=3, total_rounds=10)
    write_job(store, "done-job", state="finished")
    store.add_ranked(JOB, time.time(), "jobs")
    store.add_ranked("done-job", time.time() - 1, "jobs")
    eff = measured()
    put_effective(store, JOB, eff)
    put_effective(store, "done-job", eff)  # no longer in force: not shown
    out = _status(redis_url, cluster_name)
    lines = [ln for ln in out.splitlines() if ln.startswith("detection of job")]
    assert len(lines) == 1, out
    line = lines[0]
    assert f"job {JOB}:" in line
    assert f"heartbeat {eff.heartbeat_deadline_s:.3g} s measured" in line, line
    assert "neighbour 2.4 s measured (3 x p90 round 800 ms)" in line, line
    assert "probe 200 ms floor (5 x p99 rtt 2 ms)" in line, line


def test_status_names_a_malformed_timeouts_record_and_goes_on(
    store: Store, redis_url: str, cluster_name: str, clean_env: Path
) -> None:
    write_job(store, JOB, state="running")
    store.add_ranked(JOB, time.time(), "jobs")
    store.r.set(store.key("timeouts", JOB), json.dumps({"heartbeat_deadline_s": "[red]x"}))
    out = _status(redis_url, cluster_name)
    assert f"detection of job {JOB}: unreadable" in out, out
    assert "jobs" in out  # the table above was shown
