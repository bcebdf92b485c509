"""/metrics scraped by Prometheus's parser while real workers train: the counters move."""

from __future__ import annotations

import pytest

from common.exit_codes import ExitCode
from tests.cluster import LocalCluster
from tests.dashboard.harness import job_spec, scrape, start_dashboard, until

pytestmark = pytest.mark.integration

WORKERS = ["a", "b", "c"]
PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [
        {"start": 0, "end": 3, "devices": [{"device": "a", "share": 1}]},
        {"start": 3, "end": 7, "devices": [{"device": "b", "share": 1}, {"device": "c"}]},
    ],
}
ROUNDS = 12


@pytest.mark.timeout(300)
def test_the_counters_move_during_a_job(tmp_path, redis_url, cluster_name, budget):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    job = (("job", "scraped"),)
    try:
        cluster.start_workers(WORKERS)
        url = start_dashboard(cluster, budget.left(60))
        before = scrape(url)
        assert before[("asteroid_redis_up", ())] == 1.0
        assert ("asteroid_rounds_committed_total", job) not in before
        cluster.start_coordinator(job_spec("scraped", ROUNDS), PLAN)
        why = lambda: cluster.log_tail("coordinator")  # noqa: E731

        def rounds_at_least(n: int):
            def check():
                m = scrape(url)
                return m if m.get(("asteroid_rounds_committed_total", job), 0) >= n else None

            return check

        early = until(rounds_at_least(2), budget.left(150), "2 rounds", why)
        late = until(rounds_at_least(early[("asteroid_rounds_committed_total", job)] + 3),
                     budget.left(150), "3 more rounds", why)  # fmt: skip
        for name in (
            "asteroid_rounds_committed_total",
            "asteroid_samples_total",
            "asteroid_round_duration_seconds_count",
            "asteroid_round_duration_seconds_sum",
        ):
            assert late[(name, job)] > early[(name, job)] > 0, name
        assert late[("asteroid_samples_total", job)] == pytest.approx(
            32 * late[("asteroid_round_duration_seconds_count", job)], rel=1e-3
        )
        inf = ("asteroid_round_duration_seconds_bucket", (*job, ("le", "+Inf")))
        assert late[inf] == late[("asteroid_round_duration_seconds_count", job)]
        assert late[("asteroid_loss", job)] > 0
        assert late[("asteroid_job_state", (*job, ("state", "running")))] == 1
        for device in WORKERS:
            assert late[("asteroid_device_up", (("device", device),))] == 1
            assert late[("asteroid_device_heartbeat_age_seconds", (("device", device),))] < 5
        assert cluster.wait("coordinator", 200) == ExitCode.OK, why()
        end = scrape(url)
        assert end[("asteroid_rounds_committed_total", job)] == ROUNDS
        assert end[("asteroid_job_state", (*job, ("state", "finished")))] == 1
    finally:
        cluster.close()
