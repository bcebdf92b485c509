"""CURVE with a ZAP handler: only keys of the cluster's set, in the right role, get in.

Real sockets from `common.sockets` over TCP on loopback: the coordinator's
control ROUTER (workers, services and operators may connect) and a worker's
data ROUTER (only workers). Each attacker (no key, a key not in the set, a
key whose file was deleted, a valid key of the wrong role, a valid key under
another name's routing identity) is refused; the server sees the failed
handshake or the refused message, never the message itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from structlog.testing import capture_logs
from typer.testing import CliRunner
from zmq.utils.monitor import recv_monitor_message

from common.codec import Envelope, Limits, encode, recv_message
from common.curve import CurveKeys, create_key_set
from common.errors import ConfigError, ProtocolError
from common.exit_codes import ExitCode
from common.ids import DeviceId
from common.messages import CancelJob, Heartbeat, JobReply
from common.settings import CoordinatorSettings
from common.sockets import bind_router, connect_dealer
from common.store import Store
from services.cli import app
from services.coordinator.service import Coordinator
from tests.cluster import Budget, LocalCluster

WAIT_S = 10.0
"""Bound on every wait for a handshake result or a message."""

FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

CONTROL = ("coordinator", "coordinator", ("worker", "service", "operator"))
DATA = ("worker", "w1", ("worker",))
"""Server sockets under test: (role, name of the server's pair, roles admitted)."""

JOB = {
    "job_id": "curve",
    "model": {"name": "mlp", "options": {"hidden": 16, "depth": 2}},
    "seed": 1,
    "rounds": 2,
    "dataset": {"kind": "synthetic", "eval_size": 8},
}
PIPELINE = {
    "global_batch": 8,
    "microbatches": 2,
    "stages": [
        {"start": 0, "end": 2, "devices": [{"device": "a", "share": 1}]},
        {"start": 2, "end": 3, "devices": [{"device": "b", "share": 1}]},
    ],
}
"""A two-stage pipeline, so activations and gradients cross the data plane both ways."""


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    create_key_set(root, workers=["w1", "w2"], services=["planner"], operators=["alice"])
    return root


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Server:
    """A CURVE ROUTER from `bind_router` with a monitor for failed handshakes."""

    def __init__(self, ctx: zmq.Context[Any], keydir: Path, which: tuple[Any, ...]) -> None:
        role, name, roles = which
        self.keys = CurveKeys.load(keydir, role, name)
        self.sock, self.endpoint = bind_router(
            ctx, "tcp://127.0.0.1:0", Limits(), keys=self.keys, roles=roles
        )
        self.monitor = self.sock.get_monitor_socket(FAILED)

    def handshake_failed(self) -> bool:
        """True once the server reports a failed handshake (bounded wait)."""
        if not self.monitor.poll(int(WAIT_S * 1000)):
            return False
        event = recv_monitor_message(self.monitor)
        return bool(event["event"] & FAILED)

    def receive(self) -> tuple[str, Envelope]:
        """The next message (bounded wait); fails the test if none comes."""
        assert self.sock.poll(int(WAIT_S * 1000)), "no message reached the server"
        return recv_message(self.sock, Limits(), routed=True)

    def nothing_waiting(self) -> bool:
        return not self.sock.poll(0)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def heartbeat(device: str) -> list[bytes]:
    return encode(Heartbeat(device=DeviceId(device), data_addr="tcp://127.0.0.1:1"), device)


def client(
    ctx: zmq.Context[Any], server: Server, keys: CurveKeys | None, identity: str
) -> zmq.Socket[Any]:
    if keys is None:
        return connect_dealer(ctx, server.endpoint, identity, send_timeout_s=WAIT_S)
    return connect_dealer(
        ctx, server.endpoint, identity, WAIT_S, keys=keys, server_key=server.keys.public
    )


def foreign_keys(tmp_path: Path, role: str, name: str) -> CurveKeys:
    """A well-formed pair of the right role and name that is not in the cluster's set."""
    other = tmp_path / "other"
    create_key_set(other, workers=[name] if role == "worker" else [])
    return CurveKeys.load(other, role, name)


@pytest.mark.parametrize("which", [CONTROL, DATA], ids=["control", "data"])
def test_valid_key_passes_with_its_name_and_role(
    ctx: zmq.Context[Any], keydir: Path, which: tuple[Any, ...]
) -> None:
    server = Server(ctx, keydir, which)
    try:
        sock = client(ctx, server, CurveKeys.load(keydir, "worker", "w2"), "w2")
        sock.send_multipart(heartbeat("w2"))
        peer, env = server.receive()
        assert (peer, env.user) == ("w2", "worker:w2")
        assert isinstance(env.msg, Heartbeat)
        sock.close(0)
    finally:
        server.close()


@pytest.mark.parametrize("which", [CONTROL, DATA], ids=["control", "data"])
@pytest.mark.parametrize("attacker", ["no key", "unknown key", "revoked key"])
def test_attacker_is_refused_at_the_handshake(
    ctx: zmq.Context[Any], keydir: Path, tmp_path: Path, which: tuple[Any, ...], attacker: str
) -> None:
    server = Server(ctx, keydir, which)
    try:
        keys: CurveKeys | None = None
        if attacker == "unknown key":
            keys = foreign_keys(tmp_path, "worker", "w2")
        elif attacker == "revoked key":
            keys = CurveKeys.load(keydir, "worker", "w2")
            (keydir / "workers" / "w2.key").unlink()  # revoked while the server runs
        sock = client(ctx, server, keys, "w2")
        # a handshake refused before this send leaves no pipe to queue on: EAGAIN
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(heartbeat("w2"), zmq.NOBLOCK)
        assert server.handshake_failed()
        assert server.nothing_waiting()
        sock.close(0)
    finally:
        server.close()


def test_revocation_takes_effect_without_restart(ctx: zmq.Context[Any], keydir: Path) -> None:
    server = Server(ctx, keydir, DATA)
    try:
        keys = CurveKeys.load(keydir, "worker", "w2")
        first = client(ctx, server, keys, "w2")
        first.send_multipart(heartbeat("w2"))
        assert server.receive()[0] == "w2"
        (keydir / "workers" / "w2.key").unlink()
        second = client(ctx, server, keys, "w2")
        with contextlib.suppress(zmq.Again):  # refused already: no pipe to queue on
            second.send_multipart(heartbeat("w2"), zmq.NOBLOCK)
        assert server.handshake_failed()
        assert server.nothing_waiting()
        first.close(0)
        second.close(0)
    finally:
        server.close()


def test_data_socket_refuses_a_valid_key_of_another_role(
    ctx: zmq.Context[Any], keydir: Path
) -> None:
    server = Server(ctx, keydir, DATA)
    try:
        for role, name in (("operator", "alice"), ("service", "planner")):
            sock = client(ctx, server, CurveKeys.load(keydir, role, name), name)
            sock.send_multipart(heartbeat(name), zmq.NOBLOCK)
            assert server.handshake_failed(), f"{role} {name} was not refused"
            assert server.nothing_waiting()
            sock.close(0)
    finally:
        server.close()


@pytest.mark.parametrize("which", [CONTROL, DATA], ids=["control", "data"])
def test_identity_spoofing_is_refused(
    ctx: zmq.Context[Any], keydir: Path, which: tuple[Any, ...]
) -> None:
    """w2's key under w1's routing identity: refused, naming both; w1 itself still gets in."""
    server = Server(ctx, keydir, which)
    try:
        spoof = client(ctx, server, CurveKeys.load(keydir, "worker", "w2"), "w1")
        spoof.send_multipart(heartbeat("w1"))
        with pytest.raises(ProtocolError, match=r"'w1'.*'w2'"):
            server.receive()
        honest = client(ctx, server, CurveKeys.load(keydir, "worker", "w1"), "w1/session")
        honest.send_multipart(heartbeat("w1"))
        assert server.receive()[1].user == "worker:w1"
        spoof.close(0)
        honest.close(0)
    finally:
        server.close()


def test_keys_init_makes_the_set_with_private_secrets(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    args = ["keys", "init", str(root), "--worker", "w1", "--worker", "w2"]
    result = CliRunner().invoke(app, [*args, "--service", "planner", "--operator", "alice"])
    assert result.exit_code == 0, result.output
    for rel in ("coordinator/coordinator", "workers/w1", "workers/w2"):
        secret = root / f"{rel}.key_secret"
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        assert zmq.auth.load_certificate(str(root / f"{rel}.key"))[1] is None
    assert (root / "services/planner.key").is_file()
    assert (root / "operators/alice.key_secret").is_file()
    before = (root / "workers/w1.key").read_bytes()
    again = CliRunner().invoke(app, ["keys", "init", str(root), "--worker", "w3"])
    assert again.exit_code == 0, again.output
    assert (root / "workers/w1.key").read_bytes() == before  # existing pairs are kept
    assert (root / "workers/w3.key_secret").is_file()


def test_bad_key_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must match"):
        create_key_set(tmp_path, workers=["../etc"])
    with pytest.raises(ConfigError, match="both worker and operator"):
        create_key_set(tmp_path, workers=["x"], operators=["x"])


def _pump_until(coord: Coordinator, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        coord.pump(0.05)


def test_coordinator_takes_each_message_only_from_its_role(
    ctx: zmq.Context[Any], keydir: Path, redis_url: str, cluster_name: str
) -> None:
    """A worker key cannot cancel jobs, an operator key cannot join as a worker."""
    settings = CoordinatorSettings(
        bind="tcp://127.0.0.1:0", redis_url=redis_url, cluster=cluster_name, keys=keydir
    )
    coord = Coordinator(settings)
    server = CurveKeys.load(keydir, "coordinator").public
    try:
        worker = connect_dealer(
            ctx,
            coord.endpoint,
            "w1",
            keys=CurveKeys.load(keydir, "worker", "w1"),
            server_key=server,
        )
        operator = connect_dealer(
            ctx,
            coord.endpoint,
            "alice",
            keys=CurveKeys.load(keydir, "operator"),
            server_key=server,
        )
        with capture_logs() as logs:
            worker.send_multipart(encode(CancelJob(job_id="job-1"), "w1"))
            operator.send_multipart(
                encode(Heartbeat(device="alice", data_addr="tcp://x:1"), "alice")
            )
            _pump_until(coord, lambda: coord.bad_messages == 2, "both refusals")
        reasons = [
            e["reason"] for e in logs if e["event"] == "dropped message outside its key's role"
        ]
        cancel = "cancel_job from worker key 'worker:w1': expected a key of role operator"
        # two connections: which one's message the ROUTER reads first is not defined
        assert sorted(reasons) == [
            cancel,
            "heartbeat from operator key 'operator:alice': expected a key of role worker",
        ]
        assert coord.members == {}
        # the cancel was never looked at; its sender is told why
        _, env = recv_message(worker, Limits())
        assert isinstance(env.msg, JobReply) and not env.msg.ok
        assert env.msg.error == cancel
        # the right roles get through
        operator.send_multipart(encode(CancelJob(job_id="job-1"), "alice"))
        worker.send_multipart(encode(Heartbeat(device="w1", data_addr="tcp://x:1"), "w1"))
        _pump_until(coord, lambda: "w1" in coord.members and bool(operator.poll(0)), "both")
        _, env = recv_message(operator, Limits())
        assert isinstance(env.msg, JobReply) and env.msg.job_id == "job-1"
        worker.close(0)
        operator.close(0)
    finally:
        coord.close()


def test_coordinator_beyond_loopback_without_keys_refuses_to_start(
    redis_url: str, cluster_name: str
) -> None:
    """A real coordinator process asked to bind every interface without keys exits at once."""
    env = {**os.environ, "ASTEROID_REDIS_URL": redis_url, "ASTEROID_CLUSTER": cluster_name}
    env.pop("ASTEROID_KEYS", None)
    code = "from services.coordinator.main import main; main()"
    args = ["--bind", "tcp://0.0.0.0:0", "--log-format", "json"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == ExitCode.CONFIG, done.stderr
    events = [
        json.loads(line)
        for line in (done.stdout + done.stderr).splitlines()
        if line.startswith("{")
    ]
    refusal = [e for e in events if e.get("event") == "coordinator cannot start"]
    assert len(refusal) == 1, done.stdout + done.stderr
    assert "tcp://0.0.0.0:0 without CURVE keys" in refusal[0]["error"]
    assert "asteroid keys init" in refusal[0]["error"]
    # loopback without keys still starts (the quick start and the suite rely on it)
    coord = Coordinator(
        CoordinatorSettings(bind="tcp://127.0.0.1:0", redis_url=redis_url, cluster=cluster_name)
    )
    coord.close()


def _wait_logged(cluster: LocalCluster, name: str, event: str) -> None:
    deadline = time.monotonic() + WAIT_S * 6
    while not any(e.get("event") == event for e in cluster.log_events(name)):
        assert time.monotonic() < deadline, f"{name} did not log {event!r}:\n{cluster.log(name)}"
        time.sleep(0.1)


@pytest.mark.integration
def test_a_job_runs_with_every_socket_on_curve_and_a_keyless_worker_never_joins(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget
) -> None:
    """Real coordinator and worker processes with --keys: control and data plane over CURVE.

    A worker started without its key is not admitted, so a job naming it fails
    at the join timeout; once it runs with its key, a two-stage job (the data
    plane used both ways, each worker a CURVE server with its own pair) ends
    as it does without keys.
    """
    keydir = tmp_path / "keys"
    create_key_set(keydir, workers=["a", "b"])
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    cluster.env["ASTEROID_JOIN_TIMEOUT_S"] = "3"
    store = Store(redis_url, cluster_name)
    try:
        cluster.start_workers(["b"])  # no ASTEROID_KEYS: a plain ZeroMQ client
        cluster.env["ASTEROID_KEYS"] = str(keydir)
        cluster.start_workers(["a"])
        for name in ("a", "b"):
            _wait_logged(cluster, name, "worker started")
        code = cluster.run({**JOB, "job_id": "keyless"}, PIPELINE, timeout_s=90)
        assert code == ExitCode.JOB_FAILED, cluster.log("coordinator")
        error = store.get_fields("job", "keyless")["error"]
        assert error == "workers ['b'] did not join within 3 s (joined: ['a'])"

        cluster.wait("a", 30)  # told to exit by the coordinator (--shutdown-workers)
        cluster.procs["b"].terminate()
        cluster.wait("b", 30)
        cluster.start_workers(["a", "b"])  # now both with their keys
        cluster.env["ASTEROID_JOIN_TIMEOUT_S"] = "60"
        code = cluster.run(JOB, PIPELINE, timeout_s=180)
        assert code == ExitCode.OK, cluster.log("coordinator")
        assert store.get_fields("job", "curve")["state"] == "finished"
    finally:
        store.close()
        cluster.close()
