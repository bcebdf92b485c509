"""A bound ROUTER queues a bounded number of unread messages per peer.

Without the bound (RCVHWM 0) a peer that sends faster than the service reads
grows the service's memory without limit; with it, ZeroMQ stops reading that
peer's connection until the service catches up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.codec import Limits
from common.curve import CurveKeys, create_key_set
from common.sockets import ROUTER_RCVHWM, bind_router, connect_dealer


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_router_has_a_bounded_receive_queue_by_default(ctx: zmq.Context[Any]) -> None:
    sock, _ = bind_router(ctx, "tcp://127.0.0.1:0", Limits())
    try:
        assert sock.getsockopt(zmq.RCVHWM) == ROUTER_RCVHWM == 10_000
    finally:
        sock.close(0)


def test_router_takes_its_receive_bound_as_an_option(ctx: zmq.Context[Any]) -> None:
    sock, _ = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), rcvhwm=50)
    try:
        assert sock.getsockopt(zmq.RCVHWM) == 50
    finally:
        sock.close(0)


def test_curve_router_is_bounded_too(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    create_key_set(tmp_path, workers=["w1"])
    keys = CurveKeys.load(tmp_path, "worker", "w1")
    sock, _ = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), keys=keys)
    try:
        assert sock.getsockopt(zmq.RCVHWM) == ROUTER_RCVHWM
    finally:
        sock.close(0)


@pytest.mark.parametrize("rcvhwm", [0, -1])
def test_an_unbounded_receive_queue_is_refused(ctx: zmq.Context[Any], rcvhwm: int) -> None:
    with pytest.raises(ValueError, match="high-water mark must be >= 1"):
        bind_router(ctx, "tcp://127.0.0.1:0", Limits(), rcvhwm=rcvhwm)


CAP = 500
"""Messages of 64 KiB a flooder tries to queue: 32 MiB, far past a bound of 10 plus
what the kernel's loopback buffers hold."""


def _flood(ctx: zmq.Context[Any], endpoint: str) -> int:
    """Messages a DEALER with a small send queue gets accepted before it is stuck for 0.5 s."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 10)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body, sent, stuck_since = bytes(64 << 10), 0, None
    try:
        while sent < CAP:
            try:
                sock.send(body, zmq.NOBLOCK)
            except zmq.Again:
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since > 0.5:
                    break
                time.sleep(0.005)
            else:
                sent, stuck_since = sent + 1, None
    finally:
        sock.close(0)
    return sent


@pytest.mark.parametrize(("rcvhwm", "bounded"), [(10, True), (1_000_000, False)])
def test_a_peer_past_the_bound_is_throttled_not_buffered(
    ctx: zmq.Context[Any], rcvhwm: int, bounded: bool
) -> None:
    """The service never reads: what it holds is its bound, not what the flooder sent."""
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), rcvhwm=rcvhwm)
    try:
        sent = _flood(ctx, endpoint)
        if bounded:
            assert sent < CAP // 2, f"{sent} messages of 64 KiB taken without being read"
        else:  # the same flood against a bound it never reaches: the test can tell
            assert sent == CAP
    finally:
        router.close(0)


def test_a_throttled_peer_loses_nothing(ctx: zmq.Context[Any]) -> None:
    """Over TCP the bound makes the sender wait; every message arrives, in order."""
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), rcvhwm=10)
    dealer = connect_dealer(ctx, endpoint, "flooder", send_timeout_s=5)
    try:
        sent = 2_000
        for i in range(sent):
            dealer.send(i.to_bytes(4, "big"))
        got = []
        while len(got) < sent and router.poll(5_000):
            _, body = router.recv_multipart()
            got.append(int.from_bytes(body, "big"))
        assert got == list(range(sent))
    finally:
        dealer.close(0)
        router.close(0)
