"""The link matrix's pure parts, the messages that carry it, and the planner's cluster."""

from __future__ import annotations

import pytest
import zmq
from pydantic import ValidationError

from common.codec import Limits
from common.ids import DeviceId
from common.messages import (
    MAX_LINK_TARGETS,
    Heartbeat,
    LinkData,
    LinkHello,
    LinksMeasured,
    MeasureLinks,
    message_adapter,
)
from common.profile import ClusterSpec, DeviceSpec
from services.coordinator import links
from services.coordinator.membership import Member
from services.coordinator.profiling import cluster_for
from services.worker.bandwidth import BandwidthSink

A, B, C = DeviceId("a"), DeviceId("b"), DeviceId("c")


def test_each_unordered_pair_once_the_smaller_name_probing():
    assert links.pairs([C, A, B, A]) == [(A, B), (A, C), (B, C)]
    assert links.pairs([A]) == []
    assert links.pair_key("b", "a") == links.pair_key("a", "b") == "a|b"
    assert links.unmeasured([A, B, C], {"a|b": 1.0}) == ["a|c", "b|c"]


@pytest.mark.parametrize(
    ("total", "nbytes", "count"),
    [(4 << 20, 1 << 20, 4), (1000, 1000, 1), ((1 << 20) + 1, 1 << 20, 2)],
)
def test_a_request_streams_about_the_configured_bytes(total, nbytes, count):
    req = links.request(7, B, "tcp://127.0.0.1:9", total, 3.0)
    assert (req.nonce, req.targets, req.nbytes, req.count, req.timeout_s) == (
        7,
        {B: "tcp://127.0.0.1:9"},
        nbytes,
        count,
        3.0,
    )


def _req() -> MeasureLinks:
    return links.request(1, B, "tcp://127.0.0.1:9", 1 << 20, 1.0)


def test_an_answer_gives_rates_and_errors_by_pair():
    ok = LinksMeasured(device=A, nonce=1, rates={B: 5e6})
    assert links.answer(_req(), ok) == ({"a|b": 5e6}, {})
    failed = LinksMeasured(device=A, nonce=1, errors={B: "BandwidthError: no sink"})
    assert links.answer(_req(), failed) == ({}, {"a|b": "BandwidthError: no sink"})


@pytest.mark.parametrize(
    "reply",
    [
        LinksMeasured(device=A, nonce=1, rates={C: 5e6}),  # a device not asked about
        LinksMeasured(device=A, nonce=1, rates={B: 5e6, C: 1e6}),  # one more than asked
        LinksMeasured(device=A, nonce=1),  # leaves the target out
        LinksMeasured(device=A, nonce=1, rates={B: 5e6}, errors={B: "x"}),  # both
    ],
)
def test_an_answer_that_does_not_match_the_request_is_not_trusted(reply):
    rates, errors = links.answer(_req(), reply)
    assert rates == {}
    assert list(errors) == ["a|b"] and "asked for ['b']" in errors["a|b"]


def test_the_stored_matrix_round_trips():
    m = links.LinkMatrix(measured_at=1.5, devices=["a", "b"], links={"a|b": 2e6}, errors={})
    assert links.LinkMatrix.model_validate(m.model_dump(mode="json")) == m


# --- messages ------------------------------------------------------------------------


def _valid(body: dict[str, object]) -> object:
    return message_adapter.validate_python(body)


@pytest.mark.parametrize(
    "change",
    [
        {"targets": {}},  # nothing to measure
        {"targets": {f"d{i}": "tcp://h:1" for i in range(MAX_LINK_TARGETS + 1)}},
        {"targets": {"b": "ipc:///tmp/sock"}},  # only TCP endpoints
        {"targets": {"b": "tcp://h:1/../x"}},
        {"targets": {"b" * 256: "tcp://h:1"}},
        {"nbytes": 0},
        {"nbytes": (64 << 20) + 1},
        {"count": 0},
        {"count": 10**7},
        {"timeout_s": 0},
        {"timeout_s": 601},
        {"nonce": -1},
    ],
)
def test_measure_links_is_bounded(change):
    body = {"type": "measure_links", "nonce": 1, "targets": {"b": "tcp://h:1"}, "nbytes": 1}
    body |= {"count": 1, "timeout_s": 1.0}
    _valid(body)
    with pytest.raises(ValidationError):
        _valid(body | change)


@pytest.mark.parametrize(
    "change",
    [
        {"rates": {"b": float("nan")}},
        {"rates": {"b": float("inf")}},
        {"rates": {"b": 0.0}},
        {"rates": {"b": -1.0}},
        {"rates": {f"d{i}": 1.0 for i in range(MAX_LINK_TARGETS + 1)}},
        {"errors": {f"d{i}": "x" for i in range(MAX_LINK_TARGETS + 1)}},
        {"errors": {"b": "x" * 501}},
        {"rates": {"": 1.0}},
        {"extra": 1},
    ],
)
def test_links_measured_is_bounded(change):
    body = {"type": "links_measured", "device": "a", "nonce": 1, "rates": {"b": 1e6}}
    _valid(body)
    with pytest.raises(ValidationError):
        _valid(body | change)


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (LinkHello, {"probe": "p q", "count": 1, "nbytes": 1}),  # not an id
        (LinkHello, {"probe": "p", "count": 0, "nbytes": 1}),
        (LinkHello, {"probe": "p", "count": 1, "nbytes": 1 << 40}),
        (LinkData, {"probe": "x" * 65, "seq": 0}),
        (LinkData, {"probe": "p", "seq": -1}),
    ],
)
def test_probe_messages_are_bounded(kind, body):
    with pytest.raises(ValidationError):
        kind.model_validate(body)


def test_a_heartbeat_advertises_its_sink_within_bounds():
    hb = Heartbeat(device=A, data_addr="tcp://h:1", link_addr="tcp://h:2")
    assert hb.link_addr == "tcp://h:2"
    assert Heartbeat(device=A, data_addr="tcp://h:1").link_addr == ""  # runs none
    with pytest.raises(ValidationError):
        Heartbeat(device=A, data_addr="tcp://h:1", link_addr="x" * 257)


def test_a_sinks_limits_are_one_bounded_payload():
    ctx = zmq.Context()
    try:
        sink = BandwidthSink(ctx, limits=Limits(max_tensor_bytes=1 << 40))
        assert (sink.limits.max_tensors, sink.limits.max_tensor_bytes) == (1, 64 << 20)
        sink.close()
    finally:
        ctx.destroy(linger=0)


# --- the cluster the planner sees ---------------------------------------------------


def _members(*names: str) -> dict[DeviceId, Member]:
    return {
        DeviceId(n): Member(
            DeviceId(n),
            0.0,
            Heartbeat(device=DeviceId(n), data_addr="tcp://h:1", memory_budget=1 << 30),
        )
        for n in names
    }


KEYS = {A: "k", B: "k", C: "k"}


def test_measured_links_reach_the_cluster_and_the_rest_falls_back():
    measured = {"a|b": 3e6, "a|c": 4e6}
    cluster = cluster_for(_members("a", "b", "c"), KEYS, {"k": 1}, None, 9e6, measured)
    assert cluster.links == measured and cluster.bandwidth == 9e6
    assert (cluster.bw("b", "a"), cluster.bw("a", "c"), cluster.bw("b", "c")) == (3e6, 4e6, 9e6)
    # without a measurement every link gets the constant, as before
    plain = cluster_for(_members("a", "b"), KEYS, {"k": 1}, None, 9e6)
    assert plain.links == {} and plain.bw("a", "b") == 9e6


def test_a_cluster_spec_with_links_wins_over_measurement():
    devices = [DeviceSpec(name="a", memory_bytes=1, profile="k")]
    base = ClusterSpec(devices=devices, bandwidth=5e6, links={"a|b": 1e6}, latency_s=0.01)
    cluster = cluster_for(_members("a", "b"), KEYS, {"k": 1}, base, 9e6, {"a|b": 7e6})
    assert cluster.links == {"a|b": 1e6} and cluster.latency_s == 0.01
    # a spec without links: measured links, its own bandwidth the fallback
    bare = ClusterSpec(devices=devices, bandwidth=5e6)
    cluster = cluster_for(_members("a", "b", "c"), KEYS, {"k": 1}, bare, 9e6, {"a|b": 7e6})
    assert cluster.links == {"a|b": 7e6} and cluster.bw("a", "c") == 5e6
