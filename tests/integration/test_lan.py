"""The LAN path a newcomer takes: `asteroid join`, honest logs, Redis checked, releases named.

Real processes throughout: a coordinator on CURVE keys and a Redis with one
ACL user per role (`deploy/redis-acl.conf`); `asteroid join` given only the
coordinator's address and the key set (the Redis passwords in its `redis/`
folder) runs a worker that trains; SIGTERM stops it and the profiler. A worker
with no coordinator says so every few seconds; a coordinator whose Redis is
away or refuses its password exits with one line and a named code; a heartbeat
of another release is warned of once and shown by `asteroid status`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.codec import encode
from common.curve import COORDINATOR, CurveKeys, create_key_set
from common.exit_codes import ExitCode
from common.locate import password_file
from common.messages import Heartbeat
from common.ports import free_port
from common.secrets import mask_url
from common.sockets import connect_dealer
from common.store import Store
from common.version import VERSION
from tests.cluster import Budget, LocalCluster, marked_processes
from tests.integration.test_equivalence import SGD, stage
from tests.security.test_redis_credentials import AclRedis, acl_redis

__all__ = ["acl_redis"]  # the fixture, shared with the ACL tests

pytestmark = pytest.mark.integration

JOB = {"job_id": "lan", "model": {"name": "small_cnn"}, "seed": 7, "rounds": 2, "optimizer": SGD}
PLAN = {"global_batch": 32, "microbatches": 4, "stages": [stage(0, 7, "nano-1")]}
LOCATED = "learnt where Redis is from the coordinator"
MARK = "ASTEROID_TEST_LAN"
"""Environment variable marking what a test started, to find its grandchildren."""


def _without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def _wait_for(what: str, check: Any, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s:\n{log}")
        time.sleep(0.2)


def _device_keys(root: Path, acl: AclRedis) -> None:
    """A key set for one device, and the Redis passwords of its two roles."""
    create_key_set(root, workers=["nano-1"], services=["profiler-nano"])
    for user in ("worker", "profiler"):
        path = password_file(root, user)
        path.parent.mkdir(exist_ok=True)
        path.write_text(acl.passwords[user] + "\n")
        path.chmod(0o600)


def test_join_needs_only_the_coordinator_and_the_key_set(
    tmp_path: Path, acl_redis: AclRedis, budget: Budget
) -> None:
    name = f"lan-{uuid.uuid4().hex[:10]}"
    mark = uuid.uuid4().hex
    keys = tmp_path / "keys"
    _device_keys(keys, acl_redis)
    cluster = LocalCluster(tmp_path, acl_redis.url("coordinator"), name, budget=budget)
    try:
        cluster.spawn(
            "coordinator",
            [
                *("-m", "services.coordinator.main", "--bind", cluster.addr),
                *("--keys", str(keys), "--job", str(cluster.write("job.yaml", JOB))),
                *("--plan", str(cluster.write("plan.json", PLAN))),
            ],
        )
        # the device knows no Redis URL, cluster or device name: only the address and keys
        cluster.env = _without(
            cluster.env, "ASTEROID_REDIS_URL", "ASTEROID_CLUSTER", "ASTEROID_COORDINATOR"
        )
        cluster.env[MARK] = mark
        join = cluster.spawn(
            "join", ["-m", "services.cli", "join", cluster.addr, "--keys", str(keys)]
        )
        code = cluster.wait("coordinator", 240)
        assert code == ExitCode.OK, cluster.log_tail("coordinator", 60) + cluster.log_tail("join")
        admin = Store(acl_redis.url("admin"), name)
        try:
            assert admin.get_fields("job", "lan").get("state") == "finished"
            device = admin.get_fields("device", "nano-1")
            assert device.get("version") == VERSION  # `asteroid status` reads this
        finally:
            admin.close()
        events = _events(cluster.log("join"))
        located = [e for e in events if e.get("event") == LOCATED]
        assert len(located) == 2, cluster.log_tail("join", 60)  # the worker and the profiler
        assert {e["redis"] for e in located} == {
            mask_url(f"redis://{user}:x@127.0.0.1:{acl_redis.port}/0")
            for user in ("worker", "profiler")
        }
        assert {e["cluster"] for e in located} == {name}
        text = cluster.log("join") + cluster.log("coordinator")
        leaked = [role for role, pw in acl_redis.passwords.items() if pw in text]
        assert not leaked, f"the logs hold the Redis password of {leaked}"
        assert "another release" not in cluster.log("coordinator")
        children = {pid for pid in marked_processes(MARK, mark) if pid != join.pid}
        assert len(children) == 2, children  # the worker and the profiler, still serving

        join.send_signal(signal.SIGTERM)  # as a service manager stops it
        assert cluster.wait("join", 60) == ExitCode.INTERRUPTED, cluster.log_tail("join")
        assert "stopping the worker and the profiler" in cluster.log("join")
        assert not set(marked_processes(MARK, mark)) & children, cluster.log_tail("join")
        assert "Traceback" not in cluster.log("join"), cluster.log_tail("join", 60)
    finally:
        cluster.close()


def test_join_stops_the_profiler_when_the_worker_dies(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget
) -> None:
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    mark = uuid.uuid4().hex
    cluster.env[MARK] = mark
    try:
        nowhere = f"tcp://127.0.0.1:{free_port()}"
        # a worker that cannot start (its key is not in the set) dies at once
        keys = tmp_path / "keys"
        create_key_set(keys, services=["profiler-nano"])
        join = cluster.spawn(
            "join", ["-m", "services.cli", "join", nowhere, "--keys", str(keys), "--device", "x"]
        )
        assert cluster.wait("join", 120) == ExitCode.CONFIG, cluster.log_tail("join")
        log = cluster.log("join")
        assert "the worker exited with code 2; stopping the rest" in log, log
        assert not marked_processes(MARK, mark), log  # the profiler went with it
        assert join.returncode == ExitCode.CONFIG
    finally:
        cluster.close()


NOTES = {
    "no coordinator": "cannot reach the coordinator; still trying",
    "no coordinator, no Redis URL": "cannot reach the coordinator to learn where Redis is; "
    "still trying",
    "key refused": "cannot reach the coordinator; still trying",
}
"""The note a worker logs every few seconds, by what keeps it from its coordinator."""


@pytest.mark.parametrize("case", list(NOTES))
def test_a_worker_without_its_coordinator_says_so_every_few_seconds(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget, case: str
) -> None:
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    flags = ["--device", "w", "--coordinator", address]
    if case == "no coordinator, no Redis URL":
        cluster.env = _without(cluster.env, "ASTEROID_REDIS_URL")
    if case == "key refused":  # a coordinator there, whose key set lacks this worker's key
        create_key_set(tmp_path / "theirs")
        create_key_set(tmp_path / "mine", workers=["w"])
        public = tmp_path / "theirs" / "coordinator" / "coordinator.key"
        (tmp_path / "mine" / "coordinator" / "coordinator.key").write_bytes(public.read_bytes())
        args = ["--bind", address, "--keys", str(tmp_path / "theirs")]
        cluster.spawn("coordinator", ["-m", "services.coordinator.main", *args])
        flags += ["--keys", str(tmp_path / "mine")]
    try:
        cluster.spawn("w", ["-m", "services.worker.main", *flags])

        def notes() -> list[dict[str, Any]]:
            return [e for e in cluster.log_events("w") if e.get("event") == NOTES[case]]

        _wait_for("no two notes", lambda: len(notes()) >= 2, budget.left(90), cluster.log("w"))
        assert all(e["coordinator"] == address for e in notes())
        assert all(e["level"] == "warning" for e in notes())
        if case == "no coordinator":
            assert notes()[-1]["reason"].startswith("nothing accepts connections"), notes()
        if case == "key refused":
            assert notes()[-1]["reason"].startswith("the coordinator refused this worker's key")
        assert cluster.procs["w"].poll() is None  # still trying, not dead
    finally:
        cluster.close()  # SIGTERM must stop it within the grace, or this fails


@pytest.mark.parametrize("password", ["wrong", None])
def test_the_coordinator_refuses_to_start_with_wrong_redis_credentials(
    tmp_path: Path, acl_redis: AclRedis, budget: Budget, password: str | None
) -> None:
    auth = f"coordinator:{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{acl_redis.port}/0"
    cluster = LocalCluster(tmp_path, url, "creds", budget=budget)
    try:
        cluster.spawn("coordinator", ["-m", "services.coordinator.main", "--bind", cluster.addr])
        code = cluster.wait("coordinator", 90)
        out = cluster.log("coordinator")
        assert code == ExitCode.REDIS_UNAVAILABLE, out
        errors = [e for e in _events(out) if e.get("level") == "error"]
        assert len(errors) == 1, out
        assert errors[0]["event"] == "coordinator cannot start"
        assert "refused the coordinator's credentials" in errors[0]["error"], errors
        assert "Traceback" not in out
        assert not password or f":{password}@" not in out
    finally:
        cluster.close()


def test_the_coordinator_refuses_to_start_without_redis(
    tmp_path: Path, cluster_name: str, budget: Budget
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cluster = LocalCluster(tmp_path, url, cluster_name, budget=budget)
    try:
        cluster.spawn("coordinator", ["-m", "services.coordinator.main", "--bind", cluster.addr])
        code = cluster.wait("coordinator", 90)
        out = cluster.log("coordinator")
        assert code == ExitCode.REDIS_UNAVAILABLE, out
        errors = [e for e in _events(out) if e.get("level") == "error"]
        assert len(errors) == 1, out
        assert f"Redis at {url} does not answer" in errors[0]["error"]
        assert "Traceback" not in out
    finally:
        cluster.close()


def test_a_worker_of_another_release_is_warned_of_once_and_shown_by_status(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget
) -> None:
    keys = tmp_path / "keys"
    create_key_set(keys, workers=["old-1"], operators=["alice"])
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.spawn(
        "coordinator",
        ["-m", "services.coordinator.main", "--bind", cluster.addr, "--keys", str(keys)],
    )
    ctx: zmq.Context[Any] = zmq.Context()
    mine = CurveKeys.load(keys, "worker")
    # a worker speaking the wire itself, over CURVE with its own key
    sock = connect_dealer(
        ctx,
        cluster.addr,
        "old-1",
        keys=mine,
        server_key=mine.server_key("coordinator", COORDINATOR),
    )
    old = "0.0.1+old"
    beats = 5
    try:
        for _ in range(beats):
            hb = Heartbeat(device="old-1", data_addr="tcp://127.0.0.1:1", version=old)
            sock.send_multipart(encode(hb, "old-1"))

        def counted() -> int:
            counts = [
                e for e in cluster.log_events("coordinator") if e["event"] == "heartbeat counts"
            ]
            return sum(counts[-1][k] for k in ("joined", "write", "limited")) if counts else 0

        _wait_for(
            f"the coordinator did not count {beats} heartbeats",
            lambda: counted() >= beats,
            budget.left(90),
            cluster.log_tail("coordinator"),
        )
        warned = [
            e
            for e in cluster.log_events("coordinator")
            if e["event"] == "worker runs another release than the coordinator"
        ]
        assert len(warned) == 1, cluster.log_tail("coordinator")
        assert (warned[0]["worker"], warned[0]["worker_version"]) == ("old-1", old)
        assert warned[0]["coordinator_version"] == VERSION
        assert warned[0]["level"] == "warning"
        # the operator's CLI knows the coordinator and its key set, and learns Redis from it
        env = _without(cluster.env, "ASTEROID_REDIS_URL", "ASTEROID_CLUSTER")
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "status"],
            env={**env, "ASTEROID_KEYS": str(keys), "COLUMNS": "300"},
            capture_output=True,
            text=True,
            timeout=budget.left(120),
            check=False,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        row = next(line for line in status.stdout.splitlines() if "old-1" in line)
        assert old in row, status.stdout
    finally:
        sock.close(0)
        ctx.term()
        cluster.close()
