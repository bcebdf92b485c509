"""The recovery bench without a testbed: its outputs from a saved run, its measurement
from a job's streams in a real Redis, its ledger check and its SIGSTOP of real processes."""

import csv
import datetime
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from common.ledger import rollback_entry, round_entry
from common.store import Store
from tests.bench.bench_recovery import main
from tests.bench.recovery_faults import cont_pids, ignored_from, ledger_verdict, stop_device
from tests.bench.recovery_jobs import measure
from tests.bench.recovery_report import Run


def made_up(device: str, mode: str, fault: str, **kw: Any) -> dict[str, Any]:
    series = [(float(n), 50.0) for n in range(10)]
    return asdict(
        Run(device, mode, f"rec-{device}-{mode}", "finished", fault=fault, series=series, **kw)
    )


def test_replot_writes_the_parts_table_csv_and_plot(tmp_path: Path) -> None:
    """Kill and SIGSTOP rows with their parts; the silent loss is judged against its bound."""
    parts: dict[str, Any] = {
        "replan_s": 0.01,
        "migrate_s": 0.05,
        "gap_s": 0.0,
        "after": 50.0,
        "ledger": "ok",
    }
    runs = [
        made_up("nano-0", "lightweight", "kill", t_kill=3.0, detect_s=0.3, first_round_s=0.7,
                first_commit_s=1.06, signal="connection closed", **parts),
        made_up("nano-0", "heavy", "kill", t_kill=3.0, detect_s=0.3, first_round_s=0.7,
                first_commit_s=2.0, signal="connection closed", **parts),
        made_up("nano-0", "lightweight", "sigstop", t_kill=3.0, detect_s=4.0, first_round_s=0.7,
                first_commit_s=4.76, round_s=0.6, bound_s=5.6, signal="heartbeats + probe",
                t_cont=9.0, after_cont="let go 6.0 s after the stop: heartbeats again", **parts),
        made_up("nano-0", "fresh", "", after=52.0),
    ]  # fmt: skip
    saved = {"model": "small_cnn", "command": "made up", "load": [1.5, 2.5], "runs": runs}
    (tmp_path / "recovery.json").write_text(json.dumps(saved))
    assert main(["--out", str(tmp_path), "--replot"]) == 0
    md = (tmp_path / "recovery.md").read_text()
    assert "load average 1.5 at the start, 2.5 at the end" in md
    assert "| nano-0 | sigstop | lightweight | finished | heartbeats + probe | 4.00 |" in md
    assert "kill, lightweight (1 runs; declared by connection closed): median detect 0.30" in md
    assert "within heartbeat deadline + probe + one round (5.60 s median) in 1 of 1" in md
    assert "let go 6.0 s after the stop" in md
    with (tmp_path / "recovery.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["fault"], r["mode"]) for r in rows] == [
        ("kill", "lightweight"),
        ("kill", "heavy"),
        ("sigstop", "lightweight"),
        ("", "fresh"),
    ]
    assert rows[2]["first_round_s"] == "0.7" and rows[0]["signal"] == "connection closed"
    assert (tmp_path / "recovery.png").stat().st_size > 0


def test_replot_reads_a_run_saved_before_faults_were_recorded_as_kills(tmp_path: Path) -> None:
    old = made_up("nano-1", "lightweight", "", t_kill=3.0, detect_s=4.8, first_commit_s=5.6)
    del old["fault"], old["signal"], old["gap_s"], old["first_round_s"]
    saved = {"model": "small_cnn", "command": "old", "runs": [old]}
    (tmp_path / "recovery.json").write_text(json.dumps(saved))
    assert main(["--out", str(tmp_path), "--replot"]) == 0
    assert "| nano-1 | kill | lightweight | finished |" in (tmp_path / "recovery.md").read_text()


def _at(store: Store, stream: str, jid: str, ms: int, fields: dict[str, object]) -> None:
    """An entry written at wall time `ms` (milliseconds): stream ids are the times measured."""
    store.r.xadd(
        store.key(stream, jid), {k: json.dumps(v) for k, v in fields.items()}, id=f"{ms}-0"
    )


def test_measure_splits_the_wait_from_the_streams_of_a_job(store: Store) -> None:
    jid = "rec-nano-0-sigstop-lightweight"
    t0 = 1_800_000_000_000  # ms
    _at(store, "events", jid, t0, {"event": "running"})
    for n in range(1, 4):
        _at(store, "metrics", jid, t0 + 1000 * n, {"samples_per_s": 40.0, "round_s": 0.8})
    reason = "workers ['nano-0'] missed heartbeats for 3.0 s and did not answer a probe within 2 s"
    _at(store, "events", jid, t0 + 8200, {"event": "recovering", "reason": reason})
    recovered = {
        "event": "recovered", "seconds": 0.1, "replayed": 1, "failed_round": 3,
        "source": "replicas", "replan_s": 0.02, "migrate_s": 0.07, "moved_layers": 2,
        "moved_bytes": 2048, "stages": [[0, 2, ["nano-1"]], [2, 7, ["tx2-0"]]],
    }  # fmt: skip
    _at(store, "events", jid, t0 + 8300, recovered)
    _at(store, "metrics", jid, t0 + 9200, {"samples_per_s": 30.0, "round_s": 0.9})
    run = Run("nano-0", "lightweight", jid, "finished", fault="sigstop", t_kill=(t0 + 4000) / 1e3)
    measure(store, run, 2, heartbeat_s=0.5)
    assert run.signal == "heartbeats + probe"
    assert run.detect_s == pytest.approx(4.2, abs=1e-5)
    assert run.gap_s == pytest.approx(0.01, abs=1e-5)
    assert run.first_round_s == pytest.approx(0.9, abs=1e-5)
    assert run.first_commit_s == pytest.approx(5.2, abs=1e-5)
    assert run.round_s == pytest.approx(0.8)
    assert run.bound_s is not None and run.bound_s > 0.8  # a deadline and a probe
    assert run.before == 40.0 and run.after == 30.0
    assert run.stages_after == "0-2:nano-1 / 2-7:tx2-0"
    assert run.series[0] == (1.0, 40.0)  # from the job's `running`


def test_the_ledger_verdict_refuses_a_round_applied_twice(store: Store) -> None:
    for n in (0, 1, 2):
        store.append("ledger", "ok", round_entry(n, 1, 0, 8, []))
    store.append("ledger", "ok", rollback_entry(2, ["nano-0"]))
    store.append("ledger", "ok", round_entry(2, 2, 0, 8, []))
    assert ledger_verdict(store, "ok", 3) == "ok"
    for n in (0, 1, 1):
        store.append("ledger", "twice", round_entry(n, 1, 0, 8, []))
    assert ledger_verdict(store, "twice", 2).startswith("bad: ledger: round 1")
    assert ledger_verdict(store, "ok", 4).startswith("bad: rounds")


class _Group:
    def __init__(self, pids: list[int]) -> None:
        self._pids = pids

    def pids(self) -> list[int]:
        return self._pids


class _Bed:
    """The one part of a testbed that stop_device uses: the device's processes."""

    def __init__(self, pids: list[int]) -> None:
        self.group = _Group(pids)

    def cgroup(self, dev: str) -> _Group:
        return self.group


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _wait_state(pid: int, want: set[str]) -> str:
    deadline = time.monotonic() + 10
    while (got := _state(pid)) not in want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_a_stopped_device_is_every_process_of_it_stopped_until_let_go() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in "ab"]
    try:
        stopped = stop_device(_Bed([p.pid for p in procs]), "nano-0")  # type: ignore[arg-type]
        assert sorted(stopped) == sorted(p.pid for p in procs)
        assert {_wait_state(p.pid, {"T"}) for p in procs} == {"T"}
        cont_pids(stopped)
        assert {_wait_state(p.pid, {"S", "R"}) for p in procs} <= {"S", "R"}
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_what_the_coordinator_set_aside_of_a_device_let_go_is_counted(tmp_path: Path) -> None:
    """Its log's events that ignore or drop a message of the device, within the window."""

    def line(at: float, event: str, **kw: str) -> str:
        stamp = datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat()
        return json.dumps({"timestamp": stamp, "event": event, "level": "info", **kw})

    log = tmp_path / "coordinator.log"
    log.write_text(
        "\n".join(
            [
                line(99.0, "ignored a probe answer nobody waits for", device="nano-0"),
                line(101.0, "ignored a probe answer nobody waits for", device="nano-0"),
                line(101.5, "dropped a peer report", peer="nano-0", about="nano-1"),
                line(102.0, "dropped a peer report", peer="nano-2", about="nano-1"),
                line(102.5, "round committed", device="nano-0"),
                "not json",
                line(120.0, "ignored a probe answer nobody waits for", device="nano-0"),
            ]
        )
    )
    assert ignored_from(log, "nano-0", 100.0, 110.0) == {
        "ignored a probe answer nobody waits for": 1,
        "dropped a peer report": 1,
    }
    assert ignored_from(tmp_path / "absent.log", "nano-0", 0.0, 1e12) == {}
