"""`asteroid doctor` against real processes: a healthy cluster, wrong keys, Redis away.

A real coordinator on CURVE keys and a Redis with one ACL user per role
(`deploy/redis-acl.conf`), as on a LAN; `asteroid doctor --json` runs as a
person runs it, in its own process, given only the coordinator's address and
the device's key set (Redis's place comes from the coordinator, the worker's
password from the set). Healthy: exit 0, and the clock offset to a
coordinator on this same host is within its own measured uncertainty of 0.
A key set of another cluster, a key the coordinator lacks, a wrong Redis
password and a Redis that is not there: exit 1, the problem named with its fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.curve import create_key_set
from common.exit_codes import ExitCode
from common.locate import password_file
from common.ports import free_port
from tests.cluster import Budget, LocalCluster
from tests.security.test_redis_credentials import AclRedis, acl_redis

__all__ = ["acl_redis"]  # the fixture, shared with the ACL tests

pytestmark = pytest.mark.integration

DOCTOR_S = 60.0
"""Bound on one doctor run: importing torch on a loaded machine, then checks of 2 s each."""
READY = "coordinator listening"


def _device_keys(root: Path, acl: AclRedis, password: str | None = None) -> None:
    """A key set holding worker nano-1 and its Redis password (`password`: a wrong one)."""
    create_key_set(root, workers=["nano-1"])
    path = password_file(root, "worker")
    path.parent.mkdir(exist_ok=True)
    path.write_text((password or acl.passwords["worker"]) + "\n")
    path.chmod(0o600)


@pytest.fixture
def coordinator(
    tmp_path: Path, acl_redis: AclRedis, cluster_name: str, budget: Budget
) -> Iterator[LocalCluster]:
    """A coordinator on the key set tmp_path/keys, its Redis the ACL one; stopped after."""
    keys = tmp_path / "keys"
    _device_keys(keys, acl_redis)
    cluster = LocalCluster(tmp_path, acl_redis.url("coordinator"), cluster_name, budget=budget)
    cluster.spawn(
        "coordinator",
        ["-m", "services.coordinator.main", "--bind", cluster.addr, "--keys", str(keys)],
    )
    try:
        deadline = time.monotonic() + budget.left(90)
        while not any(e.get("event") == READY for e in cluster.log_events("coordinator")):
            if cluster.procs["coordinator"].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no coordinator ready:\n{cluster.log_tail('coordinator')}")
            time.sleep(0.2)
        yield cluster
    finally:
        cluster.close()


def doctor(*args: str) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]]]:
    """Run `asteroid doctor --json ARGS` as a device would: (exit code, report, rows by name).

    No ASTEROID_* variable reaches it, so only the flags say where things are.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=DOCTOR_S,
    )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"not JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        ) from None
    return proc.returncode, report, {c["name"]: c for c in report["checks"]}


def _ports() -> list[str]:
    return ["--data-port", str(free_port()), "--link-port", str(free_port())]


def test_a_healthy_device_is_all_ok_and_exits_zero(
    coordinator: LocalCluster, tmp_path: Path
) -> None:
    code, report, rows = doctor(
        "--coordinator", coordinator.addr, "--keys", str(tmp_path / "keys"), *_ports()
    )
    assert code == ExitCode.OK, json.dumps(report, indent=1)
    assert report["healthy"] is True
    assert {c["status"] for c in report["checks"]} <= {"ok", "note"}
    assert rows["keys"]["data"] == {"role": "worker", "name": "nano-1"}
    # Redis as the coordinator says, logged in as the worker with the set's password
    assert rows["redis"]["data"]["user"] == "worker"
    assert rows["redis"]["data"]["url"].startswith("redis://worker:***@127.0.0.1:")
    # one host, one clock: the true offset is 0, and the measured one is within its bound
    clock = rows["clock"]["data"]
    assert clock["source"] == "coordinator"
    assert abs(clock["offset_s"]) <= clock["uncertainty_s"]
    assert rows["data port"]["data"]["free"] is True
    assert rows["machine"]["data"]["arch"]


def test_a_key_set_of_another_cluster_is_named_with_its_fix(
    coordinator: LocalCluster, tmp_path: Path, acl_redis: AclRedis
) -> None:
    other = tmp_path / "other"
    _device_keys(other, acl_redis)  # its own coordinator pair: the wrong server key
    code, report, rows = doctor("--coordinator", coordinator.addr, "--keys", str(other), *_ports())
    assert code == ExitCode.DEVICE_FAILED
    assert report["healthy"] is False
    assert rows["coordinator"]["status"] == "ok"  # it is there: only the keys are wrong
    keys = rows["keys"]
    assert keys["status"] == "problem"
    assert "is not this coordinator's" in keys["summary"]
    assert keys["fix"].startswith(
        f"scp 127.0.0.1:KEYS/coordinator/coordinator.key {other}/coordinator/coordinator.key"
    )
    assert rows["redis"]["status"] == "skipped"  # the coordinator could not say where it is


def test_a_key_the_coordinator_lacks_is_named_with_its_fix(
    coordinator: LocalCluster, tmp_path: Path, acl_redis: AclRedis
) -> None:
    mine = tmp_path / "mine"
    _device_keys(mine, acl_redis)
    # the cluster's coordinator key, so the handshake reaches the coordinator's key check
    shutil.copy(tmp_path / "keys/coordinator/coordinator.key", mine / "coordinator")
    code, _, rows = doctor("--coordinator", coordinator.addr, "--keys", str(mine), *_ports())
    assert code == ExitCode.DEVICE_FAILED
    assert rows["keys"]["status"] == "problem"
    assert "refused this device's key (worker:nano-1)" in rows["keys"]["summary"]
    assert rows["keys"]["fix"].startswith(f"scp {mine}/workers/nano-1.key 127.0.0.1:KEYS/workers/")


def test_a_wrong_redis_password_is_a_refused_login(
    coordinator: LocalCluster, tmp_path: Path, acl_redis: AclRedis
) -> None:
    password_file(tmp_path / "keys", "worker").write_text("not-the-password\n")
    code, _, rows = doctor(
        "--coordinator", coordinator.addr, "--keys", str(tmp_path / "keys"), *_ports()
    )
    assert code == ExitCode.DEVICE_FAILED
    assert rows["keys"]["status"] == "ok"
    redis_row = rows["redis"]
    assert redis_row["status"] == "problem"
    assert "refused the login as worker" in redis_row["summary"]
    assert "KEYS/redis/worker.password" in redis_row["fix"]
    assert "not-the-password" not in json.dumps(rows)


def test_a_redis_that_is_not_there_is_named_and_the_rest_still_checked(
    coordinator: LocalCluster, tmp_path: Path
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    code, report, rows = doctor(
        "--coordinator",
        coordinator.addr,
        "--keys",
        str(tmp_path / "keys"),
        "--redis-url",
        nowhere,
        *_ports(),
    )
    assert code == ExitCode.DEVICE_FAILED
    assert report["problems"] == 1
    redis_row = rows["redis"]
    assert redis_row["status"] == "problem"
    assert f"Redis at {nowhere} does not answer" in redis_row["summary"]
    assert "systemctl start redis-server" in redis_row["fix"]
    assert rows["coordinator"]["status"] == rows["keys"]["status"] == "ok"
    assert rows["clock"]["data"]["source"] == "coordinator"


def test_nothing_there_at_all_is_told_apart_and_redis_gives_the_time(redis_url: str) -> None:
    """No coordinator listening, a Redis configured directly: its TIME is the clock's reference."""
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    code, _, rows = doctor("--coordinator", nowhere, "--redis-url", redis_url, *_ports())
    assert code == ExitCode.DEVICE_FAILED
    assert rows["coordinator"]["status"] == "problem"
    assert "connection refused" in rows["coordinator"]["summary"]
    assert rows["keys"]["status"] == "skipped"
    assert rows["redis"]["status"] == "ok"
    clock = rows["clock"]["data"]
    assert clock["source"] == "redis"
    assert abs(clock["offset_s"]) <= clock["uncertainty_s"]  # one host: one clock
