"""A Redis outage pauses a job at a round boundary; it resumes, or fails by name.

Each test runs its own redis-server (with an append-only file, so a restart
keeps the data, as a deployed Redis does) on a free port, kills it with SIGKILL
mid-job and brings it back on the same port. The coordinator must stay up
throughout; a job that rides the outage out ends with exactly the
single-process weights, with every round committed once; a job whose outage
outlasts `redis_outage_s` fails naming Redis, and its end state reaches Redis
when Redis comes back (never `running` under a live coordinator).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common.checkpoint import load_full_state
from common.embedded_redis import redis_server_binary, wait_until_answers
from common.messages import SubmitJob
from common.ports import free_port
from common.store import Store
from services.cli.client import ask_coordinator
from tests.cluster import LocalCluster
from tests.reference import assert_losses_match, assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

ROUNDS = 14
OPT = {"kind": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
JOB = {
    "job_id": "outage",
    "model": {"name": "small_cnn"},
    "seed": 11,
    "rounds": ROUNDS,
    "optimizer": OPT,
    "checkpoint_every": 2,
}
PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [
        {"start": 0, "end": 4, "devices": [{"device": "a"}, {"device": "b"}]},
        {"start": 4, "end": 7, "devices": [{"device": "c"}]},
    ],
}
OUTAGE_S = 5.0


class KillableRedis:
    """A redis-server on a fixed port whose data survives a SIGKILL (AOF, fsync always)."""

    def __init__(self, data: Path) -> None:
        self.data, self.port = data, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10) -> None:
        self.data.mkdir(exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        log = (self.data / "redis.log").open("ab")
        self.proc = subprocess.Popen([redis_server_binary(), *args], stdout=log, stderr=log)
        log.close()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            assert wait_until_answers(client, self.proc, timeout_s), (
                f"redis-server did not start on port {self.port}"
            )
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[KillableRedis]:
    server = KillableRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _wait_for(what: str, check: Any, timeout_s: float, cluster: LocalCluster) -> Any:
    """Poll `check()` (Redis errors count as not yet) until truthy; bounded by `timeout_s`.

    A wait that runs out shows the coordinator's and the workers' logs: a job that
    never got going says why only there.
    """
    deadline = time.monotonic() + timeout_s
    coordinator = cluster.procs.get("coordinator")
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if value := check():
                return value
        if coordinator is not None and coordinator.poll() is not None:
            what = f"{what}, but the coordinator exited with {coordinator.returncode}"
            break
        time.sleep(0.05)
    logs = "\n".join(cluster.log_tail(name, 40) for name in sorted(cluster.procs))
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}\n{logs}")


def _cluster(tmp_path: Path, server: KillableRedis, budget: Any, outage_s: float) -> LocalCluster:
    cluster = LocalCluster(tmp_path, server.url, "outage", budget=budget)
    cluster.env["ASTEROID_REDIS_OUTAGE_S"] = str(outage_s)
    return cluster


def _events(cluster: LocalCluster, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in cluster.log_events(name) if e.get("event") == event]


def test_a_job_pauses_through_a_redis_outage_and_ends_with_the_reference_weights(
    tmp_path, own_redis, budget
):
    cluster = _cluster(tmp_path, own_redis, budget, outage_s=60)
    store = Store(own_redis.url, "outage")
    try:
        cluster.start_workers(["a", "b", "c"])
        cluster.start_coordinator(JOB, PLAN)
        _wait_for(
            "round 3 committed",
            lambda: store.get_fields("job", "outage").get("round", 0) >= 3,
            budget.left(120),
            cluster,
        )
        own_redis.kill()
        time.sleep(OUTAGE_S)
        assert cluster.procs["coordinator"].poll() is None, cluster.log_tail("coordinator")
        own_redis.start()
        code = cluster.wait("coordinator", 180)
        assert code == 0, cluster.log_tail("coordinator", 60)
        cluster.wait_workers_exit()
        weights = load_full_state(store, "outage", ROUNDS)
        metrics = store.read("metrics", "outage")
        state = store.get_fields("job", "outage")
    finally:
        cluster.close()
        store.close()
    # it waited for Redis, and went on when Redis was back
    waited = _events(cluster, "coordinator", "Redis unreachable; waiting for it")
    assert waited, cluster.log_tail("coordinator", 60)
    assert _events(cluster, "coordinator", "Redis is back")
    assert state["state"] == "finished"
    # every round committed exactly once, in order: none lost, none applied twice
    committed = [m for m in metrics if "loss" in m]
    assert [m["round"] for m in committed] == list(range(ROUNDS))
    ref, ref_losses = reference_train(JOB["model"], 11, 32, ROUNDS, OPT)
    assert_matches_reference(weights, ref)
    assert_losses_match([m["loss"] for m in committed], ref_losses)


def test_an_outage_longer_than_the_patience_fails_the_job_by_name_and_the_coordinator_stays(
    tmp_path, own_redis, budget
):
    cluster = _cluster(tmp_path, own_redis, budget, outage_s=3)
    store = Store(own_redis.url, "outage")
    try:
        cluster.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
        cluster.start_workers(["a", "b", "c"])
        cluster.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
        cluster.spawn("planner", ["-m", "services.planner.service"])
        cluster.spawn("coordinator", ["-m", "services.coordinator.main", "--bind", cluster.addr])
        _wait_for(
            "the workers to join",
            lambda: all(store.get_fields("device", d) for d in ("a", "b", "c")),
            budget.left(60),
            cluster,
        )
        job = {**JOB, "global_batch": 32, "micro_batch": 8, "rounds": 300}
        spec = SubmitJob.model_validate({"type": "submit_job", "job": job})
        reply = ask_coordinator(cluster.addr, spec, timeout_s=budget.left(30))
        assert reply.ok, reply.error
        _wait_for(
            "round 2 committed",
            lambda: store.get_fields("job", "outage").get("round", 0) >= 2,
            budget.left(180),
            cluster,
        )
        own_redis.kill()
        ended = _wait_for(
            "the job to fail",
            lambda: _events(cluster, "coordinator", "job ended"),
            budget.left(60),
            cluster,
        )
        assert "unreachable for" in ended[0]["error"] and "Redis at" in ended[0]["error"]
        time.sleep(1)  # still serving, not exited
        assert cluster.procs["coordinator"].poll() is None, cluster.log_tail("coordinator")
        # Redis comes back: the end state the outage held back is written, not left `running`
        own_redis.start()
        state = _wait_for(
            "the failed state in Redis",
            lambda: (f := store.get_fields("job", "outage")).get("state") == "failed" and f,
            budget.left(30),
            cluster,
        )
        assert "unreachable for" in state["error"]
        # and it serves on: a new job id is accepted
        again = SubmitJob.model_validate(
            {"type": "submit_job", "job": {**job, "job_id": "after", "rounds": 2}}
        )
        reply = ask_coordinator(cluster.addr, again, timeout_s=budget.left(30))
        assert reply.ok, reply.error
        _wait_for(
            "the next job to finish",
            lambda: store.get_fields("job", "after").get("state") == "finished",
            budget.left(120),
            cluster,
        )
    finally:
        cluster.close()
        store.close()
