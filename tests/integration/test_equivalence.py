"""A synchronous HPP round is exactly one step of single-device training.

Real worker and coordinator processes, real sockets, real Redis; the final
weights (read back from the committed checkpoint) are compared with the
single-process reference from the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.checkpoint import load_full_state
from common.store import Store
from tests.cluster import LocalCluster
from tests.reference import reference_train

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
    inject=None,
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    devices = [a["device"] for s in stages for a in s["devices"]]
    job = {
        "job_id": "eq",
        "model": model,
        "seed": 7,
        "rounds": rounds,
        "optimizer": optimizer,
        "policy": policy,
    }
    plan = {"global_batch": batch, "microbatches": m, "stages": stages}
    try:
        cluster.start_workers(devices)
        if inject is None:
            code = cluster.run(job, plan)
        else:
            proc = cluster.start_coordinator(job, plan)
            inject(cluster)
            code = proc.wait(timeout=240)
        assert code == 0, cluster.log("coordinator")
        cluster.wait_workers_exit()
        store = Store(redis_url, cluster_name)
        weights = load_full_state(store, "eq", rounds)
        metrics = store.read("metrics", "eq")
        store.close()
        return cluster, weights, metrics
    finally:
        cluster.close()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_small_cnn_matches_single_process(tmp_path, redis_url, cluster_name, name):
    model = {"name": "small_cnn"}
    _, weights, metrics = run_job(tmp_path, redis_url, cluster_name, model, PLANS[name])
    ref, ref_losses = reference_train(model, 7, 32, 5, SGD)
    assert weights.keys() == ref.keys()
    worst = max(float((weights[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-5, f"max abs weight difference {worst}"
    assert [m["loss"] for m in metrics if "loss" in m] == pytest.approx(ref_losses, abs=1e-5)
