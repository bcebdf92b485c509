"""Metrics where people look: streamed while a real job trains, and exported afterwards.

A real coordinator with `metrics_dir` streams each committed round and each
evaluation to `DIR/JOB.csv` and TensorBoard event files in `DIR/JOB/`; then
`asteroid export-metrics` (the real CLI, in its own process) writes the same
files from Redis. The streamed table equals the exported one byte for byte,
both hold exactly the records in Redis (every round once, values equal), and
the event files read back with TensorBoard's own reader give the same points.
A coordinator SIGKILLed mid-job and restarted with `--resume` goes on
appending: no round is lost or written twice.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from common.exit_codes import ExitCode
from common.metrics_export import row
from common.metrics_files import csv_path, events_dir
from common.store import Store
from tests.cluster import LocalCluster
from tests.common.test_metrics_files import expected_points, read_events, read_rows
from tests.integration.test_equivalence import stage

pytestmark = pytest.mark.integration

WORKERS = ["a", "b", "c"]
PLAN = {"global_batch": 32, "microbatches": 2, "stages": [stage(0, 3, "a", "b"), stage(3, 7, "c")]}
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9}


def job(jid: str, rounds: int) -> dict[str, Any]:
    return {
        "job_id": jid,
        "model": {"name": "small_cnn"},
        "seed": 5,
        "rounds": rounds,
        "optimizer": SGD,
        "dataset": {"kind": "synthetic", "eval_size": 64},
        "eval_every": 2,
    }


def export_metrics(cluster: LocalCluster, jid: str, out: Path, budget_s: float) -> None:
    """`asteroid export-metrics JID --out OUT`, as a person runs it."""
    cmd = [sys.executable, "-m", "services.cli", "export-metrics", jid, "--out", str(out)]
    done = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=budget_s)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert f"metrics records of job {jid}" in " ".join(done.stdout.split()), done.stdout


def check_files(streamed: Path, exported: Path, jid: str, store: Store, rounds: int) -> None:
    """Streamed files == exported files == the records in Redis, every round once."""
    records = store.read("metrics", jid)
    trained = [r["round"] for r in records if "loss" in r]
    assert trained == list(range(rounds)), trained
    evals = [r["round"] for r in records if "eval_loss" in r]
    assert len(set(evals)) == len(evals) and set(evals) <= {-1, *range(1, rounds, 2)}, evals
    assert all(isinstance(r["time"], float) for r in records)
    table = csv_path(streamed, jid).read_bytes()
    assert table == csv_path(exported, jid).read_bytes()
    assert read_rows(csv_path(streamed, jid)) == [row(r) for r in records]
    rows = read_rows(csv_path(exported, jid))
    assert [float(r["loss"]) for r in rows if "loss" in r] == [
        r["loss"] for r in records if "loss" in r
    ]
    want = expected_points(records)
    assert read_events(events_dir(streamed, jid)) == want
    assert read_events(events_dir(exported, jid)) == want
    assert ("loss", rounds - 1) in want and ("eval_accuracy", rounds - 1) in want


def test_streamed_files_equal_the_exported_ones_and_redis(
    tmp_path, redis_url, cluster_name, budget, store
):
    rounds = 4
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env["ASTEROID_METRICS_DIR"] = str(tmp_path / "streamed")
    try:
        cluster.start_workers(WORKERS)
        code = cluster.run(job("m", rounds), PLAN, timeout_s=budget.left(180))
        assert code == ExitCode.OK, cluster.log_tail("coordinator")
        cluster.wait_workers_exit()
        export_metrics(cluster, "m", tmp_path / "exported", budget.left(120))
    finally:
        cluster.close()
    check_files(tmp_path / "streamed", tmp_path / "exported", "m", store, rounds)
    assert [r["round"] for r in store.read("metrics", "m") if "eval_loss" in r] == [-1, 1, 3]
    logged = [e.get("event") for e in cluster.log_events("coordinator")]
    assert (
        "cannot write the metrics files; the job goes on, its metrics stay in Redis" not in logged
    )


def test_a_restarted_coordinator_goes_on_appending(
    tmp_path, redis_url, cluster_name, budget, store
):
    rounds = 12
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env["ASTEROID_METRICS_DIR"] = str(tmp_path / "streamed")
    try:
        cluster.start_workers(WORKERS)
        cluster.start_coordinator(job("r", rounds), PLAN)
        deadline = time.monotonic() + budget.left(120)
        while int(store.get_fields("job", "r").get("round", 0)) < 3:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            assert cluster.procs["coordinator"].poll() is None, cluster.log_tail("coordinator")
            time.sleep(0.01)
        cluster.procs["coordinator"].send_signal(signal.SIGKILL)
        cluster.procs["coordinator"].wait(timeout=10)
        killed_at = int(store.get_fields("job", "r")["round"])
        assert killed_at < rounds, "the job ended before the coordinator was killed"
        cluster.start_coordinator(job("r", rounds), PLAN, name="again", resume=True)
        assert cluster.wait("again", budget.left(150)) == ExitCode.OK, cluster.log_tail("again")
        cluster.wait_workers_exit(names=WORKERS)
        export_metrics(cluster, "r", tmp_path / "exported", budget.left(120))
    finally:
        cluster.close()
    check_files(tmp_path / "streamed", tmp_path / "exported", "r", store, rounds)
