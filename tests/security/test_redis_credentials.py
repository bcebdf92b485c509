"""Redis credentials never travel to workers, and each role's Redis user is all it needs.

The attack: an Assign used to carry the coordinator's Redis URL, password
included, to every worker (and to anyone who could read the control plane), so
every worker could do anything the coordinator could, FLUSHALL included. Now a
worker uses only its own URL; `deploy/redis-acl.conf` documents one Redis user per
role. These tests load that very file into a real Redis, run a job with the
coordinator and the workers each on their own user, and check that a worker's
user is refused what a worker never does, so the documentation cannot rot.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import zmq
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.checkpoint import latest_round, load_full_state
from common.codec import Limits, encode, recv_message
from common.embedded_redis import redis_server_binary, wait_until_answers
from common.errors import ProtocolError
from common.job import JobSpec
from common.messages import PROTOCOL_VERSION, Assign
from common.plan import Plan
from common.ports import free_port
from common.procs import spawn, stop_all
from common.settings import CoordinatorSettings
from common.store import Store
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import SGD, stage

ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "redis-acl.conf"
PLACEHOLDER = re.compile(r"#SHA256_OF_([A-Z]+)_PASSWORD\b")
ROLES = ("coordinator", "worker", "planner", "profiler", "operator", "admin")
START_TIMEOUT_S = 10.0

JOB = {"job_id": "acl", "model": {"name": "small_cnn"}, "seed": 7, "rounds": 2, "optimizer": SGD}
STAGES = [stage(0, 3, "a"), stage(3, 7, "b")]
PLAN = {"global_batch": 32, "microbatches": 4, "stages": STAGES}


# --- what goes on the wire ------------------------------------------------------


def _assign() -> Assign:
    """An Assign with every field the coordinator fills in (`driver._assign`)."""
    plan = Plan.model_validate(PLAN)
    return Assign(
        epoch=1,
        job=JobSpec.model_validate(JOB),
        plan=plan,
        stage=plan.stage_of(plan.devices[0]),
        peers={str(d): f"tcp://127.0.0.1:{6000 + i}" for i, d in enumerate(plan.devices)},
        from_round=0,
        total_rounds=JOB["rounds"],
    )


def test_an_encoded_assign_holds_no_redis_url_or_password() -> None:
    password = secrets.token_hex(16)
    settings = CoordinatorSettings(
        redis_url=f"redis://coordinator:{password}@10.0.0.2:6379/0", cluster="edge-lab"
    )
    assert password in settings.redis_url  # what the coordinator holds, and keeps
    assert not {"store_url", "redis_url", "cluster"} & set(Assign.model_fields)
    wire = b"".join(bytes(frame) for frame in encode(_assign(), "coordinator"))
    assert b"redis://" not in wire
    assert password.encode() not in wire
    assert b"edge-lab" not in wire  # the worker's own settings name its cluster


def test_a_peer_speaking_the_previous_protocol_is_refused() -> None:
    """A mixed cluster fails loudly: an old coordinator's Assign (URL inside) is not read."""
    old = {
        "v": PROTOCOL_VERSION - 1,
        "sender": "old-coordinator",
        "id": 1,
        "t": 0.0,
        "msg": {"type": "assign", "store_url": "redis://x:y@h/0", "cluster": "c"},
        "tensors": [],
    }
    ctx: zmq.Context[Any] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://old-peer")
        dealer.setsockopt(zmq.IDENTITY, b"old-coordinator/0123456789abcdef")
        dealer.connect("inproc://old-peer")
        dealer.send(msgpack.packb(old, use_bin_type=True))
        assert router.poll(2000)
        with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION - 1} not supported"):
            recv_message(router, Limits(), routed=True)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


# --- a Redis with the documented users ---------------------------------------------


@dataclass
class AclRedis:
    """A throwaway Redis running `deploy/redis-acl.conf`, with a password per role."""

    port: int
    passwords: dict[str, str]

    def url(self, role: str) -> str:
        """The URL a service of `role` is configured with."""
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.port}/0"

    def client(self, role: str) -> redis.Redis:
        """A raw client logged in as `role`."""
        return redis.Redis.from_url(self.url(role), socket_connect_timeout=2, socket_timeout=10)


def acl_users(passwords: dict[str, str]) -> str:
    """The ACL file as `aclfile` takes it: hashes filled in, comments dropped (as it says)."""
    text = ACL_FILE.read_text()
    roles = {m.lower() for m in PLACEHOLDER.findall(text)}
    assert roles == set(ROLES), f"{ACL_FILE.name} names roles {sorted(roles)}, tests know {ROLES}"
    text = PLACEHOLDER.sub(
        lambda m: "#" + hashlib.sha256(passwords[m[1].lower()].encode()).hexdigest(), text
    )
    lines = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    return "\n".join(lines) + "\n"


def _wait_ready(server: AclRedis, proc: subprocess.Popen[bytes], log: Path) -> None:
    client = server.client("admin")
    try:
        if not wait_until_answers(client, proc, START_TIMEOUT_S):
            raise AssertionError(
                f"redis-server with {ACL_FILE.name} did not start:\n{log.read_text()}"
            )
    finally:
        client.close()


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """redis-server on a free loopback port with the documented users; always stopped."""
    tmp = tmp_path_factory.mktemp("acl-redis")
    server = AclRedis(free_port(), {role: f"{role}-{secrets.token_hex(12)}" for role in ROLES})
    users = tmp / "users.acl"
    users.write_text(acl_users(server.passwords))
    log = tmp / "redis.log"
    args = ["--port", str(server.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn([redis_server_binary(), *args, "--aclfile", str(users)], log=log)
    try:
        _wait_ready(server, proc, log)
        yield server
    finally:
        stop_all([proc])


# --- the documented users ------------------------------------------------------------


@pytest.mark.integration
def test_the_acl_file_does_not_load_while_a_password_is_left_unset(tmp_path: Path) -> None:
    """Loaded as the file says (included in redis.conf), a placeholder stops Redis at once."""
    proc = subprocess.run(
        [redis_server_binary(), str(ACL_FILE), "--port", str(free_port()), "--bind", "127.0.0.1"],
        capture_output=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode != 0
    assert b"password hash must be exactly 64 characters" in proc.stdout + proc.stderr


@pytest.mark.integration
def test_nobody_gets_in_without_a_user(acl_redis: AclRedis) -> None:
    anonymous = redis.Redis(
        port=acl_redis.port,
        socket_connect_timeout=2,
        socket_timeout=10,
        retry=Retry(NoBackoff(), 0),  # a refusal is final; no need to ask again
    )
    try:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    finally:
        anonymous.close()


WORKER_NEVER = {
    "flushall": ("FLUSHALL",),
    "config": ("CONFIG", "GET", "*"),
    "keys": ("KEYS", "*"),
    "acl": ("ACL", "LIST"),
    "script": ("EVAL", "return redis.call('FLUSHALL')", "0"),
    "shutdown": ("SHUTDOWN", "NOSAVE"),
    "delete a layer": ("DEL", "asteroid:c:ckpt:j:1:layer:0:manifest"),
    "read a job": ("HGETALL", "asteroid:c:job:j"),
    "read a plan": ("GET", "asteroid:c:plan:j"),
    "commit a checkpoint": ("SET", "asteroid:c:ckpt:j:latest", "9"),
    "forge a manifest": ("SET", "asteroid:c:ckpt:j:9:manifest", "{}"),
    "another prefix": ("GET", "other:c:ckpt:j:1:layer:0:manifest"),
    "publish": ("PUBLISH", "asteroid:c:ckpt:j:1:layer:0", "x"),
}


@pytest.mark.integration
@pytest.mark.parametrize("command", sorted(WORKER_NEVER))
def test_the_worker_user_is_refused_what_a_worker_never_does(
    acl_redis: AclRedis, command: str
) -> None:
    client = acl_redis.client("worker")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*WORKER_NEVER[command])
    finally:
        client.close()


# A role's Store calls as its service makes them (see the ACL file), and one it must not.
ROLE_CALLS = {
    "coordinator": (
        lambda s: (
            s.set_fields({"state": "submitted"}, "job", "j"),
            s.get_fields("job", "j"),
            s.r.zadd(s.key("jobs"), {"j": 1.0}),
            s.append("events", "j", {"event": "submitted"}),
            s.r.incr(s.key("epoch")),
            s.put_blob(b"w", "ckpt", "j", 0, "layer", 0),
            s.delete_prefix("ckpt", "j", ""),
            s.r.delete(s.key("job", "j")),
        ),
        lambda s: s.r.flushall(),
    ),
    "worker": (
        lambda s: (
            s.put_blob(b"w", "ckpt", "j", 1, "layer", 0),
            s.get_blob("ckpt", "j", 1, "layer", 0),
        ),
        lambda s: s.get_fields("job", "j"),
    ),
    "planner": (
        lambda s: (s.get_json("profile", "m:dev"), s.put_json({}, "plan", "j")),
        lambda s: s.set_fields({"state": "x"}, "job", "j"),
    ),
    "profiler": (
        lambda s: (
            s.get_json("profile", "m:dev"),
            s.put_json({}, "profile", "m:dev"),
            s.set_fields({"dev": 1.0}, "profiles", "m"),
        ),
        lambda s: s.put_json({}, "plan", "j"),
    ),
    "operator": (
        lambda s: (
            s.ping(),
            list(s.keys("device", "")),
            s.get_fields("job", "j"),
            s.read("metrics", "j"),
            s.get_blob("ckpt", "j", 1, "layer", 0),
            s.r.zrevrange(s.key("jobs"), 0, 49),
        ),
        lambda s: s.put_json({}, "jobspec", "j"),
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("role", sorted(ROLE_CALLS))
def test_each_service_user_may_make_its_calls_and_no_write_beyond(
    acl_redis: AclRedis, role: str
) -> None:
    allowed, refused = ROLE_CALLS[role]
    store = Store(acl_redis.url(role), f"roles-{uuid.uuid4().hex[:8]}")
    try:
        allowed(store)
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused(store)
    finally:
        store.close()


def _denials(admin: redis.Redis) -> list[dict[str, Any]]:
    """ACL LOG entries of the service users (not a library's optional client hello)."""
    entries: list[dict[str, Any]] = admin.acl_log()  # type: ignore[assignment]
    return [
        e
        for e in entries
        if e.get("username") != "admin" and not str(e.get("object", "")).startswith("client")
    ]


@pytest.mark.integration
def test_a_job_runs_with_a_user_per_role_and_no_password_is_logged(
    tmp_path: Path, acl_redis: AclRedis, budget: Budget
) -> None:
    name = f"acl-{uuid.uuid4().hex[:10]}"
    admin = acl_redis.client("admin")
    admin.acl_log_reset()
    cluster = LocalCluster(tmp_path, acl_redis.url("coordinator"), name, budget=budget)
    try:
        cluster.env["ASTEROID_REDIS_URL"] = acl_redis.url("worker")
        cluster.start_workers(["a", "b"])
        cluster.env["ASTEROID_REDIS_URL"] = acl_redis.url("coordinator")
        code = cluster.run(JOB, PLAN, timeout_s=120)
        # Workers decode strictly (extra fields refused), so a finished job also proves
        # that the real coordinator's Assign carried no Redis URL.
        assert code == 0, cluster.log_tail("coordinator", 60)
        cluster.wait_workers_exit()
        # every command each service issued was one its user may issue
        assert _denials(admin) == []
        for worker in ("a", "b"):
            started = [e for e in cluster.log_events(worker) if e.get("event") == "worker started"]
            assert started, cluster.log_tail(worker)
            assert started[0]["redis"].startswith("redis://worker:***@"), started[0]
        for log in ("coordinator", "a", "b"):
            text = cluster.log(log)
            leaked = [role for role, pw in acl_redis.passwords.items() if pw in text]
            assert not leaked, f"{log}.log holds the password of {leaked}"
        operator = Store(acl_redis.url("operator"), name)
        try:
            assert latest_round(operator, "acl") == JOB["rounds"]
            assert load_full_state(operator, "acl", JOB["rounds"])
        finally:
            operator.close()
    finally:
        admin.close()
        cluster.close()
