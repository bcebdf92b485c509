"""CSV tables and TensorBoard event files of metrics: grown, resumed, rewritten, read back."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.metrics_export import row, scalars
from common.metrics_files import EVENTS_GLOB, CsvLog, EventLog, csv_path, events_dir, resume

Points = dict[tuple[str, int], list[tuple[float, float]]]


def read_events(directory: Path) -> Points:
    """The points TensorBoard shows from `directory`: (tag, step) -> [(value, wall time)].

    TensorBoard's own reader: every point kept (none sampled away), restart
    marks applied; a point written twice shows twice.
    """
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    out: Points = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            out.setdefault((tag, ev.step), []).append((ev.value, ev.wall_time))
    return out


def expected_points(records: list[dict[str, Any]]) -> Points:
    out: Points = {}
    for record in records:
        for s in scalars(record):
            # a TensorBoard scalar is a float32
            out.setdefault((s.tag, s.step), []).append((float(np.float32(s.value)), s.wall_time))
    return out


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]


def records(rounds: int, t0: float = 1_700_000_000.0) -> list[dict[str, Any]]:
    """A job's records: a baseline evaluation, rounds, a device joining at round 2, evaluations."""
    out: list[dict[str, Any]] = [
        {"round": -1, "eval_loss": 2.3, "eval_accuracy": 0.1, "eval_samples": 64, "time": t0}
    ]
    for r in range(rounds):
        devices = ["a", "b", "c"] if r >= 2 else ["a", "b"]
        out.append(
            {
                "round": r,
                "epoch": 1,
                "loss": 2.3 - 0.1 * r,
                "accuracy": (0.1 + 0.2) * r / 3,
                "round_s": 0.25 + r / 7,
                "samples_per_s": 128 / (0.25 + r / 7),
                "time": t0 + r + 0.5,
                "devices": {
                    d: {"stage": i, "peak_bytes": 10**9 + 7 * r, "forward_s": r / 3 + i}
                    for i, d in enumerate(devices)
                },
            }
        )
        if r % 2:
            out.append(
                {
                    "round": r,
                    "eval_loss": 2.0 / (r + 1),
                    "eval_accuracy": r / 9,
                    "eval_samples": 64,
                    "time": t0 + r + 0.75,
                }
            )
    return out


def same_rows(path: Path, want: list[Mapping[str, Any]]) -> None:
    assert read_rows(path) == [row(r) for r in want]


def test_a_table_grown_a_record_at_a_time_equals_one_written_at_once(tmp_path):
    recs = records(5)
    grown = CsvLog.load(tmp_path / "grown.csv")
    for record in recs:  # the eval columns and device c each widen the header
        grown.append([record])
    CsvLog.create(tmp_path / "once.csv", recs)
    assert (tmp_path / "grown.csv").read_bytes() == (tmp_path / "once.csv").read_bytes()
    same_rows(tmp_path / "grown.csv", recs)
    assert not list(tmp_path.glob("*.tmp"))


def test_cells_read_back_to_the_values_exactly(tmp_path):
    recs = records(3)
    CsvLog.create(tmp_path / "t.csv", recs)
    rows = read_rows(tmp_path / "t.csv")
    assert [float(r["loss"]) for r in rows if "loss" in r] == [
        r["loss"] for r in recs if "loss" in r
    ]
    assert float(rows[1]["devices/b/forward_s"]) == recs[1]["devices"]["b"]["forward_s"]


def test_event_files_hold_every_numeric_field_at_its_round_and_time(tmp_path):
    recs = records(4)
    _, log = resume(tmp_path, "j", recs)
    assert log is not None
    log.close()
    got = read_events(events_dir(tmp_path, "j"))
    assert got == expected_points(recs)
    assert got[("accuracy", 3)] == [(pytest.approx(0.3, rel=1e-7), recs[-2]["time"])]
    assert got[("eval_accuracy", -1)] == [(pytest.approx(0.1, rel=1e-7), recs[0]["time"])]


def test_a_restarted_writer_appends_what_is_missing_and_repeats_nothing(tmp_path):
    recs = records(6)
    _, first = resume(tmp_path, "j", recs[:4])
    assert first is not None
    first.close()
    table, again = resume(tmp_path, "j", recs[:-1])  # a new coordinator: Redis has more
    assert again is not None
    again.add(recs[-1:])  # and it goes on
    table.append(recs[-1:])
    again.close()
    same_rows(csv_path(tmp_path, "j"), recs)
    assert read_events(events_dir(tmp_path, "j")) == expected_points(recs)
    assert len(list(events_dir(tmp_path, "j").glob(EVENTS_GLOB))) == 2


def test_files_of_another_run_are_written_again_from_the_records(tmp_path):
    _, old = resume(tmp_path, "j", records(5, t0=1_600_000_000.0))
    assert old is not None
    old.close()
    recs = records(3)  # the job was replaced: same id, other records
    _, log = resume(tmp_path, "j", recs)
    assert log is not None
    log.close()
    same_rows(csv_path(tmp_path, "j"), recs)
    assert read_events(events_dir(tmp_path, "j")) == expected_points(recs)
    assert len(list(events_dir(tmp_path, "j").glob(EVENTS_GLOB))) == 1


def test_a_row_cut_short_by_a_crash_is_written_again(tmp_path):
    recs = records(4)
    CsvLog.create(csv_path(tmp_path, "j"), recs)
    path = csv_path(tmp_path, "j")
    data = path.read_bytes()
    cut = data.rindex(b"\r\n", 0, len(data) - 2) + 2 + 10
    path.write_bytes(data[:cut])  # the writer died 10 bytes into the last row
    assert len(CsvLog.load(path).rows) == len(recs) - 1
    table, log = resume(tmp_path, "j", recs, events=False)
    assert log is None
    same_rows(path, recs)
    assert len(table.rows) == len(recs)
    path.write_bytes(data[:cut])
    table = CsvLog.load(path)
    table.append(recs[-1:])  # appending rewrites the file rather than finish the cut line
    same_rows(path, recs)


@pytest.mark.parametrize("done", [2, 3], ids=["a-round-in-doubt", "an-eval-in-doubt"])
def test_a_point_written_before_its_row_shows_once_after_a_restart(tmp_path, done):
    """The writer died after an event file had a record's points and before its table row."""
    recs = records(4)  # [eval -1, round 0, round 1, eval 1, round 2, ...]
    _, log = resume(tmp_path, "j", recs[:done])
    assert log is not None
    log.add(recs[done : done + 1])  # its points, but no row
    log.close()
    _, log = resume(tmp_path, "j", recs)
    assert log is not None
    log.close()
    # the eval in doubt shares round 1 with a row already written: that round is written again
    assert read_events(events_dir(tmp_path, "j")) == expected_points(recs)
    same_rows(csv_path(tmp_path, "j"), recs)
    assert len(list(events_dir(tmp_path, "j").glob(EVENTS_GLOB))) == 2


def test_without_the_restart_mark_the_point_would_show_twice(tmp_path):
    """What the mark is for: the same files, the second one opened without it."""
    recs = records(2)
    _, log = resume(tmp_path, "j", recs[:2])
    assert log is not None
    log.add(recs[2:3])
    log.close()
    again = EventLog(events_dir(tmp_path, "j"), start=100)  # a mark that hides nothing
    again.add(recs[2:])
    again.close()
    twice = 2 * expected_points(recs)[("loss", 1)]
    assert read_events(events_dir(tmp_path, "j"))[("loss", 1)] == twice
