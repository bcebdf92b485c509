import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from common.codec import encode
from common.curve import CurveKeys, create_key_set
from common.errors import ConfigError
from common.messages import PROTOCOL_VERSION, LinkData, LinkHello, Probe
from common.sockets import connect_dealer
from services.worker.bandwidth import BandwidthError, BandwidthSink, probe_bandwidth, probe_link


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def sink(ctx):
    with BandwidthSink(ctx) as s:
        yield s


def test_probe_over_loopback_measures_plausible_bandwidth(ctx, sink):
    link = probe_link(ctx, sink.endpoint, nbytes=1 << 20, count=16, timeout_s=10)
    assert link.mb_per_s > 10
    assert link.bytes_per_s == link.mb_per_s * 1e6
    assert 0 < link.rtt_s < 1
    assert probe_bandwidth(ctx, sink.endpoint, nbytes=64 << 10, count=8, timeout_s=10) > 10


def test_concurrent_probes_are_counted_apart(ctx, sink):
    results: list[float] = []

    def probe() -> None:
        results.append(probe_bandwidth(ctx, sink.endpoint, nbytes=256 << 10, count=8))

    threads = [threading.Thread(target=probe) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(results) == 3 and all(r > 0 for r in results)


def test_absent_peer_times_out_with_a_clear_error(ctx):
    started = time.monotonic()
    with pytest.raises(BandwidthError, match=r"no 'link_ready' reply .* within the probe's 0.3 s"):
        probe_bandwidth(ctx, "tcp://127.0.0.1:1", nbytes=1024, count=2, timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert isinstance(BandwidthError("x"), TimeoutError)


def _frames(msg, tensors=()):
    return encode(msg, "bad", tensors)


def test_sink_survives_malformed_frames(ctx, sink):
    anonymous = ctx.socket(zmq.DEALER)  # ZeroMQ's own binary identity: cannot be answered
    anonymous.setsockopt(zmq.LINGER, 0)
    anonymous.connect(sink.endpoint)
    anonymous.send_multipart(_frames(LinkHello(probe="a", count=1, nbytes=1)))
    bad = connect_dealer(ctx, sink.endpoint, "bad", 5)
    bad.send(b"\xc1not msgpack")
    data = LinkData(probe="nobody", seq=0)
    bad.send_multipart(_frames(data, [torch.zeros(4, dtype=torch.uint8)]))  # data without hello
    old = msgpack.unpackb(_frames(LinkHello(probe="x", count=1, nbytes=1))[0])
    bad.send(msgpack.packb({**old, "v": PROTOCOL_VERSION - 1}))  # unknown version
    bad.send_multipart([*_frames(LinkHello(probe="y", count=1, nbytes=1)), b"c"])  # extra frame
    bad.send_multipart(_frames(Probe(nonce=1)))  # a message no sink takes
    bad.send_multipart(_frames(LinkHello(probe="p", count=2, nbytes=10)))
    assert bad.poll(5000)
    assert msgpack.unpackb(bad.recv())["msg"]["type"] == "link_ready"
    short = torch.zeros(5, dtype=torch.uint8)
    bad.send_multipart(_frames(LinkData(probe="p", seq=0), [short]))  # not the announced size
    wide = torch.zeros(10, dtype=torch.float32)
    bad.send_multipart(_frames(LinkData(probe="p", seq=0), [wide]))  # not uint8
    huge = msgpack.unpackb(_frames(LinkData(probe="p", seq=0))[0])
    huge["tensors"] = [["uint8", [1 << 40], 1 << 40]]  # announces a terabyte
    bad.send(msgpack.packb(huge))
    deadline = time.monotonic() + 5
    while sink.bad_messages < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.bad_messages == 9
    assert not bad.poll(200)  # nothing acknowledged the bad payloads
    bad.close(0)
    anonymous.close(0)
    assert probe_bandwidth(ctx, sink.endpoint, nbytes=1024, count=4) > 0  # still serving


@pytest.mark.parametrize(
    ("nbytes", "count", "timeout_s"), [(0, 1, 1.0), (1, 0, 1.0), (1, 1, 0), (1 << 30, 1, 1.0)]
)
def test_bad_probe_arguments(ctx, nbytes, count, timeout_s):
    with pytest.raises(ValueError, match="need 1 <= nbytes"):
        probe_link(ctx, "tcp://127.0.0.1:1", nbytes, count, timeout_s)


# --- CURVE: the probe is secured like the data plane it measures ---------------------

WAIT_S = 1.0
"""The refused probes' timeout: they must fail by then, with a margin for a busy machine."""


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    create_key_set(root, workers=["w1", "w2"], services=["planner"])
    return root


@pytest.fixture
def curve_sink(ctx, keydir):
    """A sink on worker w1 with w1's own pair, admitting worker keys (as its data socket)."""
    with BandwidthSink(ctx, keys=CurveKeys.load(keydir, "worker", "w1")) as s:
        yield s


def test_probe_with_keys_is_encrypted_and_works(ctx, keydir, curve_sink):
    keys = CurveKeys.load(keydir, "worker", "w2")
    link = probe_link(ctx, curve_sink.endpoint, 256 << 10, 8, timeout_s=10, keys=keys, sink="w1")
    assert link.mb_per_s > 0 and link.count == 8
    got = probe_bandwidth(ctx, curve_sink.endpoint, 1024, 4, timeout_s=10, keys=keys, sink="w1")
    assert got > 0
    assert curve_sink.bad_messages == 0


def foreign(tmp_path: Path, keydir: Path) -> CurveKeys:
    """A well-formed worker pair named w2 that is not in the set (the set's public files)."""
    create_key_set(tmp_path / "other", workers=["w2"])
    pair = CurveKeys.load(tmp_path / "other", "worker", "w2")
    return CurveKeys(keydir, "worker", "w2", pair.public, pair.secret)


@pytest.mark.parametrize("attacker", ["no key", "unknown key", "service key", "revoked key"])
def test_prober_without_an_admitted_key_gets_no_answer(ctx, keydir, tmp_path, curve_sink, attacker):
    keys: CurveKeys | None = None
    if attacker == "unknown key":
        keys = foreign(tmp_path, keydir)
    elif attacker == "service key":  # in the set, but a sink admits workers only
        keys = CurveKeys.load(keydir, "service", "planner")
    elif attacker == "revoked key":
        keys = CurveKeys.load(keydir, "worker", "w2")
        (keydir / "workers" / "w2.key").unlink()
    started = time.monotonic()
    # refused at the handshake: no reply, or (refused before the hello left) no pipe to send on
    with pytest.raises(BandwidthError, match=r"(no 'link_ready' reply|could not send).* admit"):
        probe_link(
            ctx, curve_sink.endpoint, 1024, 2, WAIT_S, keys=keys, sink="w1" if keys else None
        )
    assert time.monotonic() - started < WAIT_S + 2
    assert curve_sink.bad_messages == 0  # refused at the handshake: nothing reached the sink
    # an admitted worker still gets its answer
    w1 = CurveKeys.load(keydir, "worker", "w1")
    assert probe_bandwidth(ctx, curve_sink.endpoint, 1024, 2, 10, keys=w1, sink="w1") > 0


def test_curve_sink_refuses_a_prober_posing_as_another_worker(ctx, keydir, curve_sink):
    """w2's key under w1's routing identity: dropped and counted; no reply."""
    w1 = CurveKeys.load(keydir, "worker", "w1")
    spoof = connect_dealer(
        ctx, curve_sink.endpoint, "w1/bw-x", 5, CurveKeys.load(keydir, "worker", "w2"), w1.public
    )
    try:
        spoof.send_multipart(_frames(LinkHello(probe="p", count=1, nbytes=10)))
        deadline = time.monotonic() + 5
        while curve_sink.bad_messages < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert curve_sink.bad_messages == 1
        assert not spoof.poll(200)
    finally:
        spoof.close(0)


def test_curve_probe_needs_the_sinks_name(ctx, keydir):
    keys = CurveKeys.load(keydir, "worker", "w2")
    with pytest.raises(ValueError, match="needs the name of the sink's worker"):
        probe_link(ctx, "tcp://127.0.0.1:1", 1024, 1, 1.0, keys=keys)
    with pytest.raises(ConfigError, match="no public key"):
        probe_link(ctx, "tcp://127.0.0.1:1", 1024, 1, 1.0, keys=keys, sink="nobody")
