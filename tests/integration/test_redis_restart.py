"""Redis SIGKILLed right after a checkpoint is acknowledged restarts from its AOF; the job goes on.

A job on a coordinator and three real workers runs against its own redis-server
(append-only file, `appendfsync everysec`: the embedded Redis of `asteroid up` with
a state directory). The moment the coordinator's `checkpoint` event for a mid-job
round is in the events stream (and in its AOF file: with `everysec` Redis may hold
an acknowledged write back for two seconds while it fsyncs), the redis-server is
SIGKILLed; once the coordinator has found it gone, a new one starts on the same port
from the same directory. A copy of the directory taken at the kill is what any
restart loads: its latest committed manifest must name that checkpoint (or a newer
one committed in the moment before the kill: never an older one), every layer
hash-verified, holding the single-process weights of that round. The running coordinator
rides the outage out (its `redis_outage_s` is far longer), so the job ends with the
single-process weights and every round committed once.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import latest_round, load_full_state
from common.embedded_redis import EmbeddedRedis
from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import Budget, LocalCluster
from tests.common.test_durability import AofRedis
from tests.reference import assert_losses_match, assert_matches_reference, reference_train
from tests.security.test_redis_outage import OPT, PLAN, _events, _wait_for

pytestmark = pytest.mark.integration

CLUSTER = "aof-restart"
JID = "aof"
ROUNDS = 12
EVERY = 3
KILL_AFTER = 6
"""The checkpoint whose acknowledgement triggers the kill: mid-job, after an earlier one."""
SEED = 11
BATCH = 32
MODEL = {"name": "small_cnn"}
JOB = {
    "job_id": JID,
    "model": MODEL,
    "seed": SEED,
    "rounds": ROUNDS,
    "optimizer": OPT,
    "checkpoint_every": EVERY,
}
WORKERS = ["a", "b", "c"]


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[AofRedis]:
    """The job's own AOF redis-server; killed at the end whatever the test did to it."""
    server = AofRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _url(server: AofRedis) -> str:
    assert server.server is not None, "the redis-server is not running"
    return server.server.url


def _acknowledged_checkpoint(store: Store, at_least: int, timeout_s: float) -> int:
    """The round of the first `checkpoint` event for round `at_least` or later, once appended.

    XREAD blocks until the coordinator appends to the events stream, so the
    caller acts within moments of the acknowledgement, not a polling period later.
    """
    deadline, after = time.monotonic() + timeout_s, "0"
    while (left := deadline - time.monotonic()) > 0:
        entries, after = store.read_after("events", JID, after)
        for entry in entries:
            if entry.get("event") == "checkpoint" and int(entry["round"]) >= at_least:
                return int(entry["round"])
        block_ms = max(1, int(min(left, 1.0) * 1000))
        store.r.xread({store.key("events", JID): after}, block=block_ms)
    raise AssertionError(f"no checkpoint of round {at_least} or later within {timeout_s:.0f} s")


def _latest_checkpoint(state_dir: Path) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """What a redis-server started on `state_dir` holds: latest round, its manifest, weights.

    `load_full_state` checks every layer blob against the sha256 its own
    manifest and the checkpoint manifest recorded.
    """
    with EmbeddedRedis(state_dir=state_dir) as server:
        store = Store(server.url, CLUSTER)
        try:
            latest = latest_round(store, JID)
            assert latest is not None, "the AOF holds no committed checkpoint"
            manifest = store.get_json("ckpt", JID, latest, "manifest")
            return latest, manifest, load_full_state(store, JID, latest)
        finally:
            store.close()


def _outage_after_the_ack(
    cluster: LocalCluster, server: AofRedis, store: Store, budget: Budget, snapshot: Path
) -> int:
    """SIGKILL Redis once a checkpoint is acknowledged, keep its files, restart it; the round.

    Redis stays away until the coordinator has found it gone, so the job
    really waits it out instead of missing a short gap between two writes.
    """
    acked = _acknowledged_checkpoint(store, KILL_AFTER, budget.left(150))
    server.wait_written()  # everysec may hold an acknowledged write back while fsyncing
    server.kill()
    shutil.copytree(server.state_dir, snapshot)
    _wait_for(
        "the coordinator to find Redis gone",
        lambda: _events(cluster, "coordinator", "Redis unreachable; waiting for it"),
        budget.left(60),
        cluster,
    )
    assert cluster.procs["coordinator"].poll() is None, cluster.log_tail("coordinator")
    server.start()
    return acked


def test_a_checkpoint_acknowledged_before_redis_is_sigkilled_is_complete_and_the_job_goes_on(
    tmp_path: Path, aof_redis: AofRedis, budget: Budget
) -> None:
    url = _url(aof_redis)
    cluster = LocalCluster(tmp_path, url, CLUSTER, budget=budget)
    cluster.env["ASTEROID_REDIS_OUTAGE_S"] = "90"
    store = Store(url, CLUSTER)
    snapshot = tmp_path / "redis-at-the-kill"
    try:
        cluster.start_workers(WORKERS)
        cluster.start_coordinator(JOB, PLAN)
        acked = _outage_after_the_ack(cluster, aof_redis, store, budget, snapshot)
        assert _url(aof_redis) == url  # same port: the services find it again
        code = cluster.wait("coordinator", 180)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60)
        cluster.wait_workers_exit()
        # what the AOF held at the kill: the acknowledged checkpoint (or one committed in
        # the moment before the kill), complete and hash-verified
        latest, manifest, weights = _latest_checkpoint(snapshot)
        kept = load_full_state(store, JID, latest)  # the server restarted in place kept it
        final = load_full_state(store, JID, ROUNDS)
        metrics = store.read("metrics", JID)
        state = store.get_fields("job", JID)
    finally:
        cluster.close()
        store.close()
    assert _events(cluster, "coordinator", "Redis is back"), cluster.log_tail("coordinator", 60)
    assert state["state"] == "finished", state

    assert latest >= acked, f"the AOF's latest checkpoint is {latest}, {acked} was acknowledged"
    hashed = sorted(int(layer) for layer in manifest["sha256"])
    assert hashed == list(range(manifest["layers"])), manifest  # every layer's hash recorded
    ref_at_kill, _ = reference_train(MODEL, SEED, BATCH, latest, OPT, total_rounds=ROUNDS)
    assert_matches_reference(weights, ref_at_kill, what=f"checkpoint {latest} in the AOF")
    assert_matches_reference(kept, weights, tol=0.0, what=f"checkpoint {latest} after the job")

    # the job rode the outage out: single-process weights, every round committed once
    ref, ref_losses = reference_train(MODEL, SEED, BATCH, ROUNDS, OPT)
    assert_matches_reference(final, ref)
    committed = [m for m in metrics if "loss" in m]
    assert [m["round"] for m in committed] == list(range(ROUNDS)), committed
    assert_losses_match([m["loss"] for m in committed], ref_losses)
