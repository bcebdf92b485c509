"""The wait for a step's replies, by scripted events on a fake clock and no sockets.

Heartbeats are fed as membership snapshots built with `on_heartbeat`, the way
the coordinator's pump builds them; the times are seconds from the wait's start.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.ids import DeviceId
from common.messages import Assigned, Heartbeat, RoundDone, WorkerError
from services.coordinator.core import (
    Beats,
    Command,
    Complete,
    Event,
    Fail,
    Heard,
    Log,
    Lost,
    ProbeAnswer,
    Reply,
    SendProbe,
    Tick,
    Wait,
    apply,
    begin,
)
from services.coordinator.membership import Members, on_heartbeat, probe_sent

EPOCH = 2
ROUND = 5
DEADLINE_S = 1.5
"""Heartbeat interval 0.5 s times 3 misses."""
PROBE_S = 2.0
A, B, C = DeviceId("a"), DeviceId("b"), DeviceId("c")


def hb(device: DeviceId, progress: int = 0, waiting: bool = False) -> Heartbeat:
    return Heartbeat(
        device=device, data_addr="tcp://127.0.0.1:1", progress=progress, waiting=waiting
    )


def beat(members: Members, device: DeviceId, now: float, progress: int = 0) -> Members:
    return on_heartbeat(members, hb(device, progress), now)


def joined(*devices: DeviceId, now: float = 0.0) -> Members:
    members: Members = {}
    for d in devices:
        members = beat(members, d, now)
    return members


def done(device: DeviceId, epoch: int = EPOCH, round_no: int = ROUND) -> RoundDone:
    return RoundDone(device=device, epoch=epoch, round=round_no, stage=0, samples=8)


def error(device: DeviceId, epoch: int = EPOCH) -> WorkerError:
    return WorkerError(device=device, epoch=epoch, round=ROUND, error="out of memory")


def start(
    *devices: DeviceId,
    members: Members | None = None,
    timeout_s: float = 60.0,
    watchdog_s: float | None = None,
) -> Wait:
    return begin(
        RoundDone,
        list(devices),
        EPOCH,
        ROUND,
        0.0,
        timeout_s,
        DEADLINE_S,
        PROBE_S,
        watchdog_s,
        members if members is not None else joined(*devices),
    )


def run(wait: Wait, script: Iterable[tuple[float, Event]]) -> tuple[Wait, list[Command]]:
    """Feed `script` (time, event) in order; the final wait and every command returned."""
    out: list[Command] = []
    for now, event in script:
        wait, commands = apply(wait, event, now)
        out += commands
    return wait, out


def verdicts(commands: list[Command]) -> list[Command]:
    return [c for c in commands if isinstance(c, Lost | Fail | Complete)]


def probes_sent(commands: list[Command]) -> list[SendProbe]:
    return [c for c in commands if isinstance(c, SendProbe)]


# --- replies ------------------------------------------------------------------


def test_replies_of_this_round_complete_the_wait():
    wait, commands = run(start(A, B), [(0.1, Reply(A, done(A))), (0.2, Tick())])
    assert commands == [] and not wait.done and set(wait.got) == {A}
    wait, commands = apply(wait, Reply(B, done(B)), 0.3)
    assert commands == [Complete({A: done(A), B: done(B)})]
    assert wait.done


def test_nothing_to_wait_for_is_done_at_once():
    assert start().done


def test_a_late_round_done_from_an_old_epoch_is_ignored():
    stale = [done(A, epoch=EPOCH - 1), done(A, round_no=ROUND - 1)]
    wait, commands = run(start(A), [(0.1, Reply(A, m)) for m in stale])
    assert verdicts(commands) == [] and wait.got == {}
    assert [c.event for c in commands if isinstance(c, Log)] == ["ignored stale reply"] * 2


def test_replies_of_another_kind_or_from_outside_the_plan_are_ignored():
    other = Assigned(device=A, epoch=EPOCH, round=ROUND, param_bytes=1)
    wait, commands = run(start(A), [(0.1, Reply(A, other)), (0.2, Reply(C, done(C)))])
    assert verdicts(commands) == [] and wait.got == {}


def test_a_worker_error_of_this_epoch_fails_the_wait():
    wait, commands = run(start(A, B), [(0.1, Reply(B, error(B)))])
    assert commands == [Fail("worker b failed in round 5: out of memory")]
    assert wait.done


def test_a_worker_error_of_an_old_epoch_or_an_outsider_is_ignored():
    script = [(0.1, Reply(A, error(A, epoch=EPOCH - 1))), (0.2, Reply(C, error(C)))]
    wait, commands = run(start(A, B), script)
    assert verdicts(commands) == [] and not wait.done


def test_a_finished_wait_ignores_everything_after_its_verdict():
    wait, _ = run(start(A, B), [(0.1, Reply(B, error(B)))])
    later = [Reply(A, done(A)), Reply(A, error(A)), Tick(), ProbeAnswer(A, 1), Beats({})]
    for event in later:
        assert apply(wait, event, 99.0) == (wait, [])


# --- suspects and probes ------------------------------------------------------


def test_a_suspect_is_probed_once_and_its_answer_clears_it():
    members = beat(joined(A, B), A, 1.0)
    wait = start(A, B, members=members)
    wait, commands = run(wait, [(1.4, Tick())])
    assert commands == []  # b's deadline (1.5 s of silence) is not past yet
    wait, commands = run(wait, [(1.6, Tick()), (1.7, Tick()), (1.8, Tick())])
    assert probes_sent(commands) == [SendProbe(B, 1, 1.6)]
    assert set(wait.probes) == {B} and wait.next_nonce == 2
    wait, commands = apply(wait, ProbeAnswer(B, 1), 2.0)
    assert Heard(B, 2.0) in commands and wait.probes == {} and wait.members[B].last_seen == 2.0
    wait, commands = run(wait, [(3.0, Beats(beat(wait.members, A, 3.0))), (3.4, Tick())])
    assert commands == [] and not wait.done  # heard from at 2.0: not a suspect again yet


def test_a_heartbeat_after_the_probe_clears_it_too():
    wait = start(A, B, members=beat(joined(A, B), A, 1.0))
    wait, _ = run(wait, [(1.6, Tick())])
    members = beat(beat(wait.members, A, 1.8), B, 1.9)
    wait, commands = run(wait, [(2.0, Beats(members)), (2.5, Tick())])
    assert commands == [] and wait.probes == {}


def test_a_suspect_that_does_not_answer_in_time_is_lost():
    members = beat(joined(A, B), A, 1.0)
    wait = start(A, B, members=members)
    script: list[tuple[float, Event]] = [(1.6, Tick()), (3.5, Tick())]
    wait, commands = run(wait, script)
    assert verdicts(commands) == []  # 1.9 s after the probe: within the probe timeout
    wait, commands = apply(wait, Tick(), 3.7)
    assert commands == [
        Lost(
            [B],
            "workers ['b'] missed heartbeats for 3.7 s and did not answer a probe within 2 s "
            "while the coordinator waited for RoundDone of round 5",
        )
    ]
    assert wait.done and B not in wait.probes


def test_a_probe_answer_after_the_device_was_declared_lost_changes_nothing():
    wait, _ = run(start(B), [(1.6, Tick()), (3.7, Tick())])
    assert wait.done
    assert apply(wait, ProbeAnswer(B, 1), 3.8) == (wait, [])
    # and a wait that comes next, with the closed probes, does not count it either
    following = begin(
        RoundDone,
        [B],
        EPOCH,
        ROUND + 1,
        4.0,
        60.0,
        DEADLINE_S,
        PROBE_S,
        None,
        wait.members,
        wait.probes,
        wait.next_nonce,
    )
    after, commands = apply(following, ProbeAnswer(B, 1), 4.1)
    assert after == following and [type(c) for c in commands] == [Log]
    assert after.members[B].last_seen == 0.0


def test_a_stale_nonce_changes_nothing():
    wait, _ = run(start(B), [(1.6, Tick())])
    after, commands = apply(wait, ProbeAnswer(B, 7), 1.7)
    assert after == wait and not any(isinstance(c, Heard) for c in commands)


def test_a_probe_from_the_last_step_can_be_answered_in_this_one():
    members = joined(B)
    probes = probe_sent(members, {}, B, 4, 1.6)
    wait = begin(
        RoundDone, [B], EPOCH, ROUND, 2.0, 60.0, DEADLINE_S, PROBE_S, None, members, probes, 5
    )
    wait, commands = apply(wait, ProbeAnswer(B, 4), 2.5)
    assert Heard(B, 2.5) in commands and wait.probes == {}
    wait, commands = run(wait, [(3.0, Tick())])
    assert commands == [] and wait.next_nonce == 5  # nonces are never reused


def test_two_failures_in_one_round_are_one_loss_naming_both():
    # one loss, so the job recovers once, without both, rather than once for each
    members = beat(joined(A, B, C), A, 1.0)
    wait, commands = run(start(A, B, C, members=members), [(1.6, Tick())])
    assert probes_sent(commands) == [SendProbe(B, 1, 1.6), SendProbe(C, 2, 1.6)]
    wait, commands = run(wait, [(2.0, Beats(beat(wait.members, A, 2.0))), (3.7, Tick())])
    assert len(verdicts(commands)) == 1
    (lost,) = verdicts(commands)
    assert isinstance(lost, Lost) and lost.devices == [B, C]
    assert lost.reason.startswith("workers ['b', 'c'] missed heartbeats for 3.7 s")


def test_a_device_that_replied_and_then_went_silent_is_still_lost():
    # the step goes on with its peers (an all-reduce, a checkpoint), so its silence matters
    _, commands = run(start(A, B), [(0.1, Reply(A, done(A))), (1.6, Tick()), (3.7, Tick())])
    lost = verdicts(commands)
    assert len(lost) == 1 and isinstance(lost[0], Lost) and lost[0].devices == [A, B]


# --- the watchdog -------------------------------------------------------------


def _beating(wait: Wait, device: DeviceId, until: float, progress: int | None = None) -> Wait:
    """`device` heartbeats every 0.1 s until `until`, its progress fixed or moving each beat."""
    t, n = 0.1, 0
    while t <= until:
        members = beat(wait.members, device, t, n if progress is None else progress)
        wait, _ = run(wait, [(t, Beats(members)), (t, Tick())])
        if wait.done:
            return wait
        t, n = round(t + 0.1, 1), n + 1
    return wait


def test_a_device_that_heartbeats_without_progress_is_hung_after_the_watchdog():
    wait = start(B, watchdog_s=1.5)
    wait = _beating(wait, B, until=1.5, progress=0)
    assert not wait.done
    members = beat(wait.members, B, 1.6, 0)
    wait, commands = run(wait, [(1.6, Beats(members)), (1.6, Tick())])
    assert commands == [
        Lost([B], "worker b heartbeats but made no progress for 1.5 s in round 5 (watchdog)")
    ]


def test_two_hung_devices_are_named_together():
    wait = start(A, B, watchdog_s=1.0)
    members = beat(beat(wait.members, A, 1.0), B, 1.0)
    _, commands = run(wait, [(1.0, Beats(members)), (1.1, Tick())])
    assert commands == [
        Lost(
            [A, B],
            "workers ['a', 'b'] heartbeat but made no progress for 1 s in round 5 (watchdog)",
        )
    ]


def test_a_straggler_that_progresses_is_never_lost():
    wait = _beating(start(B, timeout_s=30.0, watchdog_s=1.5), B, until=20.0)
    assert not wait.done and wait.probes == {}
    wait, commands = apply(wait, Reply(B, done(B)), 20.1)
    assert commands == [Complete({B: done(B)})]


def test_a_device_waiting_on_a_peer_is_not_hung():
    wait = start(A, watchdog_s=1.0)
    t = 0.1
    while t < 5.0:
        members = on_heartbeat(wait.members, hb(A, 0, waiting=True), t)
        wait, commands = run(wait, [(t, Beats(members)), (t, Tick())])
        assert verdicts(commands) == []
        t += 0.1


def test_a_device_that_replied_is_not_hung():
    wait, _ = run(start(A, B, watchdog_s=1.0), [(0.1, Reply(A, done(A)))])
    members = beat(beat(wait.members, A, 1.5), B, 1.5, progress=1)
    wait, commands = run(wait, [(1.5, Beats(members)), (1.6, Tick())])
    assert commands == [] and not wait.done


def test_a_suspect_with_an_open_probe_is_not_judged_hung():
    # silence is the probe's to judge, not the watchdog's: one verdict per device
    wait = start(B, watchdog_s=1.0)
    wait, commands = run(wait, [(1.6, Tick())])
    assert [type(c) for c in commands] == [SendProbe]


# --- the overall timeout --------------------------------------------------------


def test_the_overall_timeout_fails_the_wait_naming_who_is_missing():
    wait = start(A, B, C, timeout_s=3.0)
    script: list[tuple[float, Event]] = [(0.5, Reply(B, done(B)))]
    for t in (1.0, 2.0, 3.0):
        members = beat(beat(beat(wait.members, A, t), B, t), C, t)
        script += [(t, Beats(members)), (t, Tick())]
    wait, commands = run(wait, script)
    assert verdicts(commands) == [] and not wait.done
    wait, commands = apply(wait, Tick(), 3.01)
    assert commands == [Fail("no RoundDone of round 5 from ['a', 'c'] within 3 s")]
