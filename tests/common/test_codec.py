import msgpack
import pytest
import torch
import zmq

from common.codec import Limits, encode, recv_message, send_message
from common.errors import ProtocolError
from common.messages import PROTOCOL_VERSION, Activation, Heartbeat, RunRound


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://codec")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"dev-a/" + b"0123456789abcdef")
    dealer.connect("inproc://codec")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _recv(router, limits=None):
    assert router.poll(2000)
    return recv_message(router, limits or Limits(), routed=True)


def test_roundtrip_with_tensors(pair):
    router, dealer = pair
    x = torch.randn(4, 3, 8, 8)
    y = torch.arange(4)
    msg = Activation(epoch=1, round=2, mb=3, stage=1, lo=0, hi=4)
    send_message(dealer, msg, "dev-a", [x, y])
    peer, env = _recv(router)
    assert peer == "dev-a" and env.sender == "dev-a" and env.msg == msg
    assert torch.equal(env.tensors[0], x) and torch.equal(env.tensors[1], y)
    assert env.tensors[0].dtype == torch.float32 and env.tensors[1].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.bool, torch.float64])
def test_dtypes_and_empty(pair, dtype):
    router, dealer = pair
    for t in (torch.ones(3, 2, dtype=dtype), torch.ones(0, 5, dtype=dtype)):
        send_message(dealer, RunRound(epoch=1, round=0), "dev-a", [t])
        _, env = _recv(router)
        assert torch.equal(env.tensors[0], t)


def test_non_contiguous_slice_is_sent_correctly(pair):
    router, dealer = pair
    base = torch.randn(6, 5)
    view = base[:, 1:3]
    send_message(dealer, RunRound(epoch=1, round=0), "dev-a", [view])
    _, env = _recv(router)
    assert torch.equal(env.tensors[0], view)


def _header(**over):
    h = {
        "v": PROTOCOL_VERSION,
        "sender": "x",
        "id": 1,
        "t": 0.0,
        "msg": {"type": "run_round", "epoch": 1, "round": 0},
        "tensors": [],
    }
    h.update(over)
    return msgpack.packb(h, use_bin_type=True)


BAD = {
    "garbage": [b"\xc1\xff\x00garbage"],
    "truncated": [_header()[:-5]],
    "not a map": [msgpack.packb([1, 2, 3])],
    "huge tensor": [_header(tensors=[["float32", [25_000_000_000], 100_000_000_000]]), b"x"],
    "wrong version": [_header(v=99)],
    "unknown type": [_header(msg={"type": "launch_missiles"})],
    "missing field": [_header(msg={"type": "run_round", "epoch": 1})],
    "extra field": [_header(msg={"type": "run_round", "epoch": 1, "round": 0, "evil": 1})],
    "size mismatch": [_header(tensors=[["float32", [4], 16]]), b"12345678"],
    "missing frame": [_header(tensors=[["float32", [4], 16]])],
    "extra frame": [_header(), b"surprise"],
    "bad dtype": [_header(tensors=[["complex128", [1], 16]]), b"0" * 16],
    "lying nbytes": [_header(tensors=[["float32", [4], 8]]), b"0" * 8],
    "negative dim": [_header(tensors=[["float32", [-4], 16]]), b"0" * 16],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_messages_are_rejected_and_drained(pair, case):
    router, dealer = pair
    dealer.send_multipart(BAD[case])
    with pytest.raises(ProtocolError) as info:
        _recv(router)
    assert info.value.sender == "dev-a"
    # the next good message decodes: the bad one was drained completely
    send_message(dealer, RunRound(epoch=1, round=7), "dev-a")
    _, env = _recv(router)
    assert env.msg == RunRound(epoch=1, round=7)


def test_version_error_names_versions(pair):
    router, dealer = pair
    dealer.send_multipart([_header(v=PROTOCOL_VERSION - 1)])  # the previous protocol
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION - 1} not supported"):
        _recv(router)


def test_header_size_limit(pair):
    router, dealer = pair
    hb = Heartbeat(device="d" * 5000, data_addr="tcp://x:1")
    dealer.send_multipart(encode(hb, "dev-a"))
    with pytest.raises(ProtocolError, match="exceeds"):
        _recv(router, Limits(max_header_bytes=1000))


def test_tensor_limit_before_allocation(pair):
    router, dealer = pair
    send_message(dealer, RunRound(epoch=1, round=0), "dev-a", [torch.zeros(1000)])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _recv(router, Limits(max_tensor_bytes=100))


def test_large_tensor_roundtrip_and_size_mismatch(pair):
    router, dealer = pair
    big = torch.randn(300, 1000)  # above the zero-copy threshold
    send_message(dealer, RunRound(epoch=1, round=0), "dev-a", [big])
    _, env = _recv(router)
    assert torch.equal(env.tensors[0], big)
    env.tensors[0].add_(1)  # received tensors are writable
    nbytes = 300_000 * 4
    dealer.send_multipart([_header(tensors=[["float32", [300_000], nbytes]]), b"0" * (nbytes - 4)])
    with pytest.raises(ProtocolError, match="expected 1200000"):
        _recv(router)


@pytest.mark.parametrize(
    "identity",
    [
        b"dev-a",
        b"dev-a/0123",
        b"dev-a/0123456789ABCDEF",
        b"\x00\x00\x00\x00\x01",
        b"\x1b[2J/0123456789abcdef",
    ],
)
def test_routing_identity_without_a_nonce_is_refused(identity):
    """Only a DEALER's own NAME/NONCE names a route: a guessable or hand-made one is refused."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://codec-nonce")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, identity)
    dealer.connect("inproc://codec-nonce")
    try:
        send_message(dealer, Heartbeat(device="dev-a", data_addr="tcp://x:1"), "dev-a")
        with pytest.raises(ProtocolError, match="is not NAME/NONCE"):
            _recv(router)
        send_message(dealer, Heartbeat(device="dev-a", data_addr="tcp://x:1"), "dev-a")
        with pytest.raises(ProtocolError):  # and the next message still starts on a boundary
            _recv(router)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_route_is_the_whole_identity_and_peer_its_name(pair):
    router, dealer = pair
    send_message(dealer, Heartbeat(device="dev-a", data_addr="tcp://x:1"), "dev-a")
    peer, env = _recv(router)
    assert peer == "dev-a" and env.route == b"dev-a/0123456789abcdef"
