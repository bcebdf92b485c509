"""The dynamic partition of an async job on real workers: it moves, and stays exact.

Three workers run `mode: async` on a hand-made pipeline of single-device
stages, with the job's cluster and profile stored as a planned job's are (so
the coordinator has layer costs to move partition points by). From round
`SLOW_FROM` on, the last stage's worker takes longer for every backward
(`tests.faulty_worker --fault slow-compute`): its measured speed drifts from
the baseline and the coordinator re-partitions at a round boundary. The new
Assign is a drain point of the async stream, so the run must equal its
single-process replay with a drain at each re-partition's round, and must
differ from the replay without one by far more than the tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.plan import Plan, validate_async
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from common.records.documents import put_cluster
from common.store import Store
from services.coordinator.adapt import ADAPT_AFTER
from services.profiler.cache import save
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import stage
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_train_async,
    weight_difference,
)

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
LAYERS = 7
ROUNDS = 40
M = 8
BATCH = 32
JOB = "async-adapt"
STAGES = [stage(0, 2, "a"), stage(2, 5, "b"), stage(5, 7, "c")]
SLOW_FROM = ADAPT_AFTER + 1
"""The round from which c's backwards are slow: after the speeds' baseline."""
WRONG_SEMANTICS_GAP = 2e-5
"""20x the weights' tolerance: a drain at a re-partition moves the weights by this much
at least (about 1e-4 here), so a run that ignored it cannot pass."""
SGD = {"kind": "sgd", "lr": 0.01, "momentum": 0.0}
"""Gentle: 128 updates on stale versions (the equivalence tests' momentum diverges here)."""


def _profile() -> Profile:
    """Equal layer costs: enough for the partition points to move by measured speeds."""
    layer = {"forward_s": [1e-3], "backward_s": [2e-3], "output_bytes": 1024}
    return Profile(
        model="async-adapt",
        device="here",
        batch_sizes=[BATCH // M],
        layers=[
            LayerProfile(index=i, activation_bytes=0, param_bytes=0, optimizer_bytes=0, **layer)
            for i in range(LAYERS)
        ],
    )


def _seed(store: Store) -> None:
    """The cluster and profile the hand-made plan stands for, where a planned job's are."""
    profile = _profile()
    key = f"{profile.model}:{profile.device}"
    save(store, profile)
    devices = [DeviceSpec(name=d, memory_bytes=1 << 30, profile=key) for d in "abc"]
    put_cluster(store, JOB, ClusterSpec(devices=devices))


def test_an_async_job_re_partitioned_by_measured_speeds_equals_its_replay(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget, store: Store
) -> None:
    plan = {"global_batch": BATCH, "microbatches": M, "stages": STAGES}
    job: dict[str, Any] = {
        "job_id": JOB,
        "model": MODEL,
        "seed": 7,
        "rounds": ROUNDS,
        "global_batch": BATCH,  # the layer costs are read at its micro-batch
        "micro_batch": BATCH // M,
        "optimizer": SGD,
        "mode": "async",
        "elastic": False,
        "adapt": True,
        "replicate_every": 0,
        "checkpoint_every": 0,
    }
    _seed(store)
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    slow = ["--fault", "slow-compute", "--fault-round", str(SLOW_FROM)]
    try:
        cluster.start_workers(["a", "b", "c"], faults={"c": slow})
        cluster.start_coordinator(job, plan)
        code = cluster.wait("coordinator", 240)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    finally:
        cluster.close()
    events = store.read("events", JOB)
    moves = [e for e in events if e["event"] == "replanned" and e["kind"] == "adapt"]
    timings = [
        {d: round(t["forward_s"] + t["backward_s"], 3) for d, t in m["devices"].items()}
        for m in store.read("metrics", JOB)
        if "devices" in m
    ]
    assert moves, f"no re-partition: events {events}; compute s by round {timings}"
    for e in moves:  # a pipeline of single-device stages, as async needs
        assert [len(devices) for _, _, devices in e["stages"]] == [1, 1, 1], e
        assert e["from_round"] > SLOW_FROM
    final = store.get_json("plan", JOB)
    assert final is not None
    validate_async(Plan.model_validate(final))
    assert [(s["start"], s["end"]) for s in final["stages"]] != [
        (s["start"], s["end"]) for s in STAGES
    ]
    weights = load_full_state(store, JOB, ROUNDS)
    losses = [m["loss"] for m in store.read("metrics", JOB) if "loss" in m]
    k0 = Plan.model_validate(plan).warmup(0)  # three stages before and after
    drains = [0, *(int(e["from_round"]) for e in moves)]
    ref, ref_losses = reference_train_async(MODEL, 7, BATCH, M, k0, ROUNDS, SGD, drains=drains)
    assert_matches_reference(weights, ref)
    assert_losses_match(losses, ref_losses)
    undrained, _ = reference_train_async(MODEL, 7, BATCH, M, k0, ROUNDS, SGD)
    key, gap = weight_difference(weights, undrained)
    assert gap > WRONG_SEMANTICS_GAP, f"the drain at {drains} changed only {gap:.3g} ({key})"
