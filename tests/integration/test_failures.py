"""A dead peer of a job that must not recover (`recovery: none`): the job fails with an
error naming it, quickly, and nothing hangs. Recovery itself: test_recovery.py."""

from __future__ import annotations

import signal
import time

import pytest

from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import PLANS, SGD

pytestmark = pytest.mark.integration


def test_killed_worker_fails_job_naming_it(tmp_path, redis_url, cluster_name, budget):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    job = {
        "job_id": "dead",
        "model": {"name": "small_cnn"},
        "seed": 7,
        "rounds": 1000,
        "optimizer": SGD,
        "recovery": "none",
    }
    plan = {"global_batch": 32, "microbatches": 4, "stages": PLANS["hybrid"]}
    store = Store(redis_url, cluster_name)
    try:
        cluster.start_workers(["a", "b", "c", "d", "e"])
        cluster.start_coordinator(job, plan)
        deadline = time.monotonic() + budget.left(120)
        while store.get_fields("job", "dead").get("round", 0) < 2:
            assert time.monotonic() < deadline, cluster.log("coordinator")
            time.sleep(0.05)
        cluster.procs["c"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert cluster.wait("coordinator", 60) == ExitCode.JOB_FAILED
        detect_s = time.monotonic() - killed_at
        state = store.get_fields("job", "dead")
        trained = [m["round"] for m in store.read("metrics", "dead") if "loss" in m]
        # the other workers were told to shut down and do so although their round
        # was blocked waiting for c
        cluster.wait_workers_exit(names=["a", "b", "d", "e"])
    finally:
        cluster.close()
        store.close()
    assert state["state"] == "failed"
    # its connections closed with the process: the coordinator's own, then its data port
    # refused a connect (no process listens) or, on a loaded machine, the flap grace ran out
    assert state["error"].startswith("workers ['c'] lost while"), state
    assert "c: control connection closed" in state["error"], state
    assert detect_s < 30
    # every committed round is in the metrics, once and in order, and none after them:
    # the round in flight when c died was abandoned, not half-committed
    committed = state["round"]
    assert committed >= 2
    assert trained == list(range(committed)), trained
