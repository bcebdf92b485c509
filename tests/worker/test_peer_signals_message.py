"""The PeerDown message and the Assign's neighbour timeout: bounded, validated, on the wire."""

from __future__ import annotations

import math

import pytest
import zmq
from pydantic import ValidationError

from common.codec import Limits, encode, recv_message
from common.ids import DeviceId
from common.messages import (
    MAX_PEER_TIMEOUT_S,
    MAX_PEER_WAIT_S,
    Assign,
    PeerDown,
    message_adapter,
)


def _peer_down(**over: object) -> dict[str, object]:
    body: dict[str, object] = {
        "type": "peer_down",
        "device": "a",
        "epoch": 3,
        "peer": "b",
        "how": "silent",
        "waited_s": 1.5,
    }
    body.update(over)
    return body


def test_peer_down_round_trips_through_the_codec() -> None:
    msg = PeerDown(device=DeviceId("a"), epoch=3, peer=DeviceId("b"), how="disconnected")
    ctx = zmq.Context()
    out, into = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        into.bind("inproc://peer-down")
        out.connect("inproc://peer-down")
        out.send_multipart(encode(msg, "a"))
        assert into.poll(2000)
        _, env = recv_message(into, Limits())
    finally:
        out.close(0)
        into.close(0)
        ctx.term()
    assert env.msg == msg and env.sender == "a"
    assert env.msg.waited_s == 0.0


@pytest.mark.parametrize(
    "over",
    [
        {"waited_s": -0.1},
        {"waited_s": MAX_PEER_WAIT_S},
        {"waited_s": 1e300},
        {"waited_s": math.nan},
        {"waited_s": math.inf},
        {"how": "gone"},
        {"how": ""},
        {"peer": ""},
        {"peer": "x" * 256},
        {"device": ""},
        {"epoch": -1},
        {"epoch": 1 << 63},
        {"extra": 1},
    ],
)
def test_peer_down_refuses_what_is_out_of_bounds(over: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        message_adapter.validate_python(_peer_down(**over))


def test_peer_down_accepts_each_kind_of_evidence() -> None:
    for how in ("disconnected", "reconnected", "silent"):
        msg = message_adapter.validate_python(_peer_down(how=how))
        assert isinstance(msg, PeerDown) and msg.how == how


def _assign(timeout: object) -> dict[str, object]:
    """An Assign's body (small_cnn on two one-device stages) with `peer_timeout_s`."""
    stages = [
        {"start": 0, "end": 3, "devices": [{"device": "a", "share": 1}]},
        {"start": 3, "end": 7, "devices": [{"device": "b", "share": 1}]},
    ]
    return {
        "type": "assign",
        "epoch": 1,
        "job": {"job_id": "j", "model": {"name": "small_cnn"}, "rounds": 2},
        "plan": {"global_batch": 8, "microbatches": 2, "stages": stages},
        "stage": 0,
        "peers": {"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"},
        "from_round": 0,
        "peer_timeout_s": timeout,
    }


@pytest.mark.parametrize("bad", [0.0, -1.0, MAX_PEER_TIMEOUT_S * 2, math.inf, math.nan])
def test_assign_refuses_a_bad_peer_timeout(bad: float) -> None:
    with pytest.raises(ValidationError):
        message_adapter.validate_python(_assign(bad))


@pytest.mark.parametrize("good", [None, 0.05, 30.0, MAX_PEER_TIMEOUT_S])
def test_assign_takes_a_peer_timeout_or_none(good: float | None) -> None:
    msg = message_adapter.validate_python(_assign(good))
    assert isinstance(msg, Assign) and msg.peer_timeout_s == good
