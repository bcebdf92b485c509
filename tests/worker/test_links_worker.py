"""A worker measures its links to peers' bandwidth sinks when asked, beside its stage."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.curve import CurveKeys, create_key_set
from common.ids import DeviceId
from common.messages import LinksMeasured, MeasureLinks, Message
from services.worker import links
from services.worker.bandwidth import BandwidthSink
from services.worker.links import LinkProber, measure

A, B, C = DeviceId("a"), DeviceId("b"), DeviceId("c")
ABSENT = "tcp://127.0.0.1:1"


@pytest.fixture
def ctx():
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _req(targets: dict[DeviceId, str], timeout_s: float = 10.0, nonce: int = 1) -> MeasureLinks:
    return MeasureLinks(nonce=nonce, targets=targets, nbytes=64 << 10, count=4, timeout_s=timeout_s)


def test_each_target_gets_a_rate_or_an_error(ctx):
    with BandwidthSink(ctx) as sink:
        got = measure(ctx, A, _req({B: sink.endpoint, C: ABSENT}, timeout_s=0.5), None)
    assert (got.device, got.nonce) == (A, 1)
    assert set(got.rates) == {B} and got.rates[B] > 0
    assert set(got.errors) == {C} and got.errors[C].startswith("BandwidthError: no 'link_ready'")


def test_with_keys_the_probe_is_a_curve_client_of_the_targets_sink(ctx, tmp_path: Path):
    create_key_set(tmp_path, workers=["a", "b"])
    with BandwidthSink(ctx, keys=CurveKeys.load(tmp_path, "worker", "b")) as sink:
        got = measure(ctx, A, _req({B: sink.endpoint}), CurveKeys.load(tmp_path, "worker", "a"))
        assert sink.bad_messages == 0
    assert set(got.rates) == {B} and not got.errors


def test_the_prober_answers_later_and_refuses_a_second_measurement_meanwhile(ctx, monkeypatch):
    replies: queue.Queue[Message] = queue.Queue()
    gate = threading.Event()

    def held(*args: Any) -> LinksMeasured:
        gate.wait(10)  # the first measurement stays under way until the second is refused
        return measure(*args)

    monkeypatch.setattr(links, "measure", held)
    prober = LinkProber(ctx, A, None, replies.put)
    with BandwidthSink(ctx) as sink:
        prober.start(_req({B: sink.endpoint}, nonce=1))
        assert prober.busy
        prober.start(_req({B: sink.endpoint, C: sink.endpoint}, nonce=2))
        refused = replies.get(timeout=10)  # at once, from the caller's thread
        gate.set()
        done = replies.get(timeout=20)
        prober.join(10)
    assert isinstance(refused, LinksMeasured) and isinstance(done, LinksMeasured)
    assert refused.nonce == 2 and not refused.rates
    assert set(refused.errors) == {B, C} and "under way" in refused.errors[B]
    assert done.nonce == 1 and set(done.rates) == {B}
    assert not prober.busy


def test_the_request_that_follows_an_answer_at_once_is_measured(ctx):
    """The coordinator may send the next pair as soon as the answer arrives, before the
    prober's thread has ended: that request is measured, not refused as under way."""
    replies: queue.Queue[Message] = queue.Queue()
    with BandwidthSink(ctx) as sink:

        def reply(msg: Message) -> None:
            replies.put(msg)
            if isinstance(msg, LinksMeasured) and msg.nonce == 1:
                prober.start(_req({B: sink.endpoint}, nonce=2))  # still on the first's thread

        prober = LinkProber(ctx, A, None, reply)
        prober.start(_req({B: sink.endpoint}, nonce=1))
        first, second = replies.get(timeout=20), replies.get(timeout=20)
        prober.join(10)
    assert isinstance(first, LinksMeasured) and isinstance(second, LinksMeasured)
    assert second.nonce == 2 and not second.errors and set(second.rates) == {B}
