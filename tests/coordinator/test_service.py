"""The coordinator's receive loop over a real ROUTER and a real Redis, in-process."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from common.codec import encode
from common.messages import Heartbeat
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from services.coordinator.service import Coordinator


@pytest.fixture
def coord(redis_url, cluster_name):
    settings = CoordinatorSettings(
        bind=f"tcp://127.0.0.1:{free_port()}", redis_url=redis_url, cluster=cluster_name
    )
    coordinator = Coordinator(settings)
    yield coordinator
    coordinator.close()


def _pump_until(coord: Coordinator, done: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        coord.pump(0.05)


def test_a_heartbeat_whose_device_differs_from_its_sender_is_dropped(coord):
    ctx: zmq.Context[Any] = zmq.Context()
    mallory = connect_dealer(ctx, coord.endpoint, "mallory")
    honest = connect_dealer(ctx, coord.endpoint, "a")
    try:
        with capture_logs() as logs:
            mallory.send_multipart(encode(Heartbeat(device="a", data_addr="tcp://x:1"), "a"))
            _pump_until(coord, lambda: coord.bad_messages == 1, "the spoofed heartbeat")
        # neither registered under the name it claims nor recorded in Redis
        assert coord.members == {}
        assert coord.store.get_fields("device", "a") == {}
        dropped = [e for e in logs if e["event"].startswith("dropped message whose device")]
        assert dropped == [
            {
                "event": "dropped message whose device differs from its sender",
                "log_level": "warning",
                "peer": "mallory",
                "claimed": "a",
                "type": "heartbeat",
            }
        ]
        # the real device still joins, and the spoofed one never did
        honest.send_multipart(encode(Heartbeat(device="a", data_addr="tcp://a:1"), "a"))
        _pump_until(coord, lambda: "a" in coord.members, "the real heartbeat")
        assert coord.members["a"].info.data_addr == "tcp://a:1"
        assert coord.members["a"].beats == 1 and coord.bad_messages == 1
        assert "mallory" not in coord.members
    finally:
        mallory.close(0)
        honest.close(0)
        ctx.term()
