"""Signals on a fake clock: a closed connection is a suspect after the flap grace, then a
probe, then a loss; anything heard from the device within the grace clears it; a silent
neighbour's report is a probe, never a loss by itself; a report that does not fit the
running plan and epoch is dropped and names its sender."""

from __future__ import annotations

from dataclasses import replace

from common.ids import DeviceId
from common.messages import Heartbeat, RoundDone, RunRound
from services.coordinator import core, detection
from services.coordinator.core import (
    Beats,
    Disconnected,
    Log,
    Lost,
    PeerSilent,
    ProbeAnswer,
    Reconnected,
    Reply,
    SendProbe,
    Tick,
    Wait,
)
from services.coordinator.detection import COORDINATOR, MAX_SIGNALS, Signal
from services.coordinator.membership import Members, on_heartbeat

A, B, C = DeviceId("a"), DeviceId("b"), DeviceId("c")
EPOCH = 4
GRACE_S = 0.3
PROBE_S = 0.2
DEADLINE_S = 30.0
"""Far beyond the scripts below: here only signals make suspects, never missed heartbeats."""


def hb(device: DeviceId) -> Heartbeat:
    return Heartbeat(device=device, data_addr="tcp://127.0.0.1:1")


def members(now: float = 0.0) -> Members:
    state: Members = {}
    for d in (A, B, C):
        state = on_heartbeat(state, hb(d), now)
    return state


def wait(now: float = 0.0) -> Wait:
    return core.begin(
        RoundDone,
        [A, B, C],
        EPOCH,
        7,
        now,
        timeout_s=60.0,
        heartbeat_deadline_s=DEADLINE_S,
        probe_timeout_s=PROBE_S,
        members=members(),
        flap_grace_s=GRACE_S,
    )


def run(w: Wait, script: list[tuple[float, core.Event]]) -> tuple[Wait, list[core.Command]]:
    """Feed `script`'s (time, event) pairs; every command, in order."""
    out: list[core.Command] = []
    for now, event in script:
        w, cmds = core.apply(w, event, now)
        out.extend(cmds)
    return w, out


def of(kind: type, commands: list[core.Command]) -> list:
    return [c for c in commands if isinstance(c, kind)]


def closed(at: float, device: DeviceId = B) -> Disconnected:
    return Disconnected(device, COORDINATOR, at)


def peer_closed(at: float, device: DeviceId = B) -> Disconnected:
    return Disconnected(device, C if device != C else A, at, EPOCH)


def test_a_closed_connection_not_back_after_the_grace_is_lost_at_once_naming_the_signals():
    w, out = run(
        wait(),
        [
            (0.50, closed(0.50)),
            (0.55, Tick()),
            (0.51 + GRACE_S, Reply(A, _unrelated())),  # an unrelated reply: ignored
            (0.49 + GRACE_S, Tick()),  # before the grace is over: nothing yet
        ],
    )
    assert not of(SendProbe, out) and not of(Lost, out)
    w, out = run(w, [(0.52 + GRACE_S, Tick())])
    assert not of(SendProbe, out)  # no probe could reach it: its connection is gone
    (lost,) = of(Lost, out)
    assert lost.devices == [B]
    assert lost.reason == (
        "workers ['b'] lost while the coordinator waited for RoundDone of round 7: "
        "b: control connection closed 0.32 s ago; not back within the 0.30 s grace"
    )
    assert w.done and B not in w.suspects and B not in w.probes


def test_a_neighbours_closed_connection_is_probed_after_the_grace_then_lost():
    w, out = run(wait(), [(0.5, Disconnected(B, A, 0.5, EPOCH)), (0.49 + GRACE_S, Tick())])
    assert not of(SendProbe, out)
    w, out = run(w, [(0.51 + GRACE_S, Tick())])
    assert [p.device for p in of(SendProbe, out)] == [B]  # its control link may be fine
    w, out = run(w, [(0.52 + GRACE_S + PROBE_S, Tick())])
    (lost,) = of(Lost, out)
    assert lost.reason.endswith(
        "b: a reported its connection to it closed 0.52 s ago; probe unanswered for 0.21 s"
    )


def _unrelated() -> RunRound:
    return RunRound(epoch=EPOCH, round=7)


def test_a_heartbeat_within_the_grace_clears_the_suspect():
    w, _ = run(wait(), [(1.0, closed(1.0))])
    assert B in w.suspects
    back = on_heartbeat(w.members, hb(B), 1.0 + GRACE_S / 2)
    w, out = run(w, [(1.0 + GRACE_S / 2, Beats(back)), (2.0, Tick()), (5.0, Tick())])
    assert not of(SendProbe, out) and not of(Lost, out)
    assert w.suspects == {} and not w.done


def test_a_heartbeat_read_before_the_close_does_not_clear_it():
    early = on_heartbeat(members(), hb(B), 0.9)
    _w, out = run(
        wait(),
        [(0.9, Beats(early)), (1.0, closed(1.0)), (1.0 + GRACE_S + 0.01, Tick())],
    )
    assert [lost.devices for lost in of(Lost, out)] == [[B]]


def test_a_reconnect_reported_within_the_grace_clears_the_suspect():
    _w, out = run(
        wait(),
        [
            (1.0, Disconnected(B, A, 1.0, EPOCH)),
            (1.1, Reconnected(B, A, EPOCH)),
            (1.0 + GRACE_S + 0.1, Tick()),
        ],
    )
    assert not of(SendProbe, out)
    assert [c.event for c in of(Log, out)] == ["suspect", "suspect reconnected"]


def test_an_answered_probe_clears_the_suspect_and_a_late_answer_after_the_loss_changes_nothing():
    w, out = run(wait(), [(0.0, peer_closed(0.0)), (GRACE_S + 0.01, Tick())])
    (probe,) = of(SendProbe, out)
    w, out = run(w, [(GRACE_S + 0.05, ProbeAnswer(B, probe.nonce)), (5.0, Tick())])
    assert [c.device for c in of(core.Heard, out)] == [B]
    assert not of(Lost, out) and w.suspects == {} and w.probes == {}
    # a second close: this time nobody answers, and the answer comes after the verdict
    w, out = run(w, [(6.0, peer_closed(6.0)), (6.0 + GRACE_S + 0.01, Tick())])
    (probe,) = of(SendProbe, out)
    w, out = run(w, [(6.0 + GRACE_S + PROBE_S + 0.02, Tick())])
    assert of(Lost, out) and w.done
    after, out = run(w, [(7.0, ProbeAnswer(B, probe.nonce)), (7.1, Tick())])
    assert after == w and out == []


def test_a_silent_neighbour_report_probes_at_once_and_an_answer_is_the_end_of_it():
    w, out = run(wait(), [(2.0, PeerSilent(B, A, 1.5, EPOCH)), (2.01, Tick())])
    (probe,) = of(SendProbe, out)
    assert probe.device == B
    w, out = run(w, [(2.05, ProbeAnswer(B, probe.nonce)), (9.0, Tick())])
    assert not of(Lost, out) and not of(SendProbe, out) and w.suspects == {}


def test_a_silent_report_left_unanswered_names_the_reporter_and_its_wait():
    _w, out = run(
        wait(),
        [(2.0, PeerSilent(B, A, 1.5, EPOCH)), (2.01, Tick()), (2.01 + PROBE_S + 0.01, Tick())],
    )
    (lost,) = of(Lost, out)
    assert "b: a waited 1.50 s for its data; probe unanswered for 0.21 s" in lost.reason


def test_every_signal_is_named_once_per_reporter_and_kept_bounded():
    script: list[tuple[float, core.Event]] = [(0.0, closed(0.0))]
    script += [(0.01 * i, Disconnected(B, A, 0.01 * i, EPOCH)) for i in range(1, 20)]
    w, _ = run(wait(), script)
    assert [(s.reporter, s.at) for s in w.suspects[B].signals] == [(COORDINATOR, 0.0), (A, 0.19)]
    assert w.suspects[B].since == 0.0  # the earliest signal still counts
    w, out = run(w, [(0.31, Tick())])
    (lost,) = of(Lost, out)
    assert "a reported its connection to it closed" in lost.reason
    assert lost.reason.endswith("not back within the 0.30 s grace")
    many = {B: detection.Suspicion(0.0, 0.3, (Signal(0.0, COORDINATOR, "disconnected"),))}
    for i in range(3 * MAX_SIGNALS):
        signal = Signal(0.01 * i, DeviceId(f"n{i}"), "disconnected")
        many = detection.suspect(many, members(), B, signal, 1.0)
    kept = many[B].signals
    assert len(kept) == MAX_SIGNALS and kept[0].reporter == COORDINATOR


def test_two_devices_closed_together_are_lost_together():
    _w, out = run(wait(), [(0.0, closed(0.0, B)), (0.0, closed(0.0, C)), (0.31, Tick())])
    (lost,) = of(Lost, out)
    assert lost.devices == [B, C]
    assert "b: control connection closed" in lost.reason
    assert "c: control connection closed" in lost.reason


def test_hostile_or_stale_reports_are_dropped_naming_the_sender():
    stranger = DeviceId("mallory")
    w, out = run(
        wait(),
        [
            (0.0, Disconnected(B, A, 0.0, EPOCH - 1)),  # an older plan's report
            (0.0, Disconnected(B, stranger, 0.0, EPOCH)),  # the reporter is not in the plan
            (0.0, Disconnected(stranger, A, 0.0, EPOCH)),  # about a device not in the plan
            (0.0, Disconnected(B, B, 0.0, EPOCH)),  # about itself
            (0.0, PeerSilent(C, stranger, 3.0, EPOCH)),
            (0.0, Disconnected(B, COORDINATOR, 0.0, EPOCH)),  # a peer named coordinator
            (5.0, Tick()),
        ],
    )
    assert w.suspects == {} and not of(SendProbe, out) and not w.done
    dropped = [c for c in of(Log, out) if c.event == "dropped a liveness report"]
    assert [c.level for c in dropped] == ["warning"] * 6
    assert [c.fields["peer"] for c in dropped] == [A, stranger, A, B, stranger, COORDINATOR]
    assert "epoch 3 is not the current 4" in str(dropped[0].fields["reason"])


def test_the_coordinators_own_socket_speaks_of_clients_too_and_that_is_no_warning():
    w, out = run(wait(), [(0.0, Disconnected(DeviceId("cli/1"), COORDINATOR, 0.0))])
    assert w.suspects == {}
    assert [(c.level, c.event) for c in of(Log, out)] == [("debug", "ignored a closed connection")]


def test_suspects_carry_over_to_the_next_wait_and_leave_with_the_plan():
    w, _ = run(wait(), [(1.0, closed(1.0))])
    nxt = core.begin(
        RoundDone,
        [A, B],
        EPOCH,
        8,
        1.1,
        60.0,
        DEADLINE_S,
        PROBE_S,
        members=w.members,
        suspects=w.suspects,
        flap_grace_s=GRACE_S,
    )
    assert B in nxt.suspects
    _, out = run(nxt, [(1.0 + GRACE_S + 0.01, Tick())])
    assert [lost.devices for lost in of(Lost, out)] == [[B]]
    gone = core.begin(
        RoundDone, [A, C], EPOCH, 8, 1.1, 60.0, DEADLINE_S, PROBE_S, suspects=w.suspects
    )
    assert gone.suspects == {}


def test_missed_heartbeats_alone_still_read_as_before():
    w = replace(wait(), heartbeat_deadline_s=1.0)
    w, out = run(w, [(1.5, Tick()), (1.5 + PROBE_S + 0.01, Tick())])
    (lost,) = of(Lost, out)
    assert lost.reason.startswith("workers ['a', 'b', 'c'] missed heartbeats for 1.7 s")


def test_signal_texts():
    assert Signal(1.0, COORDINATOR, "disconnected").text(1.25) == (
        "control connection closed 0.25 s ago"
    )
    assert Signal(1.0, A, "disconnected").text(2.0) == (
        "a reported its connection to it closed 1.00 s ago"
    )
    assert Signal(1.0, A, "silent", 2.5).text(9.0) == "a waited 2.50 s for its data"
    assert detection.refusal(A, B, {A, B}, EPOCH, EPOCH) is None
