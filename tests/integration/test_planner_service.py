"""The coordinator asks the planner service (a real process) for a plan over ZeroMQ;
the plan lands in Redis; bad requests come back as clear errors."""

from __future__ import annotations

import subprocess

import pytest

from common.errors import PlanError
from common.messages import PlanRequest
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.service import Coordinator
from tests.cluster import LocalCluster

pytestmark = pytest.mark.integration
MiB = 1 << 20


def synthetic_profile(layers: int = 6) -> Profile:
    return Profile(
        model="synthetic",
        device="cpu-a",
        batch_sizes=[1, 8],
        layers=[
            LayerProfile(
                index=i,
                forward_s=[0.001, 0.008],
                backward_s=[0.002, 0.016],
                output_bytes=4096,
                activation_bytes=8192,
                param_bytes=MiB,
                optimizer_bytes=MiB,
            )
            for i in range(layers)
        ],
    )


def cluster(memory: int) -> ClusterSpec:
    return ClusterSpec(
        devices=[
            DeviceSpec(name=n, memory_bytes=memory, profile="synthetic:cpu-a", slowdown=s)
            for n, s in (("a", 1.0), ("b", 2.0), ("c", 1.0))
        ],
        bandwidth=50e6,
    )


def test_coordinator_gets_plan_from_planner_service(tmp_path, redis_url, cluster_name):
    local = LocalCluster(tmp_path, redis_url, cluster_name)
    store = Store(redis_url, cluster_name)
    store.put_json(synthetic_profile().model_dump(mode="json"), "profile", "synthetic:cpu-a")
    coord = Coordinator(
        CoordinatorSettings(
            bind=local.addr, redis_url=redis_url, cluster=cluster_name, heartbeat_s=0.3
        )
    )
    planner = local.spawn("planner", ["-m", "services.planner.service"])
    try:
        req = PlanRequest(
            job_id="p1",
            planner="asteroid",
            cluster=cluster(1 << 30),
            profiles=["synthetic:cpu-a"],
            global_batch=32,
            microbatches=4,
        )
        plan = coord.request_plan(req, timeout_s=120)
        assert plan.planner == "asteroid" and plan.predicted_round_s
        assert set(plan.devices) <= {"a", "b", "c"}
        assert store.get_json("plan", "p1") == plan.model_dump(mode="json")
        # a cluster far too small: the planner answers with an error naming the shortfall
        tiny = req.model_copy(update={"job_id": "p2", "cluster": cluster(1 * MiB)})
        with pytest.raises(PlanError, match="planner 'asteroid' failed"):
            coord.request_plan(tiny, timeout_s=60)
        unknown = req.model_copy(update={"job_id": "p3", "planner": "magic"})
        with pytest.raises(PlanError, match="magic"):
            coord.request_plan(unknown, timeout_s=60)
        assert planner.poll() is None  # bad requests did not kill it
    finally:
        planner.terminate()
        try:
            planner.wait(timeout=10)
        except subprocess.TimeoutExpired:
            planner.kill()
        coord.close()
        store.close()
