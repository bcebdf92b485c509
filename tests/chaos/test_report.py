"""The chaos report: every event in the table with its recovery time, the plot, the invariants."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.chaos.invariants import Check
from tests.chaos.report import committed_rate, write
from tests.chaos.runner import EventRecord, RunResult
from tests.chaos.sampler import Sample
from tests.chaos.schedule import Event, Schedule


def _result() -> RunResult:
    kill = Event(0, "kill", 5, 2)
    hang = Event(1, "stop_cont", 9, 1, hold_s=1.5)
    schedule = Schedule(42, (kill, hang), initial_devices=4, need=2)
    records = [
        EventRecord(
            kill,
            ["b"],
            injected=110.0,
            injection_done=110.0,
            detected=110.2,
            recovered=110.9,
            first_commit=114.0,
            recovery={"kind": "recovery", "source": "replicas", "replayed": 1, "replan_s": 0.01},
        ),
        EventRecord(hang, ["c"], injected=120.0, injection_done=121.5, note="not back in time"),
    ]
    commits = [(100.0 + i, {"round": i, "samples_per_s": 30.0}) for i in range(10)]
    commits += [(114.0 + i, {"round": 10 + i, "samples_per_s": 32.0}) for i in range(5)]
    samples = [Sample(100.0 + i, "a", 1, 1000, 10, 5) for i in range(3)]
    job = {"job_id": "chaos", "rounds": 15, "global_batch": 32, "optimizer": {"kind": "adam"}}
    return RunResult(schedule, job, records, samples, commits, [], 0, 100.0, 130.0, 101.0)


def test_the_report_has_every_event_its_times_the_invariants_and_a_plot(tmp_path: Path) -> None:
    checks = [Check("job finished", True, "exit 0"), Check("ledger", False, "epoch 0: twice [4]")]
    path = write(_result(), checks, tmp_path, "loopback")
    text = path.read_text()
    assert "seed 42 (loopback)" in text
    assert "| 0 | kill | b |  | 0.20 | 0.90 | 4.00 | replicas | 1 | 0.01 |" in text
    assert "| 1 | stop_cont | c | 1.5 |" in text and "not back in time" in text
    assert "- [x] job finished: exit 0" in text and "- [ ] ledger: epoch 0: twice [4]" in text
    with (tmp_path / "events.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["event"], r["recovery_s"]) for r in rows] == [("0", "4.00"), ("1", "")]
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    assert len((tmp_path / "samples.csv").read_text().splitlines()) == 4


def test_committed_throughput_is_zero_while_nothing_commits() -> None:
    xs, ys = committed_rate(_result(), bin_s=2.0)
    assert xs[:3] == [0.0, 2.0, 4.0]
    assert ys[0] == 32.0  # two commits of 32 samples in 2 s
    assert ys[5] == ys[6] == 0.0  # 110 s to 114 s: nothing committed
    assert ys[7] == 32.0
    assert sum(ys) * 2.0 == 15 * 32
