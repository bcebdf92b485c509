"""The coordinator measures the links between a job's workers before it plans.

Three real worker processes (each with a bandwidth sink beside its data
socket), a profiler, a planner and a coordinator on loopback with real Redis:
the coordinator asks each unordered pair once, stores the matrix under
``links``, and the cluster the planner got (``cluster:<job>``) carries the
measured links, not the constant `link_bandwidth`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.exit_codes import ExitCode
from tests.cluster import LocalCluster
from tests.integration.test_recovery import BATCH, job_spec

pytestmark = pytest.mark.integration

WORKERS = ["a", "b", "c"]
PAIRS = {"a|b", "a|c", "b|c"}


def test_a_planned_job_runs_on_measured_links(
    tmp_path: Path, redis_url, cluster_name, budget, store
):
    started = time.time()
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
    try:
        cluster.start_workers(WORKERS)
        cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
        cluster.spawn("planner", ["-m", "services.planner.service"])
        job = job_spec(
            "links",
            rounds=2,
            global_batch=BATCH,
            micro_batch=8,
            min_workers=3,
            checkpoint_every=0,
            adapt=False,
        )
        cluster.start_coordinator(job)
        code = cluster.wait("coordinator", budget.left(240))
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    finally:
        cluster.close()
    matrix = store.get_json("links")
    assert matrix is not None, "no link matrix stored"
    assert matrix["devices"] == WORKERS and matrix["errors"] == {}, matrix
    assert set(matrix["links"]) == PAIRS and all(v > 0 for v in matrix["links"].values())
    assert matrix["measured_at"] >= started
    planned = store.get_json("cluster", "links")
    assert planned["links"] == matrix["links"], planned
    # the constant is only the fallback: no pair of this job gets it
    assert all(v != planned["bandwidth"] for v in planned["links"].values())
    # each pair measured once, by the smaller name, one after another
    probed = {
        (name, e["target"])
        for name in WORKERS
        for e in cluster.log_events(name)
        if e.get("event") == "link measured"
    }
    assert probed == {("a", "b"), ("a", "c"), ("b", "c")}
    measured = [e for e in cluster.log_events("coordinator") if e.get("event") == "links measured"]
    assert len(measured) == 1 and measured[0]["pairs"] == 3
