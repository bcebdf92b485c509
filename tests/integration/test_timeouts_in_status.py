"""A running job's detection timeouts, as derived by a real coordinator, shown by `asteroid status`.

Real coordinator and worker processes on loopback, real Redis: once enough
heartbeats arrived, the coordinator's timeouts in force are derived from them
(shorter than the settings' bound), recorded for the job, and `status` shows
them with where they came from. The bounds the test sets are far apart from
the floors, so "measured" cannot be mistaken for either.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from common.records.detection import read_effective
from common.store import Store
from services.cli import app, jobs
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.3
BOUND_S = 20 * HEARTBEAT_S
"""The deadline's upper bound (heartbeat_misses 20): the derived one must be well below it."""
PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [stage(0, 3, "a"), stage(3, 7, "b")],
}


def test_status_shows_the_timeouts_a_running_job_derived(
    tmp_path: Path,
    redis_url: str,
    cluster_name: str,
    budget,
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = {
        "job_id": "tj",
        "model": {"name": "small_cnn"},
        "seed": 3,
        "rounds": 100_000,  # runs until the test has seen what it needs, then is cancelled
        "optimizer": {"kind": "sgd", "lr": 0.01},
        "dataset": {"kind": "synthetic", "train_size": 320},
    }
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, HEARTBEAT_S, budget)
    cluster.env["ASTEROID_HEARTBEAT_MISSES"] = "20"
    try:
        cluster.start_workers(["a", "b"])
        cluster.start_coordinator(job, PLAN)
        deadline = time.monotonic() + budget.left(150)
        rec = None
        while rec is None or not rec.why.get("heartbeat_deadline_s", "").startswith("measured"):
            assert time.monotonic() < deadline, f"no measured timeouts recorded: {rec}\n" + (
                cluster.log_tail("coordinator", 40)
            )
            time.sleep(0.2)
            rec = read_effective(store, "tj")
        assert 3 * HEARTBEAT_S <= rec.heartbeat_deadline_s < BOUND_S, rec
        for name in [k for k in os.environ if k.startswith("ASTEROID_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
        monkeypatch.setattr(jobs.console, "width", 400)
        res = CliRunner().invoke(
            app, ["status", "--redis-url", redis_url, "--cluster", cluster_name]
        )
        assert res.exit_code == 0, res.output
        lines = [ln for ln in res.output.splitlines() if ln.startswith("detection of job tj:")]
        assert len(lines) == 1, res.output
        assert "heartbeat " in lines[0] and "measured (3 x p99 gap" in lines[0], lines[0]
        assert "neighbour " in lines[0] and "probe " in lines[0], lines[0]
    finally:
        cluster.close()
