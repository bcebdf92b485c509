"""The dynamic partition of an async job: it stays a pipeline of single-device stages."""

from __future__ import annotations

from collections.abc import Sequence

from common.plan import validate_async
from services.coordinator.driver import Append, PlanAgain, PlanFailed, PlanReady, Record
from tests.coordinator.test_adapt import PLAN, throttled
from tests.coordinator.test_driver import plan_of


def _moved(cmds: Sequence[object]) -> bool:
    return any(isinstance(c, Record) and c.state == "replanning" for c in cmds)


def test_a_hand_made_async_plan_has_its_partition_points_moved() -> None:
    s, cmds = throttled(PLAN.model_copy(update={"planner": "manual"}), mode="async")
    assert _moved(cmds) and not [c for c in cmds if isinstance(c, PlanAgain)]
    assert [(st.start, st.end) for st in s.run.plan.stages] == [(0, 3), (3, 4)]
    validate_async(s.run.plan)


def test_a_grouped_plan_from_the_planner_is_not_moved_to_the_points_move_instead() -> None:
    s, cmds = throttled(PLAN, mode="async")
    assert [c for c in cmds if isinstance(c, PlanAgain)]
    grouped = plan_of((0, 4, [PLAN.devices[0], PLAN.devices[1]])).model_copy(
        update={"planner": "asteroid", "predicted_round_s": 1.0}
    )
    cmds = s.feed(PlanReady(grouped, current_s=3.0), at=s.now + 0.1)
    assert _moved(cmds)
    rec = s.run.recovery
    assert rec is not None and rec.kind == "adapt" and rec.plan is not None
    validate_async(rec.plan)  # what the job moves to can run async
    assert [(st.start, st.end) for st in rec.plan.stages] == [(0, 3), (3, 4)]
    (event,) = [c.entry for c in cmds if isinstance(c, Append) and c.stream == "events"]
    assert event["replanned"] and "mode async" in event["error"] and event["moved_points"]


def test_a_failed_plan_of_an_async_job_still_moves_its_points() -> None:
    s, _ = throttled(PLAN, mode="async")
    cmds = s.feed(PlanFailed("no planner answered"), at=s.now + 0.1)
    rec = s.run.recovery
    assert _moved(cmds) and rec is not None and rec.plan is not None
    assert [(st.start, st.end) for st in rec.plan.stages] == [(0, 3), (3, 4)]


def test_a_sync_job_keeps_its_plan_when_the_planner_fails() -> None:
    s, _ = throttled(PLAN)
    cmds = s.feed(PlanFailed("no planner answered"), at=s.now + 0.1)
    assert not _moved(cmds) and s.run.plan == PLAN and s.run.phase == "round"
