"""A synchronous HPP round is exactly one step of single-device training.

Real worker and coordinator processes, real sockets, real Redis; the final
weights (read back from the committed checkpoint, which the stage leaders
write) are compared with the single-process reference from the same seed at
1e-6, and every other device of every group is compared with its leader
through the replica digests the coordinator records in the checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.checkpoint import checkpoint_digests, load_full_state
from common.store import Store
from tests.cluster import LocalCluster
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def stage(
    start: int, end: int, *devices: str | tuple[str, int], warmup: int | None = None
) -> dict[str, Any]:
    allocs = [
        {"device": d, "share": 1} if isinstance(d, str) else {"device": d[0], "share": d[1]}
        for d in devices
    ]
    out: dict[str, Any] = {"start": start, "end": end, "devices": allocs}
    if warmup is not None:
        out["warmup"] = warmup
    return out


PLANS = {
    # stage 0 = 2 devices splitting 5:3, stage 1 = 1 device, stage 2 = 2 devices 1:1
    "hybrid": [stage(0, 3, ("a", 5), ("b", 3)), stage(3, 5, "c"), stage(5, 7, "d", "e")],
    "data-parallel": [stage(0, 7, "a", "b", "c")],
    "pipeline": [stage(0, 2, "a"), stage(2, 4, "b"), stage(4, 6, "c"), stage(6, 7, "d")],
}


def start_job(
    cluster: LocalCluster,
    model: dict[str, Any],
    stages: list[dict[str, Any]],
    *,
    rounds: int = 5,
    m: int = 4,
    batch: int = 32,
    optimizer: dict[str, Any] = SGD,
    policy: str = "1f1b",
    faults: dict[str, list[str]] | None = None,
    job_fields: dict[str, Any] | None = None,
) -> int:
    """Run job "eq" on fresh workers to its end; returns the coordinator's exit code.

    `job_fields` are merged into the job spec; with `epochs` among them, `rounds`
    is left out of the spec (it is still the round of the final checkpoint).
    """
    devices = [a["device"] for s in stages for a in s["devices"]]
    job: dict[str, Any] = {
        "job_id": "eq",
        "model": model,
        "seed": 7,
        "rounds": rounds,
        "optimizer": optimizer,
        "policy": policy,
        **(job_fields or {}),
    }
    if "epochs" in job:
        del job["rounds"]
    plan = {"global_batch": batch, "microbatches": m, "stages": stages}
    cluster.start_workers(devices, faults=faults)
    return cluster.run(job, plan)


def assert_replicas_agree(digests: list[dict[str, str]], stages: list[dict[str, Any]]) -> None:
    """Every device of every stage reported a digest, and each stage's replicas agree."""
    assert [sorted(d) for d in digests] == [
        sorted(a["device"] for a in s["devices"]) for s in stages
    ]
    for p, by_device in enumerate(digests):
        assert len(set(by_device.values())) == 1, f"stage {p} replicas differ: {by_device}"


def run_job(
    tmp_path,
    redis_url,
    cluster_name,
    model,
    stages,
    rounds=5,
    m=4,
    batch=32,
    optimizer=SGD,
    policy="1f1b",
    faults=None,
    job_fields=None,
):
    """Run job "eq" to its end; returns the cluster, its final weights and its metrics.

    Fails unless the job succeeded and every device of every group reported a
    digest of its state equal to its leader's.
    """
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    try:
        code = start_job(
            cluster,
            model,
            stages,
            rounds=rounds,
            m=m,
            batch=batch,
            optimizer=optimizer,
            policy=policy,
            faults=faults,
            job_fields=job_fields,
        )
        assert code == 0, cluster.log("coordinator")
        cluster.wait_workers_exit()
        store = Store(redis_url, cluster_name)
        weights = load_full_state(store, "eq", rounds)
        digests = checkpoint_digests(store, "eq", rounds)
        metrics = store.read("metrics", "eq")
        store.close()
        assert_replicas_agree(digests, stages)
        return cluster, weights, metrics
    finally:
        cluster.close()


def losses(metrics: list[dict[str, Any]]) -> list[float]:
    """The per-round training losses the coordinator recorded."""
    return [m["loss"] for m in metrics if "loss" in m]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_small_cnn_matches_single_process(tmp_path, redis_url, cluster_name, name):
    model = {"name": "small_cnn"}
    _, weights, metrics = run_job(tmp_path, redis_url, cluster_name, model, PLANS[name])
    ref, ref_losses = reference_train(model, 7, 32, 5, SGD)
    assert_matches_reference(weights, ref)
    assert_losses_match(losses(metrics), ref_losses)
