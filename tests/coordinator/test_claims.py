"""A device's claims: bounded on the wire, held against its fingerprint, proven by an answer."""

from __future__ import annotations

from collections import deque

import pytest
from pydantic import ValidationError

from common.device import device_fingerprint
from common.errors import AsteroidError
from common.ids import DeviceId
from common.messages import MAX_DEVICE_MEMORY, Heartbeat, Message, Probe, ProbeReply
from services.coordinator.claims import claim_problem, facts, memory_cap
from services.coordinator.membership import Member, Members
from services.coordinator.profiling import cluster_for
from services.coordinator.vetting import Vetting

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


class Shell:
    """The coordinator as vetting sees it: devices in `answering` answer each probe."""

    def __init__(self, members: Members, answering: set[str]) -> None:
        self.members = members
        self.answering = answering
        self.inbox: deque[tuple[DeviceId, Message]] = deque()
        self.collecting = False
        self.running: str | None = None
        self.sent: list[tuple[DeviceId, Message]] = []
        self.outbox: list[tuple[DeviceId, Message]] = []

    def send(self, device: DeviceId, msg: Message) -> None:
        self.sent.append((device, msg))
        if device in self.answering and isinstance(msg, Probe):
            self.outbox.append((device, ProbeReply(device=device, nonce=msg.nonce)))

    def pump(self, timeout_s: float) -> None:
        if self.collecting:  # else the coordinator's suspect bookkeeping takes answers
            self.inbox.extend(self.outbox)
            self.outbox.clear()

    def alive(self) -> Members:
        return dict(self.members)

    def check_cancelled(self, jid: str) -> None:
        pass


def _members(*beats: Heartbeat) -> Members:
    return {hb.device: Member(hb.device, 0.0, hb) for hb in beats}


def test_a_device_that_does_not_answer_the_challenge_is_left_out():
    members = _members(beat("a"), beat("b"), beat("fake"))
    shell = Shell(members, answering={"a", "b"})
    other = (DeviceId("a"), ProbeReply(device=DeviceId("a"), nonce=7))  # a suspect's answer
    shell.inbox.append(other)
    vetting = Vetting(shell, timeout_s=0.2)
    assert sorted(vetting.vetted(members)) == ["a", "b"]
    assert "did not answer a challenge" in vetting.refused[DeviceId("fake")]
    assert list(shell.inbox) == [other] and not shell.collecting
    nonces = [m.nonce for _, m in shell.sent if isinstance(m, Probe)]
    assert len(nonces) == 3 and all(n < 0 for n in nonces)  # never a suspect's nonce
    # proven once is enough for the job; the silent one is challenged again
    shell.sent.clear()
    assert sorted(vetting.vetted(members)) == ["a", "b"]
    assert [d for d, _ in shell.sent] == ["fake"]


def test_a_device_whose_claims_lie_is_not_even_challenged():
    members = _members(beat("a"), beat("big", threads=1024))
    shell = Shell(members, answering={"a", "big"})
    vetting = Vetting(shell, timeout_s=0.2)
    assert list(vetting.vetted(members)) == ["a"]
    assert [d for d, _ in shell.sent] == ["a"]
    assert "threads 1024" in vetting.refused[DeviceId("big")]


def test_waiting_for_min_workers_counts_vetted_devices_only():
    members = _members(beat("a"), beat("fake"))
    vetting = Vetting(Shell(members, answering={"a"}), timeout_s=0.05)
    assert list(vetting.wait(1, timeout_s=5)) == ["a"]
    with pytest.raises(AsteroidError, match=r"2 workers wanted, 1 joined and vetted.*fake"):
        vetting.wait(2, timeout_s=0.3)
