"""What the job core does after a loss: the recovery's steps, as pure functions.

A loss (a wait's `Lost` verdict) starts a recovery: read the capacities,
take the consistent cut (the newest version every stage holds on a survivor
or a backup node), re-plan (lightweight: move partition points; heavy: the
planner), then migrate layers peer to peer, or gather every layer in Redis
(heavy), or fall back to the Redis checkpoint; roll back, store the plan and
re-assign. `driver` calls in here and returns to training once every device
holds its new stage (`recovered`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from common.errors import ConfigError
from common.ids import DeviceId
from common.ledger import rollback_entry
from common.messages import CheckpointSaved, Collect
from common.plan import Plan, validate_async
from services.coordinator.core import Event as WaitEvent
from services.coordinator.core import Log, Signalled, signalled
from services.coordinator.job_state import (
    Append,
    Capacities,
    CheckpointFound,
    Command,
    Out,
    PlanAgain,
    PlanFailed,
    PlanReady,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    Recovery,
    RequestPlan,
    Run,
    Send,
    SetAssigned,
    StorePlan,
    begin_step,
    fail,
    known,
)
from services.coordinator.migration import collect_plan, cut_version, transfers
from services.coordinator.recovery import RecoveryImpossible, survivors_plan

__all__ = [
    "adapt",
    "alive",
    "kept",
    "lost",
    "membership_change",
    "plan_again",
    "plannable",
    "recovered",
    "recovery_input",
    "replanned",
    "resume",
]


def adapt(run: Run, plan: Plan, reason: str, now: float) -> Out:
    """Move the partition points to `plan` (measured speeds), at the committed round."""
    rec = replace(_change(run, "adapt", reason, now), speeds=run.speeds.ema)
    run = replace(run, phase="recovering", recovery=rec)
    moved, cmds = _planned(run, rec, plan, now)
    return moved, [Record("replanning", {"reason": reason}), *cmds]


def plan_again(
    run: Run,
    kind: Literal["adapt", "links"],
    reason: str,
    now: float,
    slowdowns: Mapping[DeviceId, float] | None = None,
) -> Out:
    """At a round boundary: ask the planner again, on the same devices as they measure now.

    `links`: communication is slower than planned, so the links are measured
    again. `adapt`: devices compute slower or faster than when the plan was made
    (`slowdowns`), so the planner may regroup them (moving partition points
    alone keeps groups a fresh plan would not make). The job waits as in a
    re-plan (phase "recovering"); the answer (PlanReady or PlanFailed) goes to
    `driver`, which moves with `replanned` or keeps the plan.
    """
    rec = _change(run, kind, reason, now)
    run = replace(run, phase="recovering", recovery=rec)
    return run, [
        Log("info", "planning again on measurements", {"kind": kind, "reason": reason}),
        PlanAgain(frozenset(run.plan.devices), run.plan, dict(slowdowns or {})),
    ]


def replanned(run: Run, plan: Plan, reason: str, now: float) -> Out:
    """Move to `plan`, made on what was measured, at the committed round."""
    rec = replace(known(run.recovery, "the measured re-plan"), reason=reason)
    moved, cmds = _planned(replace(run, recovery=rec), rec, plan, now)
    return moved, [Record("replanning", {"reason": reason}), *cmds]


def alive(run: Run, now: float) -> list[DeviceId]:
    """Devices heard from within the heartbeat deadline, as of the last heartbeats seen."""
    deadline = run.limits.heartbeat_deadline_s
    return sorted(d for d, m in run.members.items() if now - m.last_seen <= deadline)


def membership_change(run: Run, now: float) -> Out | None:
    """At a round boundary: drain the devices asked for, else take in those that joined.

    A joiner is a live worker outside the plan that holds no stage (state
    "idle": a new or restarted process, not one dropped while it hung), offered
    once (a drained device is never offered again); only a job that may change
    shape (`elastic`, planned by the planner) takes one in. None: nothing changes.
    """
    plan = run.plan
    leaving = tuple(sorted(d for d in run.drains if d in plan.devices))
    if leaving and len(leaving) < len(plan.devices):
        reason = "; ".join(f"drain of {d}: {run.drains[d]}" for d in leaving)
        rec = _change(run, "drain", reason, now, leaving=leaving)
        cmds: list[Command] = [Record("replanning", {"draining": list(leaving)})]
        run = replace(
            run,
            phase="recovering",
            recovery=rec,
            drains={},
            passed_over=run.passed_over | set(leaving),  # let go: not taken back in
        )
        return run, [*cmds, ReadCapacities()]
    if not (run.job.elastic and plannable(run)):
        return None
    joining = tuple(
        d
        for d in alive(run, now)
        if d not in plan.devices
        and d not in run.passed_over
        and run.members[d].info.state == "idle"
    )
    if not joining:
        return None
    rec = _change(run, "join", f"{', '.join(joining)} joined", now, joining=joining)
    run = replace(run, phase="recovering", recovery=rec, passed_over=run.passed_over | set(joining))
    return run, [
        Record("replanning", {"joining": list(joining)}),
        RequestPlan(frozenset({*plan.devices, *joining})),
    ]


def plannable(run: Run) -> bool:
    """Whether the planner may plan this job anew.

    It made the plan (not a hand-made one, however re-planned since) and the job
    names its global batch.
    """
    return bool(run.job.global_batch) and not run.plan.planner.startswith("manual")


def _change(
    run: Run,
    kind: Literal["join", "drain", "adapt", "links"],
    reason: str,
    now: float,
    joining: tuple[DeviceId, ...] = (),
    leaving: tuple[DeviceId, ...] = (),
) -> Recovery:
    """A re-plan at the committed round: every device holds it, nothing is replayed."""
    return Recovery(
        lost=(),
        reason=reason,
        failed_round=run.committed,
        started=now,
        from_peers=True,
        version=run.committed,
        from_replicas=True,
        kind=kind,
        joining=joining,
        leaving=leaving,
    )


def lost(run: Run, devices: Sequence[DeviceId], reason: str, now: float) -> Out:
    """Devices are gone: recover on the survivors, or fail if the job may not."""
    if run.job.recovery == "none" and devices:
        return fail(run, reason)
    prev = run.recovery
    lost = tuple(sorted({*devices, *(prev.lost if prev else ())}))
    why = reason if prev is None else f"{prev.reason}; {reason}"
    failed_round = run.step if prev is None else prev.failed_round
    rec = Recovery(
        lost=lost,
        reason=why,
        failed_round=failed_round,
        started=prev.started if prev else now,
        from_peers=prev is None and run.started,
    )  # a loss during a join or drain turns it into a recovery
    cmds: list[Command] = [
        Log("warning", "devices lost; recovering", {"lost": list(lost), "round": failed_round})
    ]
    # a loss before the job ran (its first assignment) is no lifecycle step of its own
    if run.started and (prev is None or prev.kind != "recovery"):
        cmds.append(
            Record("recovering", {"lost": list(lost), "round": failed_round, "reason": why})
        )
    if run.cancel is not None:
        return replace(run, phase="cancelled", outcome=run.cancel, wait=None), cmds
    # a device that comes back (restarted) may be taken in again; not one lost while it
    # still said "idle" to an Assign (it never took it): planned again, it would be lost again
    never = {
        d
        for d in devices
        if run.phase == "assign" and d in run.members and run.members[d].info.state == "idle"
    }
    passed_over = (run.passed_over - set(devices)) | never
    run = replace(run, phase="recovering", recovery=rec, wait=None, passed_over=passed_over)
    return run, [*cmds, ReadCapacities()]


def kept(run: Run, event: WaitEvent, now: float) -> Out:
    """A liveness signal between two steps (a re-plan under way): kept for the next step.

    So a device whose connection closes while the job re-plans is still a suspect
    when the next wait begins, not only once its heartbeats are overdue. Other
    events between steps change nothing.
    """
    if not isinstance(event, Signalled):
        return run, []
    among = frozenset(run.plan.devices)
    suspects, logs = signalled(
        run.suspects, run.members, event, among, run.epoch, run.limits.flap_grace_s, now
    )
    return replace(run, suspects=suspects), [*logs]


def recovery_input(
    run: Run, event: Capacities | PlanReady | PlanFailed | CheckpointFound, now: float
) -> Out:
    """The recovery after an answer to one of its commands (capacities, plan, checkpoint)."""
    rec = run.recovery
    if rec is None or run.phase != "recovering":
        return run, [Log("debug", "ignored a recovery input", {"type": type(event).__name__})]
    if isinstance(event, Capacities):
        return _weighed(run, rec, event, now)
    if isinstance(event, PlanFailed):
        return fail(run, f"{rec.reason}; cannot re-plan on {_survivors(run, rec)}: {event.error}")
    if isinstance(event, PlanReady):
        return _planned(run, rec, event.plan, now)
    if event.round is None:
        return fail(
            run,
            f"{rec.reason}; no replica or checkpoint of job {run.job.job_id} to resume "
            "the survivors from",
        )
    return resume(replace(run, recovery=replace(rec, version=event.round)), now)


def _survivors(run: Run, rec: Recovery) -> list[DeviceId]:
    return [d for d in run.plan.devices if d not in rec.lost]


def _weighed(run: Run, rec: Recovery, caps: Capacities, now: float) -> Out:
    """With the capacities known: the cut, then a lightweight plan or the planner."""
    gone = set(rec.lost)
    sizes = (
        None
        if caps.memory is None
        else tuple(caps.memory.layers.replica(i, i + 1) for i in range(run.layers))
    )
    if rec.kind == "recovery":
        usable = run.book.usable(run.committed) if run.book is not None else []
        version = cut_version(run.plan, gone, run.committed, usable) if rec.from_peers else None
        rec = replace(rec, version=version, from_replicas=version is not None)
    rec = replace(rec, sizes=sizes)
    run = replace(run, recovery=rec)
    if not gone and not rec.leaving:  # nobody lost: the plan stays (a resume falling back)
        return _planned(run, rec, run.plan, now)
    if rec.kind == "recovery" and run.job.recovery == "heavy":
        # the full planner, on every live device but the lost
        devices = frozenset(d for d in alive(run, now) if d not in gone)
        return run, [RequestPlan(devices)]
    if rec.kind == "drain" and plannable(run):
        # nothing is lost or urgent: the planner's plan for those who stay, layers moved peer
        # to peer (moving partition points alone keeps groups a fresh plan would not make)
        return run, [RequestPlan(frozenset(d for d in run.plan.devices if d not in rec.leaving))]
    leaving = gone | set(rec.leaving)  # a drained device holds its layers, and sends them
    try:
        plan = survivors_plan(run.plan, leaving, caps.costs, caps.speeds, caps.memory)
    except RecoveryImpossible as exc:
        return fail(run, f"{rec.reason}; cannot re-plan on {_survivors(run, rec)}: {exc}")
    return _planned(run, rec, plan, now)


def _planned(run: Run, rec: Recovery, plan: Plan, now: float) -> Out:
    """A plan for the survivors: gather (heavy), migrate (lightweight) or use the checkpoint."""
    try:
        plan.validate_for(run.layers)
        if run.job.mode == "async":
            validate_async(plan)
    except ConfigError as exc:
        return fail(run, f"{rec.reason}; cannot re-plan on {_survivors(run, rec)}: {exc}")
    gone = set(rec.lost)
    rec = replace(rec, plan=plan, planned_at=now)
    run = replace(run, recovery=rec)
    if rec.version is None:
        return run, [ReadCheckpoint()]
    usable = run.book.usable(run.committed) if run.book is not None else []
    sizes = list(rec.sizes) if rec.sizes is not None else None
    heavy = rec.kind == "recovery" and run.job.recovery == "heavy"
    try:
        if heavy:
            writes = collect_plan(run.plan, gone, rec.version, usable, sizes)
        else:
            moves = transfers(run.plan, plan, gone, rec.version, usable, sizes)
    except RecoveryImpossible as exc:
        return fail(run, f"{rec.reason}; cannot re-plan on {_survivors(run, rec)}: {exc}")
    if not heavy:
        return resume(replace(run, recovery=replace(rec, moves=moves)), now)
    # heavy: every layer of the cut to Redis first (the old plan's devices hold them)
    run = replace(run, phase="collect", recovery=replace(rec, moving_at=now))
    cmds: list[Command] = [
        Send(d, Collect(epoch=run.epoch, version=rec.version, layers=layers))
        for d, layers in writes.items()
    ]
    return begin_step(run, CheckpointSaved, rec.version, now, False, list(writes)), cmds


def resume(run: Run, now: float) -> Out:
    """Every stage resumes from version v on the new plan: roll back, store, re-assign."""
    rec = known(run.recovery, "the recovery")
    v, plan = known(rec.version, "the recovery's version"), known(rec.plan, "the new plan")
    rec = replace(rec, moving_at=rec.moving_at or now)
    rollback = rollback_entry(v, [str(d) for d in rec.lost])
    cmds: list[Command] = [
        *([Append("recording the rollback", "ledger", rollback)] if rec.kind == "recovery" else []),
        StorePlan(plan),
        SetAssigned(frozenset(plan.devices)),
        RaiseEpoch(),
    ]
    return replace(run, plan=plan, step=v, recovery=rec, phase="recovering", wait=None), cmds


def _moved(run: Run, rec: Recovery) -> dict[str, int]:
    """Layers (and bytes) the recovery moved between devices, or through Redis.

    Peer to peer, the transfers; through Redis (heavy, or from a checkpoint),
    every layer gathered once (heavy from the cut) and every device's whole stage loaded.
    """
    if rec.moves is not None:
        return {"moved_layers": rec.moves.moved, "moved_bytes": rec.moves.moved_bytes}
    size = list(rec.sizes) if rec.sizes is not None else [1] * run.layers
    gathered = rec.kind == "recovery" and run.job.recovery == "heavy" and rec.from_replicas
    loads = [(st.start, st.end) for st in run.plan.stages for _ in st.devices]
    return {
        "moved_layers": (run.layers if gathered else 0) + sum(hi - lo for lo, hi in loads),
        "moved_bytes": (sum(size) if gathered else 0) + sum(sum(size[lo:hi]) for lo, hi in loads),
    }


def recovered(run: Run, now: float) -> Out:
    """The new plan runs: record what the recovery did and cost."""
    rec = known(run.recovery, "the recovery")
    version = known(rec.version, "the recovery's version")
    replayed = run.committed - version
    record = {
        "kind": rec.kind,
        "lost": [str(d) for d in rec.lost],
        "joined": [str(d) for d in rec.joining],
        "left": [str(d) for d in rec.leaving],
        "reason": rec.reason,
        "failed_round": rec.failed_round,
        "from_round": version,
        "replayed": replayed,
        "source": "replicas" if rec.from_replicas else "checkpoint",
        **_moved(run, rec),
        "seconds": round(now - rec.started, 3),
        "replan_s": round(rec.planned_at - rec.started, 3),
        # gathering in Redis (heavy) and assigning: devices load or receive their layers
        "migrate_s": round(now - rec.moving_at, 3),
        "recovery": run.job.recovery,
        "stages": [
            [st.start, st.end, [str(a.device) for a in st.devices]] for st in run.plan.stages
        ],
    }
    summary = replace(
        run.summary.rolled_back(version),
        recoveries=(*run.summary.recoveries, record),
    )
    run = replace(run, recovery=None, summary=summary, replan_s=now - rec.started)
    event = "recovered" if rec.kind == "recovery" else "replanned"
    return run, [
        Append(f"recording the {rec.kind}", "events", {"event": event, **record}),
        Log("info", event, record),
    ]
