import threading
import time

import msgpack
import pytest
import zmq

from services.profiler.bandwidth import BandwidthError, BandwidthSink, probe_bandwidth, probe_link


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
    with pytest.raises(BandwidthError, match=r"no 'ready' reply .* within the probe's 0.3 s"):
        probe_bandwidth(ctx, "tcp://127.0.0.1:1", nbytes=1024, count=2, timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert isinstance(BandwidthError("x"), TimeoutError)


def test_sink_survives_malformed_frames(ctx, sink):
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(sink.endpoint)
    bad.send(b"\xc1not msgpack")
    bad.send(msgpack.packb({"v": 1, "kind": "data", "probe": "nobody"}))  # data without hello
    bad.send(msgpack.packb({"v": 2, "kind": "hello", "probe": "x"}))  # unknown version
    bad.send_multipart([b"a", b"b", b"c"])  # too many frames
    hello = {"v": 1, "kind": "hello", "probe": "p", "count": 1, "nbytes": 10}
    bad.send(msgpack.packb(hello))
    assert bad.poll(5000)
    bad.recv()  # ready
    bad.send_multipart([msgpack.packb({"v": 1, "kind": "data", "probe": "p"}), b"short"])
    deadline = time.monotonic() + 5
    while sink.bad_messages < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.bad_messages == 5
    bad.close(0)
    assert probe_bandwidth(ctx, sink.endpoint, nbytes=1024, count=4) > 0  # still serving


@pytest.mark.parametrize(("nbytes", "count", "timeout_s"), [(0, 1, 1.0), (1, 0, 1.0), (1, 1, 0)])
def test_bad_probe_arguments(ctx, nbytes, count, timeout_s):
    with pytest.raises(ValueError, match="need nbytes"):
        probe_link(ctx, "tcp://127.0.0.1:1", nbytes, count, timeout_s)
