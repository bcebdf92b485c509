"""`asteroid export-metrics`: a job's metrics from Redis to CSV and TensorBoard files."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from common.metrics_files import EVENTS_GLOB, CsvLog, csv_path, events_dir
from services.cli import app
from services.cli.metrics import parse_formats, read_records
from tests.common.test_metrics_files import expected_points, read_events, records, same_rows


def export(redis_url: str, cluster: str, *args: str):
    return CliRunner().invoke(
        app, ["export-metrics", *args, "--redis-url", redis_url, "--cluster", cluster]
    )


def one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    return lines[0]


@pytest.fixture
def job(store):
    """Job "j" in Redis with the records of five rounds, as the coordinator writes them."""
    recs = records(5)
    store.set_fields({"state": "finished", "round": 5}, "job", "j")
    for record in recs:
        store.append("metrics", "j", record)
    return recs


def test_the_files_hold_every_record_of_the_job(tmp_path, redis_url, cluster_name, job):
    res = export(redis_url, cluster_name, "j", "--out", str(tmp_path))
    assert res.exit_code == ExitCode.OK, res.output
    assert f"wrote {len(job)} metrics records of job j" in " ".join(res.output.split())
    same_rows(csv_path(tmp_path, "j"), job)
    assert read_events(events_dir(tmp_path, "j")) == expected_points(job)


def test_exporting_again_replaces_the_files(tmp_path, redis_url, cluster_name, job):
    for _ in range(2):
        assert export(redis_url, cluster_name, "j", "--out", str(tmp_path)).exit_code == 0
    assert len(list(events_dir(tmp_path, "j").glob(EVENTS_GLOB))) == 1
    assert read_events(events_dir(tmp_path, "j")) == expected_points(job)


def test_one_format_writes_only_its_files(tmp_path, redis_url, cluster_name, job):
    res = export(redis_url, cluster_name, "j", "--out", str(tmp_path), "--format", "csv")
    assert res.exit_code == ExitCode.OK, res.output
    assert csv_path(tmp_path, "j").exists() and not events_dir(tmp_path, "j").exists()


def test_a_record_without_its_time_gets_the_time_redis_appended_it(store, job):
    store.append("metrics", "j", {"round": 5, "loss": 1.0})  # an older coordinator's record
    got = read_records(store, "j")
    assert got[:-1] == job
    entry_id = store.r.xrange(store.key("metrics", "j"))[-1][0]
    assert got[-1] == {"round": 5, "loss": 1.0, "time": int(entry_id.split(b"-")[0]) / 1000}


def test_an_unknown_job_is_one_line_and_a_config_exit(tmp_path, redis_url, cluster_name):
    res = export(redis_url, cluster_name, "nope", "--out", str(tmp_path))
    assert res.exit_code == ExitCode.CONFIG
    assert "job nope: no such job in Redis at" in one_line(res.output)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["j", "--format", "csv,parquet"], "--format: expected a comma-separated list"),
        (["j", "--format", ","], "--format: expected"),
        (["../etc", "--format", "csv"], "job_id from the command line"),
    ],
)
def test_bad_arguments_are_one_line_and_a_config_exit(tmp_path, args, says):
    dead = "redis://127.0.0.1:1/0"  # refused before Redis is asked
    res = CliRunner().invoke(
        app, ["export-metrics", *args, "--out", str(tmp_path), "--redis-url", dead]
    )
    assert res.exit_code == ExitCode.CONFIG
    assert says in one_line(res.output)


def test_an_unwritable_directory_is_one_line(tmp_path, redis_url, cluster_name, job):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = export(redis_url, cluster_name, "j", "--out", str(blocker / "sub"), "--format", "csv")
    assert res.exit_code == ExitCode.CONFIG
    assert "cannot write to" in one_line(res.output)


def test_formats_parse_once_each_in_a_fixed_order():
    assert parse_formats("tensorboard, CSV,csv") == ["csv", "tensorboard"]


def test_the_command_and_its_writers_import_torch_only_to_write_events():
    code = (
        "import sys, common.metrics_files, common.metrics_export, services.cli.metrics; "
        "print(sorted(m for m in ('torch', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_table_an_export_writes_is_the_one_of_the_records(
    tmp_path, redis_url, cluster_name, job
):
    CsvLog.create(tmp_path / "direct.csv", job)
    res = export(redis_url, cluster_name, "j", "--out", str(tmp_path / "out"))
    assert res.exit_code == ExitCode.OK, res.output
    assert csv_path(tmp_path / "out", "j").read_bytes() == (tmp_path / "direct.csv").read_bytes()
