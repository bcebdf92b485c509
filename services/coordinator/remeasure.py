"""Whether a plan made on measured speeds or links is worth moving to, and how the job settles.

Pure, for the driver: after links were measured the watch cools down
(`link_drift.remeasured`), after speeds drifted today's speeds become the
baseline (`adapt.settled`), and the planner's plan is moved to only if the
round time it saves over the rounds left pays for the move.

An async job runs a pipeline of single-device stages only (`validate_async`):
a plan from the planner that groups devices or splits one is not moved to (the
job would fail on it); the running plan's partition points are moved by the
measured speeds instead (FTPipeHD's dynamic partition), when that pays.
"""

from __future__ import annotations

from dataclasses import replace

from common.errors import PlanError
from common.plan import Plan, validate_async
from services.coordinator import adapt, link_drift
from services.coordinator.core import Log
from services.coordinator.job_state import Append, Command, PlanFailed, PlanReady, Run, known

__all__ = ["judge"]


def judge(
    run: Run, answer: PlanReady | PlanFailed
) -> tuple[Run, list[Command], tuple[Plan, str] | None]:
    """Planned again on measurements: the plan to move to and why, if worth it, else None.

    Either way the job settles: after links were measured the watch cools down
    (`link_drift.remeasured`), after speeds drifted today's speeds become the
    baseline (`adapt.settled`), so devices or links that stay as they are never
    make the job plan over and over. Only a plan on the same devices is moved
    to: leaving a device out is a drain's business, and one the planner could
    not reach is a loss's. The commands record and log the outcome.
    """
    rec = known(run.recovery, "the measured re-plan")
    links = rec.kind == "links"
    fallback = None if links else _async_fallback(run, answer)
    if links:
        run = replace(run, watch=link_drift.remeasured())
    else:
        run = replace(run, speeds=adapt.settled(run.speeds))
    proposed = answer.plan if isinstance(answer, PlanReady) else None
    if proposed is not None and set(proposed.devices) != set(run.plan.devices):
        answer = PlanFailed(f"the plan on the measurements runs on {sorted(proposed.devices)}")
        proposed = None
    if proposed is not None and run.job.mode == "async":
        try:
            validate_async(proposed)
        except PlanError as exc:
            answer, proposed = PlanFailed(f"not a plan for mode async: {exc}"), None
    current_s = answer.current_s if isinstance(answer, PlanReady) else None
    proposed_s = proposed.predicted_round_s if proposed is not None else None
    remaining = run.total - run.committed
    worth = (
        proposed is not None
        and current_s is not None
        and proposed_s is not None
        and link_drift.replan_worth_it(current_s, proposed_s, remaining, run.replan_s)
    )
    record = {
        "event": "links_remeasured" if links else "speeds_replanned",
        "round": run.committed,
        "reason": rec.reason,
        "current_s": current_s,
        "proposed_s": proposed_s,
        "replanned": worth or fallback is not None,
        **({"error": answer.error} if isinstance(answer, PlanFailed) else {}),
        **({"moved_points": fallback[1]} if fallback is not None else {}),
    }
    cmds: list[Command] = [
        Append("recording the measured re-plan", "events", record),
        Log(
            "info" if proposed is not None else "warning",
            "links measured again" if links else "planned again on measured speeds",
            {k: v for k, v in record.items() if k != "event"},
        ),
    ]
    if worth and proposed is not None:
        on = "the measured links" if links else "the measured speeds"
        why = f"{rec.reason}; on {on} {current_s:.3f} s -> {proposed_s:.3f} s"
        return run, cmds, (proposed, why)
    return run, cmds, fallback if isinstance(answer, PlanFailed) else None


def _async_fallback(run: Run, answer: PlanReady | PlanFailed) -> tuple[Plan, str] | None:
    """An async job's partition points moved by the measured speeds, if the move pays.

    Only where the planner's plan cannot run async, or none came; judged on the
    speeds before they settle.
    """
    if run.job.mode != "async" or run.costs is None:
        return None
    if isinstance(answer, PlanReady) and set(answer.plan.devices) == set(run.plan.devices):
        try:
            validate_async(answer.plan)
            return None  # the planner's own plan is judged as for any job
        except PlanError:
            pass
    return adapt.proposal(
        run.speeds, run.plan, run.costs, run.total - run.committed, run.replan_s, run.memory
    )
