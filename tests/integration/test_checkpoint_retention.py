"""A job keeps its newest checkpoints in a small Redis; a Redis too small fails it by name.

Each test runs its own redis-server with a small `maxmemory` and `noeviction`:
once full, Redis refuses writes (OutOfMemoryError) as a deployed one does when
checkpoints pile up. The job (an MLP whose checkpoint, weights and momentum,
is about 7 MB) runs on a real coordinator and real worker processes.

- Retention: checkpoints every round, `keep_checkpoints: 2`, in 40 MB. Without
  pruning the fifth checkpoint no longer fits. A device lost mid-job (no
  replicas) comes back from the newest checkpoint; the job ends with the
  single-process weights and only the newest two checkpoints are left.
- Refusal: in 12 MB the initial weights fit and a round's checkpoint does not
  (the stage leaders' write is refused); in 8 MB not even the coordinator's
  initial weights fit. Either way the job fails with an error naming Redis and
  its reason, recorded in the job's hash; no worker died (each exits 0 when the
  coordinator shuts it down) and no refused round counts as a checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.checkpoint import committed_rounds, latest_round, load_full_state
from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.reference import assert_losses_match, assert_matches_reference, reference_train
from tests.small_redis import small_redis

pytestmark = pytest.mark.integration

MODEL = {"name": "mlp"}
SEED = 5
BATCH = 32
SGD = {"kind": "sgd", "lr": 0.01, "momentum": 0.9}
KEEP = 2


def _job(jid: str, rounds: int, **extra: object) -> dict[str, object]:
    return {
        "job_id": jid,
        "model": MODEL,
        "seed": SEED,
        "rounds": rounds,
        "optimizer": SGD,
        "checkpoint_every": 1,
        "replicate_every": 0,  # a lost stage can only come back from Redis
        **extra,
    }


def _plan(*stages: dict[str, object]) -> dict[str, object]:
    return {"global_batch": BATCH, "microbatches": 4, "stages": list(stages)}


def _started_once(cluster: LocalCluster, name: str) -> bool:
    return sum(e.get("event") == "worker started" for e in cluster.log_events(name)) == 1


def test_a_long_job_keeps_its_newest_checkpoints_and_recovers_from_the_newest(
    tmp_path: Path, budget
):
    rounds, jid = 10, "keep"
    plan = _plan(stage(0, 2, "a"), stage(2, 3, "b"), stage(3, 4, "c"))
    with small_redis(tmp_path / "redis", "40mb") as url:
        cluster = LocalCluster(tmp_path, url, "retention", budget=budget)
        store = Store(url, "retention")
        try:
            for name in ("a", "c"):
                cluster.spawn(name, ["-m", "services.worker.main", "--device", name])
            # b dies (SIGKILL) in round 6's first forward, once checkpoint 6 is committed
            fail = ["--fail-at", "6:forward"]
            cluster.spawn("b", ["-m", "services.worker.main", "--device", "b", *fail])
            cluster.workers += ["a", "c"]
            cluster.start_coordinator(_job(jid, rounds, keep_checkpoints=KEEP), plan)
            code = cluster.wait("coordinator", 200)
            assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
            cluster.wait_workers_exit()
            assert cluster.procs["b"].wait(timeout=10) == -9
            kept = committed_rounds(store, jid)
            latest = latest_round(store, jid)
            weights = load_full_state(store, jid, rounds)
            events = [e for e in store.read("events", jid) if e["event"] == "recovered"]
            losses = [m["loss"] for m in store.read("metrics", jid) if "loss" in m]
            state = store.get_fields("job", jid)
        finally:
            cluster.close()
            store.close()
    assert state["state"] == "finished", state
    assert kept == [rounds - 1, rounds] and latest == rounds, kept
    # the lost stage came back from the newest checkpoint, not from an older one kept around
    assert [e["source"] for e in events] == ["checkpoint"], events
    assert events[0]["from_round"] == 6, events
    ref_weights, ref_losses = reference_train(MODEL, SEED, BATCH, rounds, SGD)
    assert_matches_reference(weights, ref_weights)
    assert_losses_match(losses[-rounds:], ref_losses)


@pytest.mark.parametrize(
    ("maxmemory", "refused"),
    [
        pytest.param(
            "12mb",
            r"worker [ab] failed in round 1: StoreRefused: Redis at {url} refused a command "
            r"while saving the checkpoint of stage [01] round 1: OutOfMemoryError: ",
            id="a-stage-leaders-checkpoint",
        ),
        pytest.param(
            "8mb",
            r"^Redis at {url} refused a command while saving the initial weights: "
            r"OutOfMemoryError: ",
            id="the-coordinators-initial-weights",
            marks=pytest.mark.slow,  # the coordinator's own write refused; out of the quick run
        ),
    ],
)
def test_a_redis_too_small_for_a_checkpoint_fails_the_job_naming_redis(
    tmp_path: Path, budget, maxmemory: str, refused: str
):
    jid = "full"
    plan = _plan(stage(0, 2, "a"), stage(2, 4, "b"))
    with small_redis(tmp_path / "redis", maxmemory) as url:
        cluster = LocalCluster(tmp_path, url, "full", budget=budget)
        store = Store(url, "full")
        try:
            cluster.start_workers(["a", "b"])
            cluster.start_coordinator(_job(jid, 4), plan)
            code = cluster.wait("coordinator", 120)
            assert code == ExitCode.JOB_FAILED, cluster.log_tail("coordinator", 60)
            cluster.wait_workers_exit()  # shut down by the coordinator: each exits 0
            state = store.get_fields("job", jid)
            kept, latest = committed_rounds(store, jid), latest_round(store, jid)
            leftovers = list(store.keys("ckpt", jid, ""))
        finally:
            cluster.close()
            store.close()
    assert state["state"] == "failed", state
    assert re.search(refused.format(url=re.escape(url)), state["error"]), state["error"]
    assert "maxmemory" in state["error"], state["error"]
    assert all(_started_once(cluster, name) for name in ("a", "b"))
    if maxmemory == "12mb":  # the initial weights fit; the refused round is no checkpoint
        assert kept == [0] and latest == 0, kept
        failed = [e for n in ("a", "b") for e in cluster.log_events(n)]
        assert any(e.get("event") == "command failed" for e in failed)  # reported, not fatal
    else:
        # the coordinator's own refused write: what it left went with the failure
        assert kept == [] and latest is None and leftovers == [], leftovers
