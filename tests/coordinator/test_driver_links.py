"""The job core measures the links again when communication stays slower than planned.

Scripted events on `driver.apply` (the `Script` of test_driver): the plan
predicts how long a round communicates; devices report their waits. Slow
communication with steady compute for `PERSIST` rounds makes the core ask,
at the next round boundary, for the links to be measured again and a plan on
them (PlanAgain); the answer moves the job (a "replanned" event of kind
"links", nothing replayed) or keeps its plan and cools the watch down.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from common.messages import RunRound, StageTimings
from common.plan import Plan
from services.coordinator.adapt import ADAPT_AFTER, PERSIST
from services.coordinator.core import Log
from services.coordinator.driver import (
    Append,
    Command,
    PlanAgain,
    PlanFailed,
    PlanReady,
    Record,
    Send,
    StorePlan,
)
from services.coordinator.link_drift import COOLDOWN
from services.coordinator.migration import transfers
from tests.coordinator.test_driver import (
    PLAN,
    A,
    B,
    C,
    D,
    Script,
    assigns,
    job_of,
    plan_of,
    running,
)

PLANNED = PLAN.model_copy(
    update={"planner": "asteroid", "predicted_round_s": 2.1, "predicted_comm_s": 0.1}
)
"""The planner's plan: 2 s of compute on its least busy device, 0.1 s communicating."""
COSTS = (1.0, 1.0, 1.0, 1.0)
FAST = 0.1
"""Seconds a device waits in a round on the links the plan was made for."""
SLOW = 1.0
"""Seconds a device waits once a link got slower."""
TOTAL = 60


def remeasures(commands: list[Command]) -> list[PlanAgain]:
    return [c for c in commands if isinstance(c, PlanAgain)]


def events(commands: list[Command]) -> list[dict[str, Any]]:
    return [dict(c.entry) for c in commands if isinstance(c, Append) and c.stream == "events"]


def rounds_sent(commands: list[Command]) -> list[int]:
    return sorted(
        {c.msg.round for c in commands if isinstance(c, Send) and isinstance(c.msg, RunRound)}
    )


def watched(adapt: bool = True, plan: Plan = PLANNED) -> Script:
    """A running job with profiled costs, so its compute speeds are measured."""
    s = running(job_of(total=TOTAL, checkpoint_every=0, adapt=adapt), plan)
    s.run = replace(s.run, costs=COSTS)
    return s


def commit(s: Script, wait_s: float, compute_s: float = 2.0) -> list[Command]:
    """Every device heartbeats, then reports the round: `compute_s` computing, `wait_s` waiting."""
    s.beat(s.run.plan.devices, at=s.now + 1.0)
    timings = StageTimings(forward_s=compute_s / 2, backward_s=compute_s / 2, wait_s=wait_s)
    return s.replies(lambda d: s.done(d).model_copy(update={"timings": timings}), at=s.now + 1.0)


def commits(s: Script, n: int, wait_s: float, compute_s: float = 2.0) -> list[Command]:
    out: list[Command] = []
    for _ in range(n):
        out += commit(s, wait_s, compute_s)
    return out


def slowed(s: Script) -> list[Command]:
    """The plan's warm-up rounds on its links, then slow rounds until the core re-measures."""
    commits(s, ADAPT_AFTER, FAST)
    before = commits(s, PERSIST - 1, SLOW)
    assert remeasures(before) == [] and s.run.phase == "round"
    return commit(s, SLOW)


def test_slow_communication_for_persist_rounds_re_measures_once_at_the_round_boundary() -> None:
    s = watched()
    commands = slowed(s)
    assert remeasures(commands) == [PlanAgain(frozenset(PLANNED.devices), PLANNED)]
    assert commands[-1] == remeasures(commands)[0]  # answered: the last command
    committed = ADAPT_AFTER + PERSIST
    assert s.run.committed == committed and s.run.phase == "recovering"
    assert rounds_sent(commands) == []  # the next round waits for the answer
    assert not [c for c in commands if isinstance(c, Record)]  # still "running" meanwhile


def test_a_plan_worth_moving_to_is_migrated_to_with_nothing_replayed() -> None:
    s = watched()
    slowed(s)
    committed = s.run.committed
    better = plan_of((0, 2, [A]), (2, 3, [B]), (3, 4, [C, D])).model_copy(
        update={"planner": "asteroid", "predicted_round_s": 2.5, "predicted_comm_s": 0.3}
    )
    commands = s.feed(PlanReady(better, current_s=4.0), at=s.now + 1.0)
    (measured,) = events(commands)
    assert (measured["event"], measured["replanned"]) == ("links_remeasured", True)
    assert (measured["current_s"], measured["proposed_s"]) == (4.0, 2.5)
    assert Record("replanning", {"reason": s.run.recovery.reason}) in commands
    assert StorePlan(better) in commands
    sent = assigns(commands)
    moves = transfers(PLANNED, better, set(), committed, [])
    for d, msg in sent.items():
        assert msg.from_round == committed and msg.sources == moves.received_by(d)
    commands = s.assigned(at=s.now + 1.0)
    (event,) = events(commands)
    assert (event["event"], event["kind"], event["replayed"], event["from_round"]) == (
        "replanned",
        "links",
        0,
        committed,
    )
    assert s.run.plan == better and rounds_sent(commands) == [committed]
    assert s.run.watch.cooldown == COOLDOWN


def test_a_plan_not_worth_it_is_kept_and_the_watch_cools_down() -> None:
    s = watched()
    slowed(s)
    committed, epoch = s.run.committed, s.run.epoch
    same = PLANNED.model_copy(update={"predicted_round_s": 3.9})
    commands = s.feed(PlanReady(same, current_s=4.0), at=s.now + 1.0)
    (measured,) = events(commands)
    assert (measured["event"], measured["replanned"]) == ("links_remeasured", False)
    assert StorePlan(PLANNED) in commands  # the running plan is the job's plan again
    assert all("event" not in c.fields for c in commands if isinstance(c, Log))  # a log's own
    assert not [c for c in commands if isinstance(c, Record)] and assigns(commands) == {}
    assert rounds_sent(commands) == [committed]  # the same boundary: nothing replayed
    assert (s.run.plan, s.run.epoch, s.run.recovery) == (PLANNED, epoch, None)
    assert s.run.watch.cooldown == COOLDOWN
    # the links stay slow: no measuring again during the cool-down
    assert remeasures(commits(s, COOLDOWN, SLOW)) == []
    assert remeasures(commits(s, PERSIST, SLOW)) != []  # after it, slow rounds count again


def test_a_failed_re_plan_keeps_the_job_running_on_its_plan() -> None:
    s = watched()
    slowed(s)
    committed = s.run.committed
    commands = s.feed(PlanFailed("planner timed out"), at=s.now + 1.0)
    (measured,) = events(commands)
    assert (measured["replanned"], measured["error"]) == (False, "planner timed out")
    assert rounds_sent(commands) == [committed] and s.run.phase == "round"
    assert s.run.watch.cooldown == COOLDOWN


def test_an_undisturbed_run_never_re_measures() -> None:
    s = watched()
    commands = commits(s, TOTAL, FAST)
    assert remeasures(commands) == [] and s.run.committed == TOTAL


def test_compute_that_slows_down_does_not_re_measure() -> None:
    """Every device computes slower at once: waits grow with it, the links are not to blame."""
    s = watched()
    commands = commits(s, ADAPT_AFTER, FAST)
    commands += commits(s, 2 * PERSIST + 3, SLOW, compute_s=3.2)  # the smoothing lags
    assert remeasures(commands) == []


def test_only_a_job_that_may_adapt_re_measures() -> None:
    s = watched(adapt=False)
    commands = commits(s, ADAPT_AFTER + 2 * PERSIST, SLOW)
    assert remeasures(commands) == [] and s.run.watch.slow == 0


def test_a_plan_that_predicts_no_communication_is_never_judged() -> None:
    s = watched(plan=PLANNED.model_copy(update={"predicted_comm_s": 0.0}))
    assert remeasures(commits(s, ADAPT_AFTER + 2 * PERSIST, SLOW)) == []


def test_a_plan_that_leaves_a_device_out_is_not_moved_to() -> None:
    s = watched()
    slowed(s)
    smaller = plan_of((0, 2, [A]), (2, 4, [C, D])).model_copy(
        update={"planner": "asteroid", "predicted_round_s": 1.0}
    )
    commands = s.feed(PlanReady(smaller, current_s=4.0), at=s.now + 1.0)
    (measured,) = events(commands)
    assert measured["replanned"] is False and "['a', 'c', 'd']" in measured["error"]
    assert s.run.plan == PLANNED and rounds_sent(commands) == [s.run.committed]
