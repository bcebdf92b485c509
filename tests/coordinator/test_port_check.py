"""The data-port check over real loopback sockets: a closed port is refused, a listening one
(even one that never accepts) and a connect that times out are no evidence, at most one check
per device is under way, and a coordinator whose own control connection to a device closed
loses it at once, naming the refusal, when nothing listens on the device's data port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common.codec import encode
from common.ids import DeviceId
from common.messages import Heartbeat, RoundDone
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from services.coordinator.jobs import DeviceLost
from services.coordinator.port_check import PortChecks, host_port, refused
from services.coordinator.service import Coordinator

B = DeviceId("b")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that listens but never accepts."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        yield int(server.getsockname()[1])


def _taken(checks: PortChecks, within_s: float = 5.0) -> list[tuple[DeviceId, float]]:
    deadline = time.monotonic() + within_s
    while checks.busy():
        assert time.monotonic() < deadline, "a check outlived its bound"
        time.sleep(0.01)
    return checks.take()


def test_addresses_are_read_strictly():
    assert host_port("tcp://10.0.0.2:5555") == ("10.0.0.2", 5555)
    assert host_port("tcp://[::1]:7") == ("::1", 7)
    for bad in ("tcp://*:5555", "tcp://host", "ipc:///x", "tcp://:5", "tcp://h:0", "tcp://h:99999"):
        assert host_port(bad) is None, bad


def test_a_closed_port_is_refused_and_a_listening_one_is_not(listening):
    assert refused("127.0.0.1", closed_port())
    assert not refused("127.0.0.1", listening)


def test_only_a_refusal_comes_back(listening):
    checks = PortChecks()
    before = time.monotonic()
    assert checks.check(B, f"tcp://127.0.0.1:{closed_port()}")
    ((device, at),) = _taken(checks)
    assert device == B and at >= before
    assert checks.check(B, f"tcp://127.0.0.1:{listening}")
    assert _taken(checks) == []
    assert not checks.check(B, "tcp://*:1")  # no address to check: the grace decides


def test_a_timeout_is_no_evidence_and_one_check_per_device_runs():
    """A connect that hangs (a cut link) times out: no evidence. One check per device at once."""
    release = threading.Event()

    def hanging(host: str, port: int, timeout_s: float) -> bool:
        release.wait(timeout_s)
        return refused(host, port, 0.01) if release.is_set() else False

    checks = PortChecks(timeout_s=5.0, probe=hanging)
    assert checks.check(B, f"tcp://127.0.0.1:{closed_port()}")
    assert not checks.check(B, f"tcp://127.0.0.1:{closed_port()}")  # one in flight already
    assert checks.busy() == 1
    short = PortChecks(timeout_s=0.05, probe=hanging)
    assert short.check(DeviceId("c"), "tcp://127.0.0.1:9")
    assert _taken(short) == []  # timed out: nothing
    release.set()
    assert [d for d, _ in _taken(checks)] == [B]


def test_a_failing_check_never_escapes():
    def broken(host: str, port: int, timeout_s: float) -> bool:
        raise RuntimeError("boom")

    checks = PortChecks(probe=broken)
    assert checks.check(B, "tcp://127.0.0.1:9")
    assert _taken(checks) == []


@pytest.fixture
def ctx():
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_dead_processs_refused_port_is_a_loss_before_the_grace(redis_url, cluster_name, ctx):
    grace_s = 20.0
    coord = Coordinator(
        CoordinatorSettings(
            bind=f"tcp://127.0.0.1:{free_port()}",
            redis_url=redis_url,
            cluster=cluster_name,
            heartbeat_s=5.0,
            heartbeat_misses=6,
            probe_timeout_s=0.5,
            flap_grace_s=grace_s,
            derive_timeouts=False,
        )
    )
    try:
        sock = connect_dealer(ctx, coord.endpoint, "b")
        beat = Heartbeat(device=B, data_addr=f"tcp://127.0.0.1:{closed_port()}")
        sock.send_multipart(encode(beat, "b"))
        deadline = time.monotonic() + 10
        while B not in coord.members:
            assert time.monotonic() < deadline, "b did not join"
            coord.pump(0.05)
        sock.close(0)
        with pytest.raises(DeviceLost) as lost:  # the grace alone would end it in JobFailed
            coord.gather(RoundDone, [B], 3, 2, timeout_s=grace_s / 2)
        assert lost.value.devices == [B]
        assert str(lost.value).endswith("its data port refused a connection: no process listens"), (
            str(lost.value)
        )
    finally:
        coord.close()
