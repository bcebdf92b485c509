"""Detection rules on a fake clock: suspects are probed, silence after a probe is death,
standing still past the watchdog is a hang, and a straggler is never failed."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from common.codec import Limits, encode
from common.ids import DeviceId
from common.messages import Heartbeat, RoundDone
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.sockets import connect_dealer
from services.coordinator.jobs import DeviceLost, JobFailed
from services.coordinator.membership import (
    Members,
    Probes,
    check_liveness,
    hung,
    on_heartbeat,
    on_probe_reply,
    probe_sent,
    watchdog_s,
)
from services.coordinator.service import Coordinator
from services.worker.control import ControlLink

DEADLINE_S = 1.5
"""Heartbeat interval 0.5 s times 3 misses."""
PROBE_S = 2.0


def hb(device: str, progress: int = 0, waiting: bool = False) -> Heartbeat:
    return Heartbeat(
        device=DeviceId(device), data_addr="tcp://127.0.0.1:1", progress=progress, waiting=waiting
    )


def joined(*devices: str, now: float = 0.0) -> Members:
    state: Members = {}
    for d in devices:
        state = on_heartbeat(state, hb(d), now)
    return state


def check(state: Members, probes: Probes, now: float, among: tuple[str, ...] = ("a", "b")):
    return check_liveness(state, probes, now, [DeviceId(d) for d in among], DEADLINE_S, PROBE_S)


def test_overdue_heartbeats_make_a_suspect_that_is_probed_once():
    state = joined("a", "b")
    state = on_heartbeat(state, hb("a"), 1.0)
    assert check(state, {}, 1.5).probe == []  # b's deadline is not past yet
    found = check(state, {}, 1.6)
    assert found.probe == ["b"] and found.dead == [] and found.probes == {}
    probes = probe_sent(state, found.probes, DeviceId("b"), 7, 1.6)
    assert probes["b"].nonce == 7 and probes["b"].silent_s == 1.6
    again = check(state, probes, 2.0)
    assert again.probe == [] and again.dead == [] and set(again.probes) == {"b"}


def test_only_an_unanswered_probe_makes_a_suspect_dead():
    state = joined("a", "b")
    probes = probe_sent(state, {}, DeviceId("b"), 1, 1.6)
    state = on_heartbeat(state, hb("a"), 3.0)
    assert check(state, probes, 3.6).dead == []  # exactly the probe timeout: not yet
    found = check(state, probes, 3.61)
    assert found.dead == ["b"] and found.probe == []


def test_an_answered_probe_clears_the_suspect_and_counts_as_hearing_from_it():
    state = joined("a", "b")
    probes = probe_sent(state, {}, DeviceId("b"), 1, 1.6)
    state, probes, counted = on_probe_reply(state, probes, DeviceId("b"), 1, 2.0)
    assert counted and probes == {} and state["b"].last_seen == 2.0
    state = on_heartbeat(state, hb("a"), 3.0)
    assert check(state, probes, 3.4) == check(state, {}, 3.4)
    assert check(state, probes, 3.4).probe == []  # heard from 1.4 s ago
    assert check(state, probes, 3.6).probe == ["b"]  # silent again: a new suspicion


def test_a_heartbeat_after_the_probe_clears_it_too():
    state = joined("a", "b")
    probes = probe_sent(state, {}, DeviceId("b"), 1, 1.6)
    state = on_heartbeat(state, hb("b"), 1.7)
    state = on_heartbeat(state, hb("a"), 3.0)
    found = check(state, probes, 3.0)  # past the probe timeout, but b was heard from
    assert found.probes == {} and found.dead == [] and found.probe == []


def test_a_stale_nonce_or_a_late_answer_changes_nothing():
    state = joined("a", "b")
    probes = probe_sent(state, {}, DeviceId("b"), 2, 1.6)
    same = on_probe_reply(state, probes, DeviceId("b"), 1, 2.0)
    assert same == (state, probes, False)
    # declared dead: its probe closed; the answer that arrives afterwards is ignored
    assert on_probe_reply(state, {}, DeviceId("b"), 2, 9.0) == (state, {}, False)
    assert on_probe_reply(state, probes, DeviceId("x"), 2, 2.0) == (state, probes, False)


def test_only_devices_of_the_wait_are_probed_and_their_probes_kept():
    state = joined("a", "b", "c")
    assert check(state, {}, 2.0, among=("a",)).probe == ["a"]
    probes = probe_sent(state, {}, DeviceId("c"), 1, 1.6)
    assert check(state, probes, 5.0, among=("a",)).probes == {}  # c is no longer waited for


def test_two_suspects_die_together():
    state = joined("a", "b", "c")
    probes = probe_sent(state, {}, DeviceId("b"), 1, 1.6)
    probes = probe_sent(state, probes, DeviceId("c"), 2, 1.7)
    state = on_heartbeat(state, hb("a"), 3.5)
    assert check(state, probes, 3.65, among=("a", "b", "c")).dead == ["b"]
    assert check(state, probes, 3.75, among=("a", "b", "c")).dead == ["b", "c"]


# --- hung: heartbeats without progress ------------------------------------------


def beats(state: Members, device: str, times: list[float], progress, waiting=lambda t: False):
    for t in times:
        state = on_heartbeat(state, hb(device, progress(t), waiting(t)), t)
    return state


def ticks(start: float, end: float, step: float = 0.5) -> list[float]:
    return [start + i * step for i in range(int((end - start) / step) + 1)]


def test_a_device_that_heartbeats_without_progress_is_hung_after_the_watchdog():
    state = beats({}, "a", ticks(0.0, 10.0), progress=lambda t: min(int(t), 2))
    # progress last moved at t=2 (count 2): standing still since
    assert hung(state, 9.9, ["a"], watchdog_s=8.0, since=0.0) == []
    assert hung(state, 10.0, ["a"], watchdog_s=8.0, since=0.0) == []
    state = beats(state, "a", [10.5], progress=lambda t: 2)
    assert hung(state, 10.5, ["a"], watchdog_s=8.0, since=0.0) == ["a"]


def test_a_straggler_that_progresses_slowly_is_never_hung():
    # one task every 7 s, for a minute: slow, but each step comes within the watchdog
    state: Members = {}
    for t in ticks(0.0, 60.0):
        state = on_heartbeat(state, hb("a", progress=int(t // 7)), t)
        assert hung(state, t, ["a"], watchdog_s=8.0, since=0.0) == [], t


def test_a_device_waiting_on_a_peer_is_not_hung_its_blocker_is():
    # a group of three: b stalls at t=1; a and c wait in the all-reduce for it
    state: Members = {}
    for t in ticks(0.0, 20.0):
        state = on_heartbeat(state, hb("b", progress=min(int(t), 1)), t)
        for d in ("a", "c"):
            state = on_heartbeat(state, hb(d, progress=min(int(t), 2), waiting=t >= 2), t)
    assert hung(state, 20.0, ["a", "b", "c"], watchdog_s=8.0, since=0.0) == ["b"]


def test_the_clock_restarts_when_a_wait_on_a_peer_ends():
    # waited 30 s for a slow upstream stage, then computes a long forward
    state = beats({}, "a", ticks(0.0, 30.0), progress=lambda t: 0, waiting=lambda t: True)
    state = beats(state, "a", ticks(30.5, 37.0), progress=lambda t: 0)
    assert hung(state, 37.0, ["a"], watchdog_s=8.0, since=0.0) == []
    state = beats(state, "a", ticks(37.5, 38.5), progress=lambda t: 0)
    assert hung(state, 38.5, ["a"], watchdog_s=8.0, since=0.0) == ["a"]


def test_idle_time_before_the_wait_began_is_not_counted():
    # idle between rounds (the coordinator was busy), then the round starts at 100
    state = beats({}, "a", ticks(0.0, 105.0), progress=lambda t: 3)
    assert hung(state, 105.0, ["a"], watchdog_s=8.0, since=100.0) == []
    assert hung(state, 108.5, ["a"], watchdog_s=8.0, since=100.0) == ["a"]
    assert hung(state, 108.5, ["b"], watchdog_s=8.0, since=100.0) == []  # unknown: not here


def test_the_watchdog_follows_the_predicted_round_time_above_its_floor():
    assert watchdog_s(30.0, 10.0, None) == 30.0
    assert watchdog_s(30.0, 10.0, 0.0) == 30.0
    assert watchdog_s(30.0, 10.0, 1.5) == 30.0
    assert watchdog_s(30.0, 10.0, 4.5) == 45.0


# --- over a real ROUTER: the probe, its answer, and the watchdog in `gather` ----------


@pytest.fixture
def coord(redis_url, cluster_name):
    settings = CoordinatorSettings(
        bind=f"tcp://127.0.0.1:{free_port()}",
        redis_url=redis_url,
        cluster=cluster_name,
        heartbeat_s=0.2,
        heartbeat_misses=2,
        probe_timeout_s=1.0,
    )
    coordinator = Coordinator(settings)
    yield coordinator
    coordinator.close()


@pytest.fixture
def ctx():
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _joined(coord: Coordinator, device: str) -> None:
    deadline = time.monotonic() + 10
    while device not in coord.members:
        assert time.monotonic() < deadline, f"{device} did not join"
        coord.pump(0.05)


def test_a_worker_whose_heartbeats_stop_but_answers_probes_is_not_lost(coord, ctx):
    # its control thread heartbeats once (the interval is an hour) and answers probes,
    # while nothing reads its commands: a busy main thread must not matter
    link = ControlLink(
        ctx, coord.endpoint, "b", Limits(1 << 20), 3600.0, lambda: hb("b"), lambda _: None
    )
    link.start()
    try:
        _joined(coord, "b")
        with capture_logs() as logs, pytest.raises(JobFailed) as failed:
            coord.gather(RoundDone, [DeviceId("b")], 1, 0, timeout_s=3.0)
    finally:
        link.close()
    assert not isinstance(failed.value, DeviceLost)
    assert str(failed.value) == "no RoundDone of round 0 from ['b'] within 3 s"
    events = [e["event"] for e in logs]
    # suspected after 0.4 s of silence each time, and cleared by each answer
    assert events.count("probing suspect") >= 3, logs
    assert events.count("suspect answered the probe") >= 3, logs
    assert link.inbox.empty()  # answered by the control thread, never queued as a command


def test_a_worker_that_does_not_answer_its_probe_is_lost(coord, ctx):
    silent = connect_dealer(ctx, coord.endpoint, "b")  # heartbeats once, never reads
    try:
        silent.send_multipart(encode(hb("b"), "b"))
        _joined(coord, "b")
        t0 = time.monotonic()
        with capture_logs() as logs, pytest.raises(DeviceLost) as lost:
            coord.gather(RoundDone, [DeviceId("b")], 1, 4, timeout_s=30.0)
        took = time.monotonic() - t0
    finally:
        silent.close(0)
    assert lost.value.devices == ["b"]
    assert re.fullmatch(
        r"workers \['b'\] missed heartbeats for 1\.[4-9] s and did not answer a probe within "
        r"1 s while the coordinator waited for RoundDone of round 4",
        str(lost.value),
    ), str(lost.value)
    assert took < 0.4 + 1.0 + 1.0  # the deadline, the probe timeout, slack
    probed = [e for e in logs if e["event"] == "probing suspect"]
    assert [e["device"] for e in probed] == ["b"], logs
    # its answer arrives after it was declared dead: ignored, not a resurrection
    coord.members, coord.probes, counted = on_probe_reply(
        coord.members, coord.probes, DeviceId("b"), probed[0]["nonce"], time.monotonic()
    )
    assert not counted


def _beating(coord: Coordinator, ctx: zmq.Context[Any], progress: Any) -> threading.Event:
    """Heartbeat as `b` every 0.1 s with `progress(beat)` until the returned event is set."""
    stop = threading.Event()
    sock = connect_dealer(ctx, coord.endpoint, "b")

    def beat() -> None:
        n = 0
        while not stop.wait(0.1):
            sock.send_multipart(encode(hb("b", progress=progress(n)), "b"))
            n += 1
        sock.close(0)

    threading.Thread(target=beat, daemon=True).start()
    return stop


def test_the_watchdog_fails_a_worker_that_heartbeats_without_progress(coord, ctx):
    stop = _beating(coord, ctx, lambda n: min(n, 5))
    try:
        _joined(coord, "b")
        t0 = time.monotonic()
        with pytest.raises(DeviceLost) as lost:
            coord.gather(RoundDone, [DeviceId("b")], 1, 2, timeout_s=20.0, watchdog_s=1.5)
        took = time.monotonic() - t0
    finally:
        stop.set()
    assert lost.value.devices == ["b"]
    assert str(lost.value) == (
        "worker b heartbeats but made no progress for 1.5 s in round 2 (watchdog)"
    )
    assert 1.5 < took < 3.5


def test_the_watchdog_spares_a_worker_that_progresses(coord, ctx):
    stop = _beating(coord, ctx, lambda n: n // 5)  # one task every half second
    try:
        _joined(coord, "b")
        with pytest.raises(JobFailed) as failed:
            coord.gather(RoundDone, [DeviceId("b")], 1, 2, timeout_s=4.0, watchdog_s=1.5)
    finally:
        stop.set()
    assert not isinstance(failed.value, DeviceLost)
    assert str(failed.value) == "no RoundDone of round 2 from ['b'] within 4 s"
