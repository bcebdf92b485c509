"""Training goes on when a device leaves, with exactly the single-process result.

small_cnn, SGD with momentum, a 3-stage plan: a single-device first stage, a
single-device middle stage and a two-device last stage, on real worker
processes. One worker dies by SIGKILL at a chosen point (the workers'
`--fail-at` hook) or at a seeded random moment; the coordinator detects it,
re-plans on the survivors (lightweight: partition points moved by capacity),
resumes every stage from one version: the newest that survivors and the lost
stage's replica (on its backup node) or group peers hold, moving only the
layers that change hands peer to peer; or, when primary and backup are both
gone, from the newest Redis checkpoint. The rounds since are replayed. The job
must finish on the survivors, none of them restarted, with final weights and
per-round losses equal to single-process training, and a sample ledger in
which every sample of each epoch was trained exactly once.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.ledger import effective_rounds
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

ROUNDS = 10
BATCH = 32
EPOCH_SAMPLES = ROUNDS * BATCH // 2
"""A finite training set of two epochs' worth of rounds, so exactly-once is per epoch."""
DATASET = {"kind": "synthetic", "train_size": EPOCH_SAMPLES}
MODEL = {"name": "small_cnn"}
SEED = 3
PLAN = {
    "global_batch": BATCH,
    "microbatches": 4,
    "stages": [stage(0, 2, "a"), stage(2, 4, "b"), stage(4, 7, "c", "d")],
}
WORKERS = ["a", "b", "c", "d"]
SGD = {"kind": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
"""A step small enough that ten rounds of float re-association stay far below 1e-6."""


def job_spec(jid: str, **extra: Any) -> dict[str, Any]:
    """The recovery tests' job (checkpoints every 2 rounds), with `extra` fields."""
    return {
        "job_id": jid,
        "model": MODEL,
        "seed": SEED,
        "rounds": ROUNDS,
        "optimizer": SGD,
        "dataset": DATASET,
        "checkpoint_every": 2,
        **extra,
    }


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], list[float]]:
    return reference_train(MODEL, SEED, BATCH, ROUNDS, SGD, dataset=DATASET)


def _start(cluster: LocalCluster, fail_at: dict[str, str]) -> None:
    for name in WORKERS:
        extra = ["--fail-at", fail_at[name]] if name in fail_at else []
        cluster.spawn(name, ["-m", "services.worker.main", "--device", name, *extra])
        cluster.workers.append(name)


def _check_run(
    cluster: LocalCluster,
    store: Store,
    jid: str,
    victims: list[str],
    reference: tuple[dict[str, Any], list[float]],
) -> list[dict[str, Any]]:
    """The job ended well on the survivors; returns its recovery events."""
    code = cluster.wait("coordinator", 200)
    assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    survivors = [w for w in WORKERS if w not in victims]
    cluster.wait_workers_exit(names=survivors)
    for victim in victims:
        assert cluster.procs[victim].wait(timeout=10) == -9  # killed, never restarted
    for name in survivors:  # each ran from start to end in one process
        starts = [e for e in cluster.log_events(name) if e.get("event") == "worker started"]
        assert len(starts) == 1, name
    weights = load_full_state(store, jid, ROUNDS)
    ref_weights, ref_losses = reference
    assert_matches_reference(weights, ref_weights)
    ledger = effective_rounds(store.read("ledger", jid))
    assert [e["round"] for e in ledger] == list(range(ROUNDS))
    for first in (0, ROUNDS // 2):  # each epoch: every sample exactly once
        epoch = [i for e in ledger[first : first + ROUNDS // 2] for i in e["samples"]]
        assert sorted(epoch) == list(range(EPOCH_SAMPLES))
    metrics = {(m["round"], m["epoch"]): m for m in store.read("metrics", jid) if "loss" in m}
    losses = [metrics[(e["round"], e["epoch"])]["loss"] for e in ledger]
    assert_losses_match(losses, ref_losses)
    events = [e for e in store.read("events", jid) if e["event"] == "recovered"]
    assert sorted(d for e in events for d in e["lost"]) == sorted(victims), events
    assert all(v not in devs for v in victims for _, _, devs in events[-1]["stages"])
    return events


@pytest.mark.parametrize(
    ("victim", "fail_at", "every", "from_round", "replayed"),
    [
        # replicas every 2 rounds, round 3 in flight: b's stage comes back from its replica
        # of version 2 on c (no checkpoint is taken at all); round 2 is replayed
        pytest.param("b", "3:forward", 2, 2, 1, id="middle-stage-during-forward"),
        # round 4 in flight: d's peer c holds version 4, nothing is replayed
        pytest.param("d", "4:allreduce", 1, 4, 0, id="group-member-during-allreduce"),
        # round 5 committed, then c is lost while checkpoint 6 is taken: d holds version 6
        pytest.param("c", "5:done", 1, 6, 0, id="after-its-round-was-committed"),
    ],
)
def test_a_lost_device_is_recovered_exactly_from_its_peers(
    tmp_path: Path,
    redis_url,
    cluster_name,
    budget,
    store,
    reference,
    victim,
    fail_at,
    every,
    from_round,
    replayed,
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    checkpoints = {"checkpoint_every": 0} if victim == "b" else {}
    try:
        _start(cluster, {victim: fail_at})
        cluster.start_coordinator(job_spec("ft", replicate_every=every, **checkpoints), PLAN)
        events = _check_run(cluster, store, "ft", [victim], reference)
    finally:
        cluster.close()
    (event,) = events
    assert (event["from_round"], event["replayed"]) == (from_round, replayed), event
    assert event["source"] == "replicas", event
    # only layers that changed hands moved, each once, peer to peer
    old = {
        layer: [a["device"] for a in st["devices"]]
        for st in PLAN["stages"]
        for layer in range(st["start"], st["end"])
    }
    new = {layer: devs for lo, hi, devs in event["stages"] for layer in range(lo, hi)}
    changed = sum(d not in old[layer] for layer, devs in new.items() for d in devs)
    assert event["moved_layers"] == changed - _replica_takeovers(victim, old, new), event


def _replica_takeovers(victim: str, old: dict[int, list[str]], new: dict[int, list[str]]) -> int:
    """Layers of the lost single-device stage that its backup node (c) now runs itself."""
    lost = [layer for layer, devs in old.items() if devs == [victim]]
    return sum("c" in new[layer] for layer in lost)


def test_a_device_killed_at_a_random_moment_is_recovered_exactly(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    rng = random.Random(20261122)
    victim = rng.choice(["b", "c", "d"])
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        _start(cluster, {})
        cluster.start_coordinator(job_spec("ft-random"), PLAN)
        deadline = time.monotonic() + budget.left(120)
        while store.get_fields("job", "ft-random").get("round", 0) < 2:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        cluster.procs[victim].kill()
        _check_run(cluster, store, "ft-random", [victim], reference)
    finally:
        cluster.close()


def test_two_devices_lost_in_one_round_are_recovered_exactly(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    # d steps its optimizer for round 3 and dies; b, which still had d's gradients, does
    # the same: two stages lose a device in one round, after both had stepped for it
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        _start(cluster, {"b": "3:step", "d": "3:step"})
        cluster.start_coordinator(job_spec("ft-two", replicate_every=2), PLAN)
        events = _check_run(cluster, store, "ft-two", ["b", "d"], reference)
    finally:
        cluster.close()
    assert events[0]["from_round"] == 2 and events[-1]["stages"] == [[0, 3, ["a"]], [3, 7, ["c"]]]


def test_without_a_checkpoint_to_resume_from_the_job_fails_naming_it(
    tmp_path: Path, redis_url, cluster_name, budget, store
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        _start(cluster, {"b": "2:forward"})
        cluster.start_coordinator(job_spec("ft-lost", checkpoint_every=0, replicate_every=0), PLAN)
        deadline = time.monotonic() + budget.left(120)
        while store.get_fields("job", "ft-lost").get("round", 0) < 1:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.02)
        store.delete_prefix("ckpt", "ft-lost", "")  # the only copy, round 0's, is gone
        assert cluster.wait("coordinator", 120) == ExitCode.JOB_FAILED
    finally:
        cluster.close()
    state = store.get_fields("job", "ft-lost")
    assert state["state"] == "failed"
    assert "['b']" in state["error"], state
    assert "no replica or checkpoint of job ft-lost to resume the survivors" in state["error"]


def test_primary_and_backup_lost_together_come_back_from_the_checkpoint(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    # b runs the middle stage alone and c holds its replica: both gone, only Redis is left
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        _start(cluster, {})
        cluster.start_coordinator(job_spec("ft-both"), PLAN)
        deadline = time.monotonic() + budget.left(120)
        while store.get_fields("job", "ft-both").get("round", 0) < 3:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.02)
        cluster.procs["b"].kill()
        cluster.procs["c"].kill()
        events = _check_run(cluster, store, "ft-both", ["b", "c"], reference)
    finally:
        cluster.close()
    assert all(e["source"] == "checkpoint" for e in events), events
    first = events[0]
    assert first["from_round"] % 2 == 0 and first["from_round"] >= 2, first  # a checkpoint
    # committed rounds at the loss: the failed round's own number, or one more when the
    # loss came after it was committed (during its checkpoint)
    committed = first["failed_round"] + (
        first["replayed"] > first["failed_round"] - first["from_round"]
    )
    assert first["replayed"] == committed - first["from_round"] > 0, first


def test_heavy_recovery_plans_again_from_profiles_and_stays_exact(
    tmp_path: Path, redis_url, cluster_name, budget, store, reference
):
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
    try:
        _start(cluster, {})
        cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
        cluster.spawn("planner", ["-m", "services.planner.service"])
        job = job_spec(
            "ft-heavy", recovery="heavy", global_batch=BATCH, micro_batch=8, min_workers=4
        )
        cluster.start_coordinator(job)
        deadline = time.monotonic() + budget.left(150)
        while store.get_fields("job", "ft-heavy").get("round", 0) < 2:
            assert time.monotonic() < deadline, cluster.log_tail("coordinator")
            time.sleep(0.02)
        planned = store.get_json("plan", "ft-heavy")
        victim = planned["stages"][-1]["devices"][0]["device"]
        cluster.procs[victim].kill()
        code = cluster.wait("coordinator", 150)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
    finally:
        cluster.close()
    assert_matches_reference(load_full_state(store, "ft-heavy", ROUNDS), reference[0])
    events = [e for e in store.read("events", "ft-heavy") if e["event"] == "recovered"]
    assert len(events) == 1 and events[0]["recovery"] == "heavy", events
    # every layer gathered in Redis from the survivors at the cut, then every stage loaded
    loads = sum((hi - lo) * len(devs) for lo, hi, devs in events[0]["stages"])
    assert events[0]["source"] == "replicas", events
    assert events[0]["moved_layers"] == 7 + loads, events
    assert events[0]["lost"] == [victim]
    replanned = store.get_json("plan", "ft-heavy")
    assert victim not in [a["device"] for st in replanned["stages"] for a in st["devices"]]
