"""Signals in a running job's core on a fake clock, and the timeouts in force feeding it.

A closed connection mid-round ends in a recovery whose recorded reason names it;
one that arrives while the job re-plans is kept for the next step's wait; the
limits a job's waits take follow the derived timeouts (`in_force`), and so does
the neighbour timeout its Assigns carry.
"""

from __future__ import annotations

from dataclasses import replace

from common.messages import Heartbeat, RoundDone
from common.settings import CoordinatorSettings
from services.coordinator.core import Disconnected, PeerSilent, SendProbe, Tick
from services.coordinator.detection import COORDINATOR
from services.coordinator.driver import EpochRaised, Record
from services.coordinator.in_force import InForce
from services.coordinator.job_state import begin_step
from services.coordinator.membership import Members, on_heartbeat
from tests.coordinator.test_driver import LIMITS, A, B, C, D, Script, addr, assigns, job_of, running

GRACE_S = LIMITS.flap_grace_s


def test_a_closed_connection_mid_round_recovers_naming_it() -> None:
    s = running(job_of())  # round 0 under way; every device heard from at t=1
    s.feed(Disconnected(B, COORDINATOR, 1.2), at=1.2)
    s.feed(PeerSilent(B, C, 0.8, s.epoch), at=1.3)  # its neighbour waits for its data
    probes = [c for c in s.feed(Tick(), at=1.31) if isinstance(c, SendProbe)]
    assert [p.device for p in probes] == [B]  # the silent report: probed at once
    assert not [c for c in s.feed(Tick(), at=1.19 + GRACE_S) if isinstance(c, Record)]
    out = s.feed(Tick(), at=1.21 + GRACE_S)  # the connection is not back: lost at once
    (record,) = [c for c in out if isinstance(c, Record)]
    assert record.state == "recovering" and record.fields["lost"] == [B]
    assert str(record.fields["reason"]) == (
        "workers ['b'] lost while the coordinator waited for RoundDone of round 0: "
        "b: control connection closed 1.01 s ago; c waited 0.80 s for its data; "
        "not back within the 1.00 s grace"
    )


def test_a_signal_between_steps_is_kept_for_the_next_wait() -> None:
    s = running(job_of())  # every device heard from at t=1
    s.run = replace(s.run, wait=None)  # between two steps (a re-plan under way)
    s.feed(Disconnected(B, COORDINATOR, 1.1), at=1.1)
    assert B in s.run.suspects
    s.run = begin_step(s.run, RoundDone, 0, 1.2)  # the next step's wait takes it over
    s.beat([A, C, D], at=2.0)
    out = s.feed(Tick(), at=1.1 + GRACE_S + 0.01)  # before b's heartbeats are overdue
    (record,) = [c for c in out if isinstance(c, Record)]
    assert record.fields["lost"] == [B] and "control connection closed" in record.fields["reason"]


def test_the_limits_and_the_assigns_follow_the_timeouts_in_force() -> None:
    settings = CoordinatorSettings(heartbeat_s=0.5, heartbeat_misses=6, flap_grace_s=1.0)
    written: list[str] = []
    force = InForce(settings, None, lambda what, op: written.append(what))  # type: ignore[arg-type]
    members: Members = {}
    for i in range(12):  # beats every 0.5 s: the deadline comes down from the bound's 3 s
        members = on_heartbeat(members, Heartbeat(device=B, data_addr=addr(B)), 0.5 * i)
        force.beats(members, {B})
    eff = force.refresh(None, 6.0)
    assert eff.heartbeat_deadline_s < 3.0 and eff.flap_grace_s < 1.0
    assert written == []  # no job running: nothing recorded
    s = running(job_of())
    run = force.follow(s.run, s.run)
    assert run.limits.heartbeat_deadline_s == eff.heartbeat_deadline_s
    assert run.limits.probe_timeout_s == eff.probe_timeout_s
    assert run.limits.flap_grace_s == eff.flap_grace_s
    force.refresh("j1", 6.0)
    force.refresh("j1", 6.5)  # unchanged and within a second: written once
    assert written == ["job j1's timeouts"]
    fresh = Script(job_of())
    fresh.beat(fresh.run.plan.devices, at=0.0)
    (assign, *_) = assigns(fresh.feed(EpochRaised(1), at=0.0)).values()
    assert assign.peer_timeout_s is None  # the core leaves it to the shell
    assert force.stamped(assign).peer_timeout_s == eff.peer_timeout_s
