"""Signals over a real ROUTER: the control socket's monitor names the peer whose connection
closed (with and without CURVE), `gather` declares such a device lost with a reason that
names the closed connection well before its heartbeats are overdue, a peer that reconnects
within the grace is none, and a neighbour's PeerDown is checked before it counts."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from common.codec import Limits, encode, recv_message
from common.curve import COORDINATOR, CurveKeys, create_key_set
from common.ids import DeviceId
from common.messages import Heartbeat, PeerDown, Probe, RoundDone
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from services.coordinator.jobs import DeviceLost, JobFailed
from services.coordinator.service import Coordinator

B, C = DeviceId("b"), DeviceId("c")
EPOCH = 3
SLOW_BEATS = {"heartbeat_s": 5.0, "heartbeat_misses": 6}
"""Heartbeats overdue only after 30 s: within the waits below, only a signal can lose a device."""


DATA_ADDR = "tcp://127.0.0.1:1"
"""The workers' data address: a port that listens (`_listening`), so that a closed control
connection below is a link's, not a dead process's (whose refused port is its own test)."""


@pytest.fixture(autouse=True, scope="module")
def _listening() -> Iterator[None]:
    global DATA_ADDR
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        DATA_ADDR = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        yield


def hb(device: str) -> Heartbeat:
    return Heartbeat(device=DeviceId(device), data_addr=DATA_ADDR)


def settings(redis_url: str, cluster_name: str, **extra: Any) -> CoordinatorSettings:
    return CoordinatorSettings(
        bind=f"tcp://127.0.0.1:{free_port()}",
        redis_url=redis_url,
        cluster=cluster_name,
        probe_timeout_s=0.5,
        flap_grace_s=0.5,
        derive_timeouts=False,  # the bounds as set: the waits below know what to expect
        **{**SLOW_BEATS, **extra},
    )


@pytest.fixture
def ctx():
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def coord(redis_url, cluster_name):
    coordinator = Coordinator(settings(redis_url, cluster_name))
    yield coordinator
    coordinator.close()


def _joined(coord: Coordinator, *devices: str) -> None:
    deadline = time.monotonic() + 10
    while not all(d in coord.members for d in devices):
        assert time.monotonic() < deadline, f"{devices} did not join"
        coord.pump(0.05)


def _dealer(ctx: zmq.Context[Any], coord: Coordinator, device: str) -> zmq.Socket[Any]:
    sock = connect_dealer(ctx, coord.endpoint, device)
    sock.send_multipart(encode(hb(device), device))
    return sock


def _closed(coord: Coordinator, within_s: float = 10.0) -> list[DeviceId]:
    deadline = time.monotonic() + within_s
    while not coord.control.closed:
        assert time.monotonic() < deadline, "no closed connection reported"
        coord.pump(0.05)
    return [peer for peer, _ in coord.control.closed]


def test_the_monitor_names_the_peer_whose_connection_closed(coord, ctx):
    b, c = _dealer(ctx, coord, "b"), _dealer(ctx, coord, "c")
    try:
        _joined(coord, "b", "c")
        b.close(0)
        assert _closed(coord) == [B]
    finally:
        c.close(0)


def test_the_monitor_names_it_under_curve_too(redis_url, cluster_name, ctx, tmp_path: Path):
    create_key_set(tmp_path, workers=["b", "c"])
    coordinator = Coordinator(settings(redis_url, cluster_name, keys=tmp_path))
    server = CurveKeys.load(tmp_path, "worker", "b").server_key("coordinator", COORDINATOR)
    socks = {}
    try:
        for name in ("b", "c"):
            keys = CurveKeys.load(tmp_path, "worker", name)
            sock = connect_dealer(ctx, coordinator.endpoint, name, keys=keys, server_key=server)
            sock.send_multipart(encode(hb(name), name))
            socks[name] = sock
        _joined(coordinator, "b", "c")
        socks.pop("c").close(0)
        assert _closed(coordinator) == [C]
    finally:
        for sock in socks.values():
            sock.close(0)
        coordinator.close()


def test_a_closed_connection_not_back_within_the_grace_is_a_loss(coord, ctx):
    b = _dealer(ctx, coord, "b")
    _joined(coord, "b")
    b.close(0)
    with pytest.raises(DeviceLost) as lost:
        coord.gather(RoundDone, [B], EPOCH, 2, timeout_s=20.0)
    assert lost.value.devices == [B]
    reason = str(lost.value)
    assert reason.startswith(
        "workers ['b'] lost while the coordinator waited for RoundDone of round 2: "
        "b: control connection closed "
    ), reason
    assert reason.endswith("not back within the 0.50 s grace"), reason


def test_a_peer_that_reconnects_within_the_grace_is_no_loss(coord, ctx):
    first = _dealer(ctx, coord, "b")
    _joined(coord, "b")
    first.close(0)
    _closed(coord)
    again = _dealer(ctx, coord, "b")  # a new connection of the same device, heartbeating
    try:
        with capture_logs() as logs, pytest.raises(JobFailed) as failed:
            coord.gather(RoundDone, [B], EPOCH, 2, timeout_s=2.0)
    finally:
        again.close(0)
    assert not isinstance(failed.value, DeviceLost), str(failed.value)
    assert str(failed.value) == "no RoundDone of round 2 from ['b'] within 2 s"
    assert "suspect" in [e["event"] for e in logs], logs


def test_a_neighbours_silent_report_makes_a_probe_and_a_loss_naming_it(coord, ctx):
    b, c = _dealer(ctx, coord, "b"), _dealer(ctx, coord, "c")  # b never answers a probe
    try:
        _joined(coord, "b", "c")
        report = PeerDown(device=C, epoch=EPOCH, peer=B, how="silent", waited_s=2.0)
        c.send_multipart(encode(report, "c"))
        with pytest.raises(DeviceLost) as lost:
            coord.gather(RoundDone, [B, C], EPOCH, 2, timeout_s=20.0)
    finally:
        b.close(0)
        c.close(0)
    assert lost.value.devices == [B]
    assert "b: c waited 2.00 s for its data; probe unanswered for" in str(lost.value)


def test_a_report_of_another_epoch_or_about_a_stranger_is_dropped_naming_its_sender(coord, ctx):
    b, c = _dealer(ctx, coord, "b"), _dealer(ctx, coord, "c")
    try:
        _joined(coord, "b", "c")
        for report in (
            PeerDown(device=C, epoch=EPOCH - 1, peer=B, how="disconnected"),
            PeerDown(device=C, epoch=EPOCH, peer=DeviceId("z"), how="silent", waited_s=1.0),
        ):
            c.send_multipart(encode(report, "c"))
        with capture_logs() as logs, pytest.raises(JobFailed) as failed:
            coord.gather(RoundDone, [B, C], EPOCH, 2, timeout_s=1.5)
    finally:
        b.close(0)
        c.close(0)
    assert not isinstance(failed.value, DeviceLost), str(failed.value)
    dropped = [e for e in logs if e["event"] == "dropped a liveness report"]
    assert [(e["peer"], e["about"]) for e in dropped] == [(C, B), (C, "z")], logs
    assert [e["log_level"] for e in dropped] == ["warning", "warning"]


def test_a_command_sent_while_the_connection_was_down_is_delivered_when_it_is_back(coord, ctx):
    first = _dealer(ctx, coord, "b")
    _joined(coord, "b")
    first.close(0)
    _closed(coord)
    coord.send(B, Probe(nonce=7))  # the route is gone: kept, not dropped
    assert [m.nonce for _, m in coord.control.held[B]] == [7]
    again = _dealer(ctx, coord, "b")
    try:
        deadline = time.monotonic() + 10
        while not again.poll(50):
            assert time.monotonic() < deadline, "the held probe never came"
            coord.pump(0.05)
        _, env = recv_message(again, Limits(1 << 20))
    finally:
        again.close(0)
    assert env.msg == Probe(nonce=7) and B not in coord.control.held
