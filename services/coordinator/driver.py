"""A running job's decisions as one pure function: `apply(run, event, now) -> (run, commands)`.

From its assignment to its end a job is a sequence of steps: assign every
device its stage, run a round, evaluate, checkpoint, and after a loss recover
(re-plan, gather or migrate, re-assign). Every decision about them — what to
send, what to record, when a round counts as committed, what a loss means,
which version every stage resumes from and who sends which layer — is taken
here, from the job's state and one event at a time, and returned as commands.
The shell (`jobs.JobRun`) owns the ROUTER, Redis and the clock: it carries the
commands out, feeds back their results (a raised plan epoch, the recovery
inputs it read, the planner's plan) and what the network brings (replies,
heartbeats, probe answers, replica reports, a cancel, time passing, Redis
going away and coming back). So every rule is tested with scripted events on
a fake clock, without sockets or Redis.

Waiting for one step's replies is the inner core `core.apply`; a wait's
verdict (complete, a worker's error, devices lost) moves the job on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from common.errors import CheckpointError
from common.ids import DeviceId
from common.job import JobSpec
from common.job_data import eval_size
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    EvalDone,
    Handover,
    Message,
    ReplicaSaved,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
)
from common.plan import Plan
from common.replica_digests import check_replicas
from services.coordinator import adapt, commits, core, link_drift, outages, recovering, remeasure
from services.coordinator.adapt import Speeds
from services.coordinator.core import Beats, Heard, Log, ProbeAnswer, Reply, SendProbe, Tick
from services.coordinator.job_state import (
    Append,
    Cancelled,
    Capacities,
    CheckpointFound,
    CheckStore,
    Command,
    CommitCheckpoint,
    Drain,
    EpochRaised,
    Event,
    Limits,
    Out,
    PlanAgain,
    PlanFailed,
    PlanReady,
    Publish,
    RaiseEpoch,
    ReadCapacities,
    ReadCheckpoint,
    Record,
    RequestPlan,
    Run,
    Send,
    SetAssigned,
    StorePlan,
    Summary,
    begin_step,
    fail,
    known,
)
from services.coordinator.membership import on_probe_reply
from services.coordinator.recovery import MemoryInputs
from services.coordinator.replicas import ReplicaBook
from services.coordinator.store_outage import StoreBack, StoreDown

__all__ = [
    "Append",
    "Cancelled",
    "Capacities",
    "CheckStore",
    "CheckpointFound",
    "Command",
    "CommitCheckpoint",
    "Drain",
    "EpochRaised",
    "Event",
    "Limits",
    "PlanAgain",
    "PlanFailed",
    "PlanReady",
    "Publish",
    "RaiseEpoch",
    "ReadCapacities",
    "ReadCheckpoint",
    "Record",
    "RequestPlan",
    "Run",
    "Send",
    "SetAssigned",
    "StorePlan",
    "Summary",
    "apply",
    "start",
]


# --- the core -----------------------------------------------------------------


def start(
    job: JobSpec,
    total: int,
    layers: int,
    train_size: int | None,
    limits: Limits,
    plan: Plan,
    from_round: int,
    from_peers: bool = False,
    costs: Sequence[float] | None = None,
    memory: MemoryInputs | None = None,
    eval_samples: int = 0,
) -> Out:
    """A job about to be assigned `plan`, resuming from the weights of `from_round`.

    With `from_peers`, every device is asked to keep its own stage's state of
    `from_round` (a restarted coordinator's workers hold it), not to load it from
    Redis; if one cannot, the job goes back to the newest checkpoint instead.
    With per-layer `costs` (profiled), measured speeds may move the partition
    points (`adapt`), within `memory`. `eval_samples`: held-out samples an
    evaluation covers, sized by the shell (a ``custom`` dataset's factory is
    allow-listed by the service's settings, which this core does not see).
    """
    run = Run(
        job=job,
        total=total,
        layers=layers,
        train_size=train_size,
        eval_samples=eval_samples,
        limits=limits,
        plan=plan,
        summary=Summary(start=from_round),
        committed=from_round,
        step=from_round,
        from_peers=from_peers,
        costs=None if costs is None else tuple(costs),
        memory=memory,
    )
    return run, [SetAssigned(frozenset(plan.devices)), RaiseEpoch()]


def apply(run: Run, event: Event, now: float) -> Out:
    """The job after `event` at time `now`, and what the shell must do about it."""
    if isinstance(event, StoreDown | StoreBack):
        return outages.noted(run, event, now)
    if isinstance(event, Tick):  # during a Redis outage the step stands still, for so long
        run = outages.waited(run, now)
    if run.ended:
        return run, []
    if isinstance(event, Beats):
        run = replace(run, members=dict(event.members))
        return _waited(run, event, now)
    if isinstance(event, Reply):
        return _on_reply(run, event, now)
    if isinstance(event, ProbeAnswer):
        return _on_probe_answer(run, event, now)
    if isinstance(event, Tick | core.Signalled):
        return _waited(run, event, now)
    if isinstance(event, Cancelled):
        return replace(run, cancel=event.reason), [
            Log("info", "job cancel noted", {"reason": event.reason})
        ]
    if isinstance(event, Drain):
        drains = {**run.drains, event.device: event.reason}
        return replace(run, drains=drains), [
            Log("info", "drain noted", {"device": event.device, "reason": event.reason})
        ]
    if isinstance(event, EpochRaised):
        return _assign(replace(run, epoch=event.epoch), now)
    if isinstance(event, PlanFailed) and run.phase == "recovering" and run.cancel is not None:
        # a re-plan under way when the job was cancelled ends with it: the person asked to stop
        return replace(run, phase="cancelled", outcome=run.cancel, wait=None), []
    measured = run.recovery is not None and run.recovery.kind in ("adapt", "links")
    if isinstance(event, PlanReady | PlanFailed) and run.phase == "recovering" and measured:
        return _planned_again(run, event, now)
    return recovering.recovery_input(run, event, now)


# --- waits --------------------------------------------------------------------


def _on_reply(run: Run, event: Reply, now: float) -> Out:
    msg = event.msg
    if isinstance(msg, ReplicaSaved):
        if run.book is None:
            return run, []
        book, why = run.book.note(msg, run.committed)
        if why is not None:
            return run, [
                Log("warning", "ignored replica report", {"peer": msg.device, "reason": why})
            ]
        return replace(run, book=book), []
    return _waited(run, event, now)


def _on_probe_answer(run: Run, event: ProbeAnswer, now: float) -> Out:
    """During a wait the wait judges the answer; between waits, an open probe is closed."""
    if run.wait is not None and not run.wait.done:
        return _waited(run, event, now)
    members, probes, counted = on_probe_reply(
        run.members, run.probes, event.device, event.nonce, now
    )
    if not counted:  # late (the device was declared dead meanwhile) or stale
        why = {"device": event.device, "nonce": event.nonce}
        return run, [Log("info", "ignored a probe answer nobody waits for", why)]
    return replace(run, members=members, probes=probes), [
        Heard(event.device, now),
        Log("info", "suspect answered the probe", {"device": event.device}),
    ]


def _waited(run: Run, event: core.Event, now: float) -> Out:
    """Feed the step's wait; on its verdict, move the job on."""
    if run.wait is None or run.wait.done:
        return recovering.kept(run, event, now)
    w, cmds = core.apply(run.wait, event, now)
    run = replace(run, wait=w, probes=w.probes, suspects=w.suspects, next_nonce=w.next_nonce)
    out: list[Command] = []
    for cmd in cmds:
        if isinstance(cmd, SendProbe | Heard | Log):
            out.append(cmd)
        elif isinstance(cmd, core.Complete):
            run, more = _completed(run, cmd.replies, now)
            return run, [*out, *more]
        elif isinstance(cmd, core.Lost):
            run, more = recovering.lost(run, cmd.devices, cmd.reason, now)
            return run, [*out, *more]
        elif run.from_peers and run.phase == "assign" and not run.started:
            # a device does not hold the round it was to keep: back to the checkpoint
            why = f"resuming from the devices' own state failed: {cmd.reason}"
            run, more = recovering.lost(replace(run, from_peers=False), [], why, now)
            return run, [*out, *more]
        else:  # core.Fail: a worker's error, or the replies took too long
            return fail(run, cmd.reason, out)
    return run, out


def _completed(run: Run, replies: Mapping[DeviceId, Message], now: float) -> Out:
    """Every device replied to the step: the job's next step."""
    if run.phase == "assign":
        return _assigned(run, now)
    if run.phase == "round":
        return _round_done(run, {d: m for d, m in replies.items() if isinstance(m, RoundDone)}, now)
    if run.phase == "eval":
        return _eval_done(run, {d: m for d, m in replies.items() if isinstance(m, EvalDone)}, now)
    saved = {d: m for d, m in replies.items() if isinstance(m, CheckpointSaved)}
    if run.phase == "collect":
        rec = known(run.recovery, "the recovery")
        at = known(rec.version, "the recovery's version")
        commit = CommitCheckpoint(at, run.layers, None, commits.weight_version(run, at))
        run, more = recovering.resume(replace(run, wait=None), now)
        return run, [commit, *more]
    return _checkpoint_done(run, saved, now)


# --- the training steps -------------------------------------------------------


def _assign(run: Run, now: float) -> Out:
    """Send every device its stage under the new epoch; wait until all loaded it."""
    rec = run.recovery
    moves = rec.moves if rec is not None else None
    keep = moves is None and run.from_peers and not run.started  # every device its own state
    frm = run.step
    missing = [d for d in run.plan.devices if d not in run.members]
    if missing:
        return fail(
            run, f"workers {missing} of the plan are not known (joined: {sorted(run.members)})"
        )
    peers = {str(d): run.members[d].info.data_addr for d in run.plan.devices}
    cmds: list[Command] = [
        Send(
            d,
            Assign(
                epoch=run.epoch,
                job=run.job,
                plan=run.plan,
                stage=run.plan.stage_of(d),
                peers=peers,
                from_round=frm,
                total_rounds=run.total,
                sources={} if keep else None if moves is None else moves.received_by(d),
                sends={} if moves is None else moves.sent_by(d),
            ),
        )
        for d in run.plan.devices
    ]
    if moves is not None:  # a drained device may hold layers nobody else does: it sends them
        leaving = sorted(d for d in moves.sends if d not in run.plan.devices)
        cmds += [
            Send(d, Handover(epoch=run.epoch, version=frm, peers=peers, sends=moves.sent_by(d)))
            for d in leaving
        ]
    run = replace(run, phase="assign")
    if rec is not None:
        run = replace(run, recovery=replace(rec, moving_at=rec.moving_at or now))
    # watched like a round: a device that never starts its stage (one that heartbeats but
    # never took the Assign) is hung; one loading its stage says it is waiting on the load
    return begin_step(run, Assigned, frm, now), cmds


def _assigned(run: Run, now: float) -> Out:
    """Every device holds its stage: the job runs (again)."""
    book = ReplicaBook(run.plan, run.epoch, run.step, run.job.replicate_every)
    cmds: list[Command] = []
    rec = run.recovery
    if rec is not None:
        run, cmds = recovering.recovered(run, now)
    # a re-partition keeps the groups and is judged against the speeds it assumed
    speeds = Speeds.assumed(rec.speeds) if rec is not None and rec.speeds else Speeds()
    run = replace(run, book=book, committed=run.step, wait=None, speeds=speeds)
    cmds.append(
        Record("running", {"epoch": run.epoch, "round": run.committed, "total_rounds": run.total})
    )
    first, run = not run.started, replace(run, started=True)
    if first and run.job.eval_every and run.committed == 0:
        more = _eval(run, 0, now)  # the baseline the gain is measured from
    elif not first and run.committed >= run.total:
        # resumed at the last round: its evaluation and checkpoint may be what the loss cut
        evaluated = any(e[0] == run.committed for e in run.summary.evals)
        more = _after_eval(run, now) if evaluated else _after_round(run, now)
    else:
        more = _next_round(run, now)
    return more[0], [*cmds, *more[1]]


def _next_round(run: Run, now: float) -> Out:
    """Start the next round, or end: all rounds done, or cancelled at this boundary.

    A drain asked for, or a device that joined, re-plans here first: at a
    round boundary every device holds the committed round, so nothing replays.
    """
    if run.cancel is not None:
        return replace(run, phase="cancelled", outcome=run.cancel, wait=None), []
    r = run.committed
    if r >= run.total:
        return replace(run, phase="finished", wait=None), [Record("finished", {"round": run.total})]
    change = recovering.membership_change(run, now)
    if change is not None:
        return change
    if run.job.adapt and run.costs is not None:
        moved = adapt.proposal(
            run.speeds, run.plan, run.costs, run.total - r, run.replan_s, run.memory
        )
        if moved is not None and recovering.plannable(run):
            # worth moving even by partition points alone: the planner may also regroup
            slowdowns = adapt.slowdowns(run.speeds)
            why = "measured speeds drifted from the plan's: " + ", ".join(
                f"{d} {x:.2f}x" for d, x in sorted(slowdowns.items())
            )
            return recovering.plan_again(run, "adapt", why, now, slowdowns)
        if moved is not None:  # a hand-made plan: its partition points move
            return recovering.adapt(run, *moved, now)
    if run.job.adapt and run.watch.due:
        why = (
            f"communication took over {link_drift.SLOWER:g}x the predicted "
            f"{run.plan.predicted_comm_s:.3f} s for {run.watch.slow} rounds in a row"
        )
        return recovering.plan_again(run, "links", why, now)
    book, keep, replicate = known(run.book, "the replica book").round_starts(r)
    run = replace(run, phase="round", book=book)
    cmds: list[Command] = [
        Send(d, RunRound(epoch=run.epoch, round=r, keep=keep, replicate=replicate))
        for d in run.plan.devices
    ]
    return begin_step(run, RoundDone, r, now), cmds


def _planned_again(run: Run, answer: PlanReady | PlanFailed, now: float) -> Out:
    """Planned again on measurements: move to the planner's plan if worth it, else keep going.

    Whether it is worth it, and how the job settles either way, is
    `remeasure.judge`'s; a kept plan is stored again and the job goes on at
    the same round boundary: nothing ran meanwhile, nothing is replayed.
    """
    run, cmds, move = remeasure.judge(run, answer)
    if move is not None:
        run, more = recovering.replanned(run, *move, now)
        return run, [*cmds, *more]
    kept = replace(run, phase="recovering", recovery=None)
    run, more = _next_round(kept, now)
    return run, [*cmds, StorePlan(kept.plan), *more]


def _round_done(run: Run, done: Mapping[DeviceId, RoundDone], now: float) -> Out:
    """Commit the round: its loss, metrics and sample ledger, durably; then what is due."""
    run, cmds = commits.round_committed(run, done, now)
    run, more = _after_round(run, now)
    return run, [*cmds, *more]


def _due(every: int, done: int, total: int) -> bool:
    return done == total or bool(every and done % every == 0)


def _after_round(run: Run, now: float) -> Out:
    """The evaluation due after the round just committed, else its checkpoint, else the next."""
    if _due(run.job.eval_every, run.committed, run.total):
        return _eval(run, run.committed, now)
    return _after_eval(run, now)


def _after_eval(run: Run, now: float) -> Out:
    if _due(run.job.checkpoint_every, run.committed, run.total):
        return _checkpoint(run, run.committed, now)
    return _next_round(run, now)


def _eval(run: Run, round_no: int, now: float) -> Out:
    """Evaluate the weights of `round_no` on the held-out set, through the pipeline."""
    batches = -(-(run.eval_samples or eval_size(run.job)) // run.plan.global_batch)
    run = replace(run, phase="eval")
    cmds: list[Command] = [
        Send(d, RunEval(epoch=run.epoch, round=round_no, batches=batches)) for d in run.plan.devices
    ]
    return begin_step(run, EvalDone, round_no, now), cmds


def _eval_done(run: Run, done: Mapping[DeviceId, EvalDone], now: float) -> Out:
    round_no = run.step
    run, cmds = commits.evaluated(run, done)
    if round_no == 0 and run.committed == 0:  # the baseline: training starts now
        run, more = _next_round(run, now)
    else:
        run, more = _after_eval(run, now)
    return run, [*cmds, *more]


def _checkpoint(run: Run, round_no: int, now: float) -> Out:
    """Have every device save its part: leaders write the layers, every replica digests."""
    run = replace(run, phase="checkpoint")
    cmds: list[Command] = [
        CheckStore(f"checkpointing round {round_no}"),
        *(Send(d, SaveCheckpoint(epoch=run.epoch, round=round_no)) for d in run.plan.devices),
    ]
    return begin_step(run, CheckpointSaved, round_no, now), cmds


def _checkpoint_done(run: Run, saved: Mapping[DeviceId, CheckpointSaved], now: float) -> Out:
    """Commit the checkpoint once every replica of each stage agrees, else fail naming them."""
    round_no = run.step
    digests = tuple(
        {str(a.device): saved[a.device].digest for a in st.devices} for st in run.plan.stages
    )
    try:
        check_replicas(round_no, digests)
    except CheckpointError as exc:
        return fail(run, str(exc))
    summary = replace(run.summary, checkpoints=(*run.summary.checkpoints, round_no))
    run, more = _next_round(replace(run, summary=summary, wait=None), now)
    return run, [
        CommitCheckpoint(round_no, run.layers, digests, commits.weight_version(run, round_no)),
        *more,
    ]
