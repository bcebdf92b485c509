"""Re-partitioning from measured speeds: when it happens, what it proposes, and when not."""

from __future__ import annotations

from typing import Any

import pytest

from common.ids import DeviceId
from common.messages import RoundDone, StageTimings
from common.plan import Plan
from services.coordinator.adapt import ADAPT_AFTER, ALPHA, Speeds, measure, proposal, slowdowns
from services.coordinator.core import Reply
from services.coordinator.driver import (
    Command,
    EpochRaised,
    PlanAgain,
    PlanReady,
    Record,
    RequestPlan,
    Send,
    start,
)
from tests.coordinator.test_driver import LIMITS, Script, job_of, plan_of

A, B = DeviceId("a"), DeviceId("b")
PLAN = plan_of((0, 2, [A]), (2, 4, [B])).model_copy(update={"planner": "asteroid"})
COSTS = (1.0, 1.0, 1.0, 1.0)


def done(device: DeviceId, compute_s: float, stage: int) -> RoundDone:
    half = compute_s / 2
    return RoundDone(
        device=device,
        epoch=1,
        round=0,
        stage=stage,
        samples=8,
        timings=StageTimings(forward_s=half, backward_s=half, wait_s=5.0),
    )


def rounds(speeds: Speeds, times: tuple[float, float], n: int) -> Speeds:
    for _ in range(n):
        speeds = measure(speeds, PLAN, COSTS, {A: done(A, times[0], 0), B: done(B, times[1], 1)})
    return speeds


def test_a_stages_speed_is_its_layers_cost_over_its_compute_time_smoothed() -> None:
    s = rounds(Speeds(), (9.0, 9.0), 1)
    assert s.ema == () and s.rounds == 1  # the warm-up round is counted, not measured
    s = rounds(s, (1.0, 2.0), 1)
    assert s.ema == (2.0, 1.0) and s.rounds == 2 and s.base is None  # waits do not count
    s = rounds(s, (0.5, 2.0), 1)
    assert s.ema == pytest.approx((ALPHA * 4.0 + (1 - ALPHA) * 2.0, 1.0))


def test_a_drift_must_last_before_it_counts() -> None:
    s = rounds(Speeds(), (1.0, 1.0), ADAPT_AFTER + 3)
    s = rounds(s, (1.0, 3.0), 2)  # b at a third: its smoothed speed 2.0 -> 1.6 -> 1.32
    assert s.drifting == 1 and proposal(s, PLAN, COSTS, remaining=100) is None
    s = rounds(s, (1.0, 3.0), 1)  # -> 1.124: a second round past the drift
    assert s.drifting == 2 and proposal(s, PLAN, COSTS, remaining=100) is not None
    s = rounds(rounds(Speeds(), (1.0, 1.0), ADAPT_AFTER + 3), (1.0, 3.0), 2)
    assert rounds(s, (1.0, 1.0), 1).drifting == 0  # back to normal: the count starts over


def test_a_re_partition_is_judged_against_the_speeds_it_assumed() -> None:
    assumed = Speeds.assumed((2.0, 0.9))
    assert (assumed.base, assumed.rounds, assumed.drifting) == ((2.0, 0.9), ADAPT_AFTER, 0)
    # b settles at 2/3 of what the move assumed: a second move follows
    s = rounds(assumed, (1.5, 3.0), 12)
    assert s.drifting >= 2 and proposal(s, PLAN, COSTS, remaining=100) is not None


def test_the_baseline_is_taken_after_the_first_rounds() -> None:
    s = rounds(Speeds(), (1.0, 1.0), ADAPT_AFTER)
    assert s.base == (2.0, 2.0)


def test_an_undisturbed_plan_is_left_alone_even_if_it_is_unbalanced() -> None:
    # b is slower than the plan assumed from the start: that is the baseline, not a drift
    s = rounds(Speeds(), (1.0, 3.0), ADAPT_AFTER + 20)
    assert proposal(s, PLAN, COSTS, remaining=100) is None


def test_a_device_that_slows_to_a_third_gets_fewer_layers() -> None:
    s = rounds(Speeds(), (1.0, 1.0), ADAPT_AFTER)
    s = rounds(s, (1.0, 3.0), 15)  # b throttled: its speed falls to a third
    moved = proposal(s, PLAN, COSTS, remaining=100)
    assert moved is not None
    plan, why = moved
    assert [(st.start, st.end) for st in plan.stages] == [(0, 3), (3, 4)]
    assert plan.planner == "asteroid+measured"
    assert why.startswith("measured speeds moved 6") and "-> " in why


def test_a_move_that_cannot_pay_for_itself_is_not_made() -> None:
    s = rounds(Speeds(), (1.0, 1.0), ADAPT_AFTER)
    s = rounds(s, (1.0, 3.0), 15)
    # each round would save 1 s of the slowest stage; 2 rounds left cannot pay 5 s
    assert proposal(s, PLAN, COSTS, remaining=2, migration_s=5.0) is None
    assert proposal(s, PLAN, COSTS, remaining=10, migration_s=5.0) is not None


def test_slowdowns_are_each_devices_own_against_the_baseline() -> None:
    speeds = Speeds()
    assert slowdowns(speeds) == {}  # no baseline yet
    for r in range(ADAPT_AFTER + 30):
        b_s = 2.0 if r >= ADAPT_AFTER else 1.0
        speeds = measure(speeds, PLAN, COSTS, {A: done(A, 1.0, 0), B: done(B, b_s, 1)})
    assert slowdowns(speeds) == {A: pytest.approx(1.0), B: pytest.approx(2.0, rel=1e-3)}


def throttled(plan: Plan, **fields: Any) -> tuple[Script, list[Command]]:
    """A job on `plan` whose device b computes three times slower once the baseline is taken.

    `fields` go to the job. Returns the script and the commands of the round
    boundary where the core acted.
    """
    job = job_of(total=40, checkpoint_every=0, replicate_every=0, **fields)
    s = Script(job, plan)
    s.run, _ = start(job, 40, 4, None, LIMITS, plan, 0, costs=COSTS)
    s.beat(plan.devices, at=0.0)
    s.feed(EpochRaised(1))
    s.assigned(at=0.5)
    for r in range(30):
        slow = 3.0 if r >= ADAPT_AFTER else 1.0
        s.beat(plan.devices, at=s.now + 1.0)
        cmds = [
            *s.feed(_reply(A, done(A, 1.0, 0), s.run.epoch, r), at=s.now),
            *s.feed(_reply(B, done(B, slow, 1), s.run.epoch, r), at=s.now + 0.5),
        ]
        if [c for c in cmds if isinstance(c, PlanAgain) or getattr(c, "state", "") == "replanning"]:
            return s, cmds
    raise AssertionError("the core never acted after b slowed to a third")


def test_a_hand_made_plan_has_its_partition_points_moved_at_a_round_boundary() -> None:
    s, cmds = throttled(PLAN.model_copy(update={"planner": "manual"}))
    assert [c for c in cmds if isinstance(c, Record) and c.state == "replanning"]
    assert not [c for c in cmds if isinstance(c, RequestPlan | PlanAgain)]  # points moved
    assert [(st.start, st.end) for st in s.run.plan.stages] == [(0, 3), (3, 4)]
    assert any(isinstance(c, Send) for c in cmds)  # the new assignment went out


def test_a_planned_job_asks_the_planner_again_with_each_devices_measured_slowdown() -> None:
    s, cmds = throttled(PLAN)
    (asked,) = [c for c in cmds if isinstance(c, PlanAgain)]
    assert asked.current == PLAN and asked.devices == frozenset({A, B})
    assert asked.slowdowns[A] == pytest.approx(1.0) and asked.slowdowns[B] > 2.0  # b only
    # the planner's plan for the measured speeds is worth moving to: the job moves
    better = plan_of((0, 3, [A]), (3, 4, [B])).model_copy(
        update={"planner": "asteroid", "predicted_round_s": 1.5}
    )
    cmds = s.feed(PlanReady(better, current_s=3.0), at=s.now + 0.1)
    assert [c for c in cmds if isinstance(c, Record) and c.state == "replanning"]
    assert s.run.recovery is not None and s.run.recovery.kind == "adapt"
    assert s.run.recovery.plan == better


def test_a_measured_plan_not_worth_its_migration_is_not_moved_to_nor_asked_for_again() -> None:
    s, _ = throttled(PLAN)
    same = PLAN.model_copy(update={"predicted_round_s": 2.9})
    cmds = s.feed(PlanReady(same, current_s=3.0), at=s.now + 0.1)
    assert not [c for c in cmds if isinstance(c, Record) and c.state == "replanning"]
    assert s.run.phase == "round" and s.run.speeds.drifting == 0  # today's speeds: the baseline
    for r in range(s.run.committed, s.run.committed + 5):  # b stays slow: nothing more to do
        s.beat(PLAN.devices, at=s.now + 1.0)
        cmds = [
            *s.feed(_reply(A, done(A, 1.0, 0), s.run.epoch, r), at=s.now),
            *s.feed(_reply(B, done(B, 3.0, 1), s.run.epoch, r), at=s.now + 0.5),
        ]
        assert not [c for c in cmds if isinstance(c, PlanAgain)] and s.run.phase == "round"


def _reply(device: DeviceId, msg: RoundDone, epoch: int, r: int) -> Reply:
    return Reply(device, msg.model_copy(update={"epoch": epoch, "round": r}))
