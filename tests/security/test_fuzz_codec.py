"""Fuzzing the real decoder: whatever arrives, only ProtocolError comes out.

Frames go through real ZeroMQ sockets (inproc DEALER -> ROUTER) into
`common.codec.recv_message`, as on every service's receive loop. Three kinds of
input: raw frames of random bytes; msgpack headers of arbitrary nesting; and
structurally valid headers of real messages with one part made wrong (a field's
type, a size, a tensor descriptor, the frames that follow). Each decode must
return a message whose tensors match their descriptors and stay within the
limits, or raise ProtocolError naming the peer, and must leave the socket on a
message boundary: a valid message sent after it decodes.

`make fuzz` runs the same properties with many more examples
(ASTEROID_FUZZ_EXAMPLES) and an atheris target (tests/security/fuzz_codec_atheris.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.codec import DTYPES, Envelope, Limits, encode, recv_message
from common.errors import ProtocolError
from common.messages import (
    PROTOCOL_VERSION,
    Activation,
    CancelJob,
    Gradient,
    Heartbeat,
    ReduceChunk,
    RunEval,
    RunRound,
    Shutdown,
)

LIMITS = Limits(max_header_bytes=64 << 10, max_tensor_bytes=256 << 10, max_tensors=4)
PEER = b"fuzzer"
ROUTE = PEER + b"/0123456789abcdef"
EXAMPLES = int(os.environ.get("ASTEROID_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # no timing assertions: the machine is shared
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SENTINEL = RunRound(epoch=7, round=7)


class Wire:
    """A DEALER and the ROUTER it talks to, on inproc: the real receive path."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, LIMITS.max_tensor_bytes + LIMITS.max_header_bytes)
        self.router.bind("inproc://fuzz")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, ROUTE)
        self.dealer.connect("inproc://fuzz")

    def decode(self, frames: list[bytes]) -> Envelope | ProtocolError:
        """Send `frames` as one message and decode it; any other exception escapes."""
        self.dealer.send_multipart(frames)
        if not self.router.poll(5000, zmq.POLLIN):
            raise AssertionError("a sent message never arrived")
        try:
            peer, env = recv_message(self.router, LIMITS, routed=True)
        except ProtocolError as exc:
            assert exc.sender == PEER.decode()
            return exc
        except BaseException:
            self.drain()  # so that the next example starts on a message boundary
            raise
        assert peer == PEER.decode()
        return env

    def drain(self) -> None:
        """Throw away what is left of the current message."""
        while self.router.getsockopt(zmq.RCVMORE):
            self.router.recv()

    def still_in_step(self) -> None:
        """The next message starts on a boundary: a valid one sent now decodes as itself."""
        got = self.decode(encode(SENTINEL, "fuzzer"))
        assert isinstance(got, Envelope) and got.msg == SENTINEL, got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    w = Wire()
    yield w
    w.close()


def check(wire: Wire, frames: list[bytes]) -> Envelope | ProtocolError:
    """The fuzz property: a bounded message or a ProtocolError, then the stream is in step."""
    got = wire.decode(frames)
    if isinstance(got, Envelope):
        assert len(got.tensors) <= LIMITS.max_tensors
        for t in got.tensors:
            assert t.numel() * t.element_size() <= LIMITS.max_tensor_bytes
    wire.still_in_step()
    return got


# --- strategies -------------------------------------------------------------------

INTS = st.one_of(
    st.integers(-3, 70),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
    ),
    max_leaves=30,
)
TEMPLATES = [
    Activation(epoch=1, round=2, mb=0, stage=1, lo=0, hi=4),
    Gradient(epoch=1, round=2, mb=0, stage=1, lo=0, hi=4),
    ReduceChunk(epoch=1, round=2, stage=1, step=0, chunk=1),
    Heartbeat(device="dev", data_addr="tcp://127.0.0.1:1"),
    RunEval(epoch=1, round=2, batches=1),
    CancelJob(job_id="j"),
    Shutdown(),
]


@st.composite
def descriptors(draw: st.DrawFn) -> Any:
    """A tensor descriptor, mostly well-formed, sometimes wrong in one part."""
    dtype = draw(st.one_of(st.sampled_from([*DTYPES, "float128", "object"]), VALUES))
    # empty tensors whose other dimensions are absurd announce 0 bytes, honestly
    absurd = st.sampled_from([[0, 2**64 - 1], [0, 2**63], [0, 2**62, 2**62], [2**40, 0]])
    shape = draw(st.one_of(st.lists(st.one_of(st.integers(0, 9), INTS), max_size=10), absurd))
    itemsize = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else 8
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    exact = n * itemsize
    packable = -(2**63) <= exact < 2**64
    nbytes = draw(st.one_of(st.just(exact), INTS) if packable else INTS)
    meta = [dtype, shape, nbytes]
    return draw(st.one_of(st.just(meta), st.just(meta[:2]), VALUES))


def _mutate(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    body = dict(body)
    how = draw(st.sampled_from(["value", "extra", "drop", "none"]))
    key = draw(st.sampled_from(sorted(body)))
    if how == "value":
        body[key] = draw(VALUES)
    elif how == "extra":
        body[draw(st.text(max_size=8))] = draw(VALUES)
    elif how == "drop":
        del body[key]
    return body


@st.composite
def valid_shaped_messages(draw: st.DrawFn) -> list[bytes]:
    """A header of a real message with its fields, tensors and frames made wrong."""
    body = _mutate(draw, draw(st.sampled_from(TEMPLATES)).model_dump(mode="json"))
    metas = draw(st.lists(descriptors(), max_size=5))
    header: dict[str, Any] = {
        "v": draw(st.one_of(st.just(PROTOCOL_VERSION), VALUES)),
        "sender": draw(st.one_of(st.just("fuzzer"), VALUES)),
        "id": draw(st.one_of(INTS, VALUES)),
        "t": draw(st.one_of(st.floats(), VALUES)),
        "msg": body,
        "tensors": draw(st.one_of(st.just(metas), VALUES)),
    }
    for key in draw(st.sets(st.sampled_from(sorted(header)), max_size=2)):
        del header[key]
    frames = [msgpack.packb(header, use_bin_type=True)]
    for meta in metas:
        size = meta[2] if isinstance(meta, list) and len(meta) == 3 else 0
        fits = isinstance(size, int) and 0 <= size <= 4096
        frames.append(
            draw(st.one_of(st.binary(max_size=64), st.just(b"\0" * size if fits else b"")))
        )
    extra = draw(st.lists(st.binary(max_size=32), max_size=2))
    return frames + extra


# --- properties -------------------------------------------------------------------


@FUZZ
@given(frames=st.lists(st.binary(max_size=256), min_size=1, max_size=6))
def test_raw_frames_decode_or_raise_protocol_error(wire, frames):
    check(wire, frames)


@FUZZ
@given(header=VALUES, tail=st.lists(st.binary(max_size=64), max_size=3))
def test_arbitrary_msgpack_headers_decode_or_raise_protocol_error(wire, header, tail):
    check(wire, [msgpack.packb(header, use_bin_type=True), *tail])


@FUZZ
@given(frames=valid_shaped_messages())
def test_real_messages_made_wrong_decode_or_raise_protocol_error(wire, frames):
    check(wire, frames)


@FUZZ
@given(depth=st.integers(1, 5000), kind=st.sampled_from([b"\x91", b"\x81\xa1k"]))
def test_deep_nesting_is_refused_not_recursed(wire, depth, kind):
    """Arrays (or maps) nested thousands deep inside the message body."""
    inner = kind * depth + b"\xc0"
    head = msgpack.packb({"v": PROTOCOL_VERSION, "sender": "f", "tensors": []}, use_bin_type=True)
    # splice {"msg": <nested>} into the map: bump its size and append the pair
    header = bytes([head[0] + 1]) + head[1:] + msgpack.packb("msg") + inner
    check(wire, [header])


@pytest.mark.parametrize(
    "meta",
    [
        [["float32"], [4], 16],  # an unhashable dtype name (found by atheris)
        ["float32", [0, 2**64 - 1], 0],  # empty, but a dimension past int64 (hypothesis)
        ["float32", [0, 2**62, 2**62], 0],  # empty, but strides overflow (hypothesis)
        ["float32", [4], 16.0],  # a float byte count
    ],
)
def test_descriptors_the_fuzzers_found_are_protocol_errors(wire, meta):
    header = {"v": PROTOCOL_VERSION, "sender": "f", "id": 1, "t": 0.0}
    header |= {"msg": SENTINEL.model_dump(mode="json"), "tensors": [meta]}
    got = check(wire, [msgpack.packb(header, use_bin_type=True), b"\0" * 16])
    assert isinstance(got, ProtocolError), got


def test_a_correct_message_round_trips(wire):
    """The property's other side: the fuzz harness does decode what is well-formed."""
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    msg = Activation(epoch=1, round=2, mb=0, stage=1, lo=0, hi=4)
    got = check(wire, encode(msg, "fuzzer", [x, torch.arange(4)]))
    assert isinstance(got, Envelope) and got.msg == msg and torch.equal(got.tensors[0], x)
