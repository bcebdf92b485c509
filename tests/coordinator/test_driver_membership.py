"""The job core takes in devices that join and lets drained ones go, at a round boundary.

Scripted events on a fake clock, as in `test_driver`: a drain or a join re-plans
at the committed round (every device holds it), moves only the layers that
change hands, replays nothing and records a `replanned` event.
"""

from __future__ import annotations

from common.ids import DeviceId
from common.messages import Handover, Heartbeat
from services.coordinator.driver import (
    Append,
    Drain,
    PlanReady,
    ReadCapacities,
    Record,
    RequestPlan,
    Send,
)
from services.coordinator.membership import on_heartbeat
from services.coordinator.migration import transfers
from services.coordinator.recovery import survivors_plan
from tests.coordinator.test_driver import (
    NO_CAPACITIES,
    PLAN,
    A,
    B,
    C,
    D,
    Script,
    addr,
    assigns,
    job_of,
    plan_of,
    running,
)

E = DeviceId("e")
PLANNED = PLAN.model_copy(update={"planner": "asteroid"})
"""The same plan as made by the planner: a job on it may take in a device that joins."""


def appended(commands: list, stream: str) -> list[dict]:
    return [dict(c.entry) for c in commands if isinstance(c, Append) and c.stream == stream]


def joins(s: Script, device: DeviceId, state: str = "idle") -> None:
    """`device` heartbeats now, holding no stage (`idle`) unless told otherwise."""
    hb = Heartbeat(device=device, data_addr=addr(device), state=state)
    s.members = on_heartbeat(s.members, hb, s.now)


def test_a_drained_device_leaves_at_the_round_boundary_with_nothing_replayed() -> None:
    s = running(job_of(total=6))
    s.feed(Drain(C, "unplugging"))
    s.beat(PLAN.devices, at=2.0)
    commands = s.round_done(at=2.5)
    assert commands[-2:] == [Record("replanning", {"draining": ["c"]}), ReadCapacities()]
    assert s.run.phase == "recovering" and s.run.drains == {}
    commands = s.feed(NO_CAPACITIES)
    new = survivors_plan(PLAN, {C})
    assert C not in new.devices
    # no rollback: every device holds round 1, which the new plan starts from
    assert appended(commands, "ledger") == []
    sent = assigns(commands)
    assert sorted(sent) == sorted(new.devices)
    moves = transfers(PLAN, new, set(), 1, [])
    for d, msg in sent.items():
        assert msg.from_round == 1 and msg.sources == moves.received_by(d)
        assert msg.sends == moves.sent_by(d)
    commands = s.assigned(at=3.0)
    (event,) = appended(commands, "events")
    assert (event["event"], event["kind"], event["left"], event["replayed"]) == (
        "replanned",
        "drain",
        ["c"],
        0,
    )
    assert s.run.committed == 1
    assert [c.device for c in commands if isinstance(c, Send)] == new.devices  # round 1


def test_a_drain_asks_the_planner_and_the_leaving_device_hands_over_what_only_it_held() -> None:
    s = running(job_of(total=6), PLANNED)
    s.feed(Drain(B, "unplugging"))
    s.beat(PLAN.devices, at=2.0)
    s.round_done(at=2.5)
    commands = s.feed(NO_CAPACITIES)
    assert commands == [RequestPlan(frozenset({A, C, D}))]  # the planner, without b
    fewer = plan_of((0, 2, [A]), (2, 4, [C, D]))
    commands = s.feed(PlanReady(fewer), at=3.0)
    sent = assigns(commands)
    assert sorted(sent) == [A, C, D] and sent[A].sources == {1: B}
    handed = [c for c in commands if isinstance(c, Send) and isinstance(c.msg, Handover)]
    assert [(c.device, c.msg.version, c.msg.sends) for c in handed] == [(B, 1, {A: [1]})]
    assert handed[0].msg.peers == sent[A].peers  # b reaches its receivers as they reach others
    s.beat(fewer.devices, at=3.5)
    commands = s.assigned(at=4.0)
    (event,) = appended(commands, "events")
    assert (event["kind"], event["left"], event["replayed"], event["moved_layers"]) == (
        "drain",
        ["b"],
        0,
        1,
    )


def test_a_device_that_joins_is_taken_in_by_the_planner_and_gets_its_layers_from_peers() -> None:
    s = running(job_of(total=6), PLANNED)
    joins(s, E)
    s.beat(PLAN.devices, at=2.0)
    commands = s.round_done(at=2.5)
    assert commands[-2:] == [
        Record("replanning", {"joining": ["e"]}),
        RequestPlan(frozenset({A, B, C, D, E})),
    ]
    bigger = plan_of((0, 1, [A]), (1, 2, [B, E]), (2, 4, [C, D]))
    commands = s.feed(PlanReady(bigger), at=3.0)
    sent = assigns(commands)
    assert sent[E].sources == {1: B}  # e runs layer 1 beside b, which sends it
    assert sent[B].sends == {E: [1]}
    assert all(not sent[d].sources for d in (A, B, C, D))
    s.beat([*PLAN.devices, E], at=3.5)
    commands = s.assigned(at=4.0)
    (event,) = appended(commands, "events")
    assert (event["kind"], event["joined"], event["replayed"], event["moved_layers"]) == (
        "join",
        ["e"],
        0,
        1,
    )
    assert sorted(c.device for c in commands if isinstance(c, Send)) == [A, B, C, D, E]


def test_a_device_the_planner_leaves_out_is_not_offered_again() -> None:
    s = running(job_of(total=6, checkpoint_every=0), PLANNED)
    joins(s, E)
    s.beat(PLAN.devices, at=2.0)
    s.round_done(at=2.5)
    s.feed(PlanReady(PLANNED), at=3.0)
    s.assigned(at=3.5)
    joins(s, E)
    s.beat(PLAN.devices, at=4.0)
    commands = s.round_done(at=4.5)
    assert not [c for c in commands if isinstance(c, RequestPlan)]
    assert s.run.phase == "round"


def test_no_device_joins_a_plan_given_by_hand_or_while_it_holds_a_stage() -> None:
    by_hand = running(job_of(total=6))
    joins(by_hand, E)
    by_hand.beat(PLAN.devices, at=2.0)
    assert not [c for c in by_hand.round_done(at=2.5) if isinstance(c, RequestPlan)]
    busy = running(job_of(total=6), PLANNED)
    joins(busy, E, state="training")  # dropped from an earlier plan while it hung
    busy.beat(PLAN.devices, at=2.0)
    assert not [c for c in busy.round_done(at=2.5) if isinstance(c, RequestPlan)]


def test_a_job_that_is_not_elastic_takes_nobody_in() -> None:
    s = running(job_of(total=6, elastic=False), PLANNED)
    joins(s, E)
    s.beat(PLAN.devices, at=2.0)
    assert not [c for c in s.round_done(at=2.5) if isinstance(c, RequestPlan)]
