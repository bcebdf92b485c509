"""Workers are re-assigned other layers at run time, without a restart, and
training resumes from the committed checkpoint exactly.

Three rounds under a pure pipeline plan, then the same job continues under
the hybrid plan from checkpoint 3: the final weights equal five rounds of
single-process training.
"""

from __future__ import annotations

import pytest

from common.checkpoint import checkpoint_digests, load_full_state
from common.job import JobSpec
from common.plan import Plan
from common.settings import CoordinatorSettings
from services.coordinator.service import Coordinator
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import PLANS, SGD, assert_replicas_agree
from tests.reference import assert_matches_reference, reference_train

pytestmark = pytest.mark.integration


def test_replan_resumes_exactly_without_restarting_workers(tmp_path, redis_url, cluster_name):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    settings = CoordinatorSettings(
        bind=cluster.addr, redis_url=redis_url, cluster=cluster_name, heartbeat_s=0.3
    )
    model = {"name": "small_cnn"}
    spec = {"job_id": "re", "model": model, "seed": 7, "optimizer": SGD}
    first = Plan(global_batch=32, microbatches=4, stages=PLANS["pipeline"])
    second = Plan(global_batch=32, microbatches=4, stages=PLANS["hybrid"])
    coord = Coordinator(settings)
    try:
        cluster.start_workers(["a", "b", "c", "d", "e"])
        coord.run_job(JobSpec.model_validate({**spec, "rounds": 3}), first)
        pids = {d: m.info.pid for d, m in coord.members.items()}
        summary = coord.run_job(JobSpec.model_validate({**spec, "rounds": 5}), second, resume=True)
        assert {d: m.info.pid for d, m in coord.members.items()} == pids
        weights = load_full_state(coord.store, "re", 5)
        digests = checkpoint_digests(coord.store, "re", 5)
        coord.shutdown_workers("test over")
    finally:
        coord.close()
        cluster.close()
    assert len(summary.losses) == 2  # only rounds 3 and 4 ran the second time
    ref, _ = reference_train(model, 7, 32, 5, SGD)
    assert_matches_reference(weights, ref)
    assert_replicas_agree(digests, PLANS["hybrid"])
