"""The coordinator's metrics files: in step with Redis, and no file trouble ever reaches a job."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from common.metrics_files import EVENTS_GLOB, CsvLog, csv_path, events_dir
from services.coordinator.metrics_stream import MetricsStream
from tests.common.test_metrics_files import expected_points, read_events, records, same_rows


class Redis:
    """The job's metrics stream as the stream reads it: what was committed so far."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.away = False

    def commit(self, stream: MetricsStream, record: dict[str, Any]) -> None:
        self.records.append(record)
        stream.record(record)

    def read(self) -> list[dict[str, Any]]:
        if self.away:
            raise redis.ConnectionError("Connection refused")
        return list(self.records)


def warnings(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs if e["log_level"] == "warning"]


def test_records_streamed_one_by_one_give_the_files_an_export_writes(tmp_path):
    recs, db = records(5), Redis()
    stream = MetricsStream(tmp_path / "m", "j", db.read)
    for record in recs:
        db.commit(stream, record)
    stream.close()
    CsvLog.create(tmp_path / "export.csv", recs)
    assert csv_path(tmp_path / "m", "j").read_bytes() == (tmp_path / "export.csv").read_bytes()
    assert read_events(events_dir(tmp_path / "m", "j")) == expected_points(recs)


def test_a_restarted_coordinator_appends_the_rounds_its_predecessor_did_not_write(tmp_path):
    recs, db = records(6), Redis()
    first = MetricsStream(tmp_path, "j", db.read)
    for record in recs[:4]:
        db.commit(first, record)
    db.records += recs[4:6]  # committed in Redis; the coordinator died before its files
    # (no close: a killed coordinator does not close anything; each round was flushed)
    second = MetricsStream(tmp_path, "j", db.read)
    for record in recs[6:]:
        db.commit(second, record)
    second.close()
    first.close()
    same_rows(csv_path(tmp_path, "j"), recs)
    assert read_events(events_dir(tmp_path, "j")) == expected_points(recs)


def test_an_unwritable_directory_is_logged_once_and_the_files_catch_up_later(tmp_path):
    recs, db = records(5), Redis()
    root = tmp_path / "not-a-dir"
    root.write_text("")  # a file where the directory should be
    stream = MetricsStream(root, "j", db.read)
    with capture_logs() as logs:
        for record in recs[:3]:
            db.commit(stream, record)  # never raises
        assert warnings(logs) == [
            "cannot write the metrics files; the job goes on, its metrics stay in Redis"
        ]
        root.unlink()
        for record in recs[3:]:
            db.commit(stream, record)
    stream.close()
    assert "metrics files written again" in [e["event"] for e in logs]
    same_rows(csv_path(root, "j"), recs)
    assert read_events(events_dir(root, "j")) == expected_points(recs)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_loses_and_repeats_no_point(tmp_path):
    recs, db = records(5), Redis()
    stream = MetricsStream(tmp_path, "j", db.read)
    for record in recs[:2]:
        db.commit(stream, record)
    table = csv_path(tmp_path, "j")
    saved = table.read_bytes()
    table.unlink()
    table.symlink_to("/dev/full")  # every write: ENOSPC
    with capture_logs() as logs:
        db.commit(stream, recs[2])  # its points reached the event file, its row did not
    assert len(warnings(logs)) == 1 and "No space left" in logs[-1]["error"], logs
    table.unlink()
    table.write_bytes(saved)
    for record in recs[3:]:
        db.commit(stream, record)
    stream.close()
    same_rows(table, recs)
    assert read_events(events_dir(tmp_path, "j")) == expected_points(recs)


def test_redis_away_while_catching_up_is_logged_and_tried_again(tmp_path):
    recs, db = records(3), Redis()
    stream = MetricsStream(tmp_path, "j", db.read)
    db.away = True
    with capture_logs() as logs:
        db.commit(stream, recs[0])
    assert "Connection refused" in logs[-1]["error"]
    db.away = False
    for record in recs[1:]:
        db.commit(stream, record)
    stream.close()
    same_rows(csv_path(tmp_path, "j"), recs)


def test_without_tensorboard_the_table_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # the plots extra is missing
    recs, db = records(3), Redis()
    stream = MetricsStream(tmp_path, "j", db.read)
    with capture_logs() as logs:
        for record in recs:
            db.commit(stream, record)
    stream.close()
    assert warnings(logs) == ["streaming metrics to CSV only"]
    (said,) = [e["error"] for e in logs if e["log_level"] == "warning"]
    assert said.endswith("needs the 'plots' extra: pip install 'asteroid-edge[plots]'")
    same_rows(csv_path(tmp_path, "j"), recs)
    assert not list(Path(events_dir(tmp_path, "j")).glob(EVENTS_GLOB))
