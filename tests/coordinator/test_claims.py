"""A device's claims: bounded on the wire, held against the fingerprint it names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.device import device_fingerprint
from common.ids import DeviceId
from common.messages import MAX_DEVICE_MEMORY, Heartbeat
from services.coordinator.claims import claim_problem, facts, memory_cap
from services.coordinator.membership import Member
from services.coordinator.profiling import cluster_for

GiB = 1 << 30
FP = "x86_64-8c-4t-q2.5-3.0g-0123456789"


def beat(device: str = "w", **fields: object) -> Heartbeat:
    base: dict[str, object] = {
        "device": DeviceId(device),
        "data_addr": "tcp://127.0.0.1:1",
        "fingerprint": FP,
        "threads": 4,
        "cores": 8,
        "cpu_quota": 2.5,
        "memory_budget": 2 * GiB,
    }
    return Heartbeat.model_validate({**base, **fields})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threads", 0),
        ("threads", 10**9),
        ("cores", 10**9),
        ("cpu_quota", 1e9),
        ("memory_budget", 10**18),
        ("memory_configured", 10**18),
        ("fingerprint", "x" * 900_000),
        ("fingerprint", "a b"),
        ("data_addr", "x" * 900_000),
        ("host", "h" * 900_000),
        ("state", "s" * 900_000),
        ("progress", 1 << 70),
    ],
)
def test_a_heartbeat_beyond_a_bound_is_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        beat(**{field: value})


def test_a_bounded_heartbeat_is_small():
    big = beat(
        data_addr="t" * 256,
        host="h" * 256,
        link_addr="l" * 256,
        fingerprint="f" * 160,
        state="s" * 32,
        version="v" * 64,
        threads=1024,
        memory_budget=MAX_DEVICE_MEMORY,
    )
    assert len(big.model_dump_json()) < 2048


def test_a_fingerprint_of_this_machine_reads_back():
    fp = device_fingerprint(3, 5 * GiB)
    f = facts(fp)
    assert f is not None and f.threads == 3 and f.memory_bytes == 5 * GiB
    assert facts("fp") is None and facts("x86_64-2c-1t-1.0g-nothex!!!!") is None


def test_claims_that_agree_with_their_fingerprint_pass():
    assert claim_problem(beat()) is None
    assert claim_problem(beat(memory_configured=3 * GiB)) is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"threads": 64}, "threads 64 (fingerprint: 4)"),
        ({"cores": 1}, "cores 1 (fingerprint: 8)"),
        ({"cpu_quota": 0.0}, "cpu_quota 0"),
        ({"cpu_quota": 16.0}, "cpu_quota 16"),
        ({"memory_configured": 64 * GiB}, "memory_configured"),
        ({"fingerprint": ""}, "no device fingerprint"),
        ({"fingerprint": "copied-from-a-blog"}, "not one a device computes"),
    ],
)
def test_claims_unlike_their_fingerprint_are_named(fields, named):
    why = claim_problem(beat(**fields))
    assert why is not None and named in why


def test_the_planner_never_sees_more_memory_than_the_fingerprint_names():
    liar = beat(memory_budget=MAX_DEVICE_MEMORY)
    assert memory_cap(liar) < 4 * GiB
    members = {DeviceId("w"): Member(DeviceId("w"), 0.0, liar)}
    cluster = cluster_for(members, {DeviceId("w"): "k"}, {"k": 0}, None, 1e6)
    assert cluster.devices[0].memory_bytes == memory_cap(liar)
    unknown = beat(fingerprint="arm64-8c-4t-q2.5-0.0g-0123456789", memory_budget=2 * GiB)
    assert memory_cap(unknown) == MAX_DEVICE_MEMORY  # a device that cannot read its memory
    honest = {DeviceId("w"): Member(DeviceId("w"), 0.0, beat())}
    kept = cluster_for(honest, {DeviceId("w"): "k"}, {"k": 0}, None, 1e6)
    assert kept.devices[0].memory_bytes == 2 * GiB
