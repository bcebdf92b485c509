"""No key takes another's connection, and one worker key is one device.

Real CURVE sockets on loopback. ZeroMQ's ROUTER hands a routing identity over
to whichever connection presents it last (ROUTER_HANDOVER), before any key is
checked; so every route carries a nonce only its own DEALER knows, and a peer
that names another's route — a bare name, or a guessed nonce — is refused
while the real holder keeps its connection: on the coordinator (probes and
shutdowns still reach the worker) and on a worker's data socket (the
pipeline neighbour's parts still arrive).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.codec import Limits, encode, recv_message
from common.curve import CurveKeys, create_key_set
from common.errors import ProtocolError
from common.ids import DeviceId
from common.messages import Activation, Heartbeat, Probe, Shutdown
from common.settings import CoordinatorSettings
from common.sockets import bind_router, connect_dealer
from services.coordinator.service import Coordinator

WAIT_S = 10.0
STOLEN = [b"b", b"b/" + b"0" * 16, b"b/0123456789abcdef"]
"""Identities an attacker may present for device b: its bare name and guessed nonces."""


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    create_key_set(root, workers=["b", "c", "e"], operators=["alice"])
    return root


class _Context(zmq.Context[Any]):
    """A context that keeps its sockets, so the fixture closes each (none is left to GC)."""

    opened: list[Any]

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "opened", [])

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        sock = super().socket(*args, **kwargs)
        self.opened.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context = _Context()
    yield context
    for sock in context.opened:
        sock.close(0)
    context.term()


@pytest.fixture
def coord(keydir: Path, redis_url: str, cluster_name: str) -> Iterator[Coordinator]:
    """A coordinator with CURVE on loopback, pumped by the test itself."""
    settings = CoordinatorSettings(
        bind="tcp://127.0.0.1:0", redis_url=redis_url, cluster=cluster_name, keys=keydir
    )
    coordinator = Coordinator(settings)
    yield coordinator
    coordinator.close()


def _raw_dealer(
    ctx: zmq.Context[Any], addr: str, identity: bytes, keys: CurveKeys, server: bytes
) -> zmq.Socket[Any]:
    """A CURVE DEALER presenting exactly `identity`, as a hand-made client can."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _until(pump: Callable[[], None], done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pump()


def _next(sock: zmq.Socket[Any], timeout_s: float) -> Any:
    """The next message `sock` receives within `timeout_s`, else None."""
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return None
    return recv_message(sock, Limits())[1].msg


def _beat(device: str) -> list[Any]:
    return encode(Heartbeat(device=device, data_addr="tcp://127.0.0.1:9"), device)


@pytest.mark.parametrize("role", ["operator", "worker"])
def test_another_key_cannot_take_a_workers_control_route(
    ctx: zmq.Context[Any], keydir: Path, coord: Coordinator, role: str
) -> None:
    """Alice (operator) or worker e connect as b: the coordinator's commands still reach b."""
    server = CurveKeys.load(keydir, "coordinator").public
    thief_keys = CurveKeys.load(keydir, role, "alice" if role == "operator" else "e")
    b = connect_dealer(
        ctx, coord.endpoint, "b", keys=CurveKeys.load(keydir, "worker", "b"), server_key=server
    )
    b.send_multipart(_beat("b"))
    _until(lambda: coord.pump(0.05), lambda: "b" in coord.members, "b to join")
    thieves = [_raw_dealer(ctx, coord.endpoint, i, thief_keys, server) for i in STOLEN]
    for thief in thieves:
        thief.send_multipart(_beat("b"))
    bad = coord.bad_messages
    _until(lambda: coord.pump(0.05), lambda: coord.bad_messages >= bad + 3, "refusals")
    coord.send(DeviceId("b"), Probe(nonce=7))
    coord.send(DeviceId("b"), Shutdown(reason="test"))
    assert _next(b, WAIT_S) == Probe(nonce=7)
    assert _next(b, WAIT_S) == Shutdown(reason="test")
    assert all(_next(t, 0.3) is None for t in thieves)  # nothing meant for b went astray


def test_one_worker_key_is_one_device(
    ctx: zmq.Context[Any], keydir: Path, coord: Coordinator
) -> None:
    """Worker key e heartbeating as e/0 ... e/49 registers no device; as e it is one."""
    server = CurveKeys.load(keydir, "coordinator").public
    keys = CurveKeys.load(keydir, "worker", "e")
    socks = [
        connect_dealer(ctx, coord.endpoint, f"e/{i}", keys=keys, server_key=server)
        for i in range(50)
    ]
    for i, sock in enumerate(socks):
        sock.send_multipart(_beat(f"e/{i}"))
    _until(lambda: coord.pump(0.05), lambda: coord.bad_messages >= 50, "50 refusals")
    assert not coord.members
    socks[0].send_multipart(_beat("e"))  # a session of key e speaking for device e
    e = connect_dealer(ctx, coord.endpoint, "e", keys=keys, server_key=server)
    e.send_multipart(_beat("e"))
    _until(lambda: coord.pump(0.05), lambda: "e" in coord.members, "e to join")
    assert set(coord.members) == {"e"}


def test_another_key_cannot_cut_a_data_link(ctx: zmq.Context[Any], keydir: Path) -> None:
    """Worker e connects to c's data socket as b: b's parts still arrive at c, e's never do."""
    c_keys = CurveKeys.load(keydir, "worker", "c")
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), keys=c_keys)
    try:
        b = connect_dealer(
            ctx, endpoint, "b", keys=CurveKeys.load(keydir, "worker", "b"), server_key=c_keys.public
        )
        e_keys = CurveKeys.load(keydir, "worker", "e")
        part = Activation(epoch=1, round=0, mb=0, stage=1, lo=0, hi=1)
        b.send_multipart(encode(part, "b"))
        assert router.poll(int(WAIT_S * 1000))
        peer, _ = recv_message(router, Limits(), routed=True)
        assert peer == "b"
        thieves = [_raw_dealer(ctx, endpoint, i, e_keys, c_keys.public) for i in STOLEN]
        for thief in thieves:
            thief.send_multipart(encode(part, "b"))
        got: list[str] = []
        refused = 0
        for mb in range(1, 21):
            b.send_multipart(encode(part.model_copy(update={"mb": mb}), "b"))
        deadline = time.monotonic() + WAIT_S
        while len(got) < 20 and time.monotonic() < deadline:
            if not router.poll(100):
                continue
            try:
                peer, env = recv_message(router, Limits(), routed=True)
            except ProtocolError:
                refused += 1
                continue
            assert peer == "b" and env.user == "worker:b"
            got.append(peer)
        assert len(got) == 20, f"b's parts after the attack: {len(got)} of 20"
        assert refused <= len(STOLEN)
    finally:
        router.close(0)


def test_a_reconnecting_peer_takes_back_its_own_route(
    ctx: zmq.Context[Any], keydir: Path, coord: Coordinator
) -> None:
    """A restarted worker (a new connection, a new nonce) is reachable at once."""
    server = CurveKeys.load(keydir, "coordinator").public
    keys = CurveKeys.load(keydir, "worker", "b")
    old = connect_dealer(ctx, coord.endpoint, "b", keys=keys, server_key=server)
    old.send_multipart(_beat("b"))
    _until(lambda: coord.pump(0.05), lambda: "b" in coord.members, "b to join")
    old.close(0)
    new = connect_dealer(ctx, coord.endpoint, "b", keys=keys, server_key=server)
    new.send_multipart(_beat("b"))
    route = coord.routes["b"]
    _until(lambda: coord.pump(0.05), lambda: coord.routes["b"] != route, "the new route")
    nonce = secrets.randbelow(1 << 30) + 1
    coord.send(DeviceId("b"), Probe(nonce=nonce))
    assert _next(new, WAIT_S) == Probe(nonce=nonce)
