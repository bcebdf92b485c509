"""A job's preparation as one pure function: `apply(prep, event, now) -> (prep, commands)`.

Before a job trains, the coordinator waits for `min_workers` devices (without it,
for the devices present to settle) and vets them, profiles each kind of device
(cached profiles reused), measures the links between them, and asks the planner
for a plan; a job's start then waits for the plan's devices to be heard from. A
running job's re-plan (`replan`) goes the same way from the vetting of the
devices it names. Every decision is taken here, from the preparation's state and
one event at a time, and returned as commands; the shell (`jobs.JobRun`) owns the
socket, Redis and the clock, carries the commands out and feeds back what they
answer and what the network brings. So every rule is tested with scripted
events on a fake clock, without sockets.

Vetting: a heartbeat costs nothing to send, and anyone on the LAN can send one
that copies a real worker's fingerprint; planned into a stage, such a device
would take the Assign and the job would wait on it until its round timeout. So
before a device is planned it must (1) claim what its fingerprint says
(`claims.claim_problem`) and (2) answer a challenge sent to it (a Probe with a
fresh negative nonce, so a late answer is never taken for a suspect's, whose
probes count up) within the probe timeout. A device that fails either is left
out with a logged reason, never planned; one that answered once is not asked
again for the same job (the shell carries `proven` and `refused` from one
preparation of a job to the next).

Preparation ends `ready` (its `plan`, and for a re-plan `current_s`), `failed`
(`outcome`, `config` when the person must fix something) or `cancelled`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from common.ids import DeviceId
from common.job import JobSpec
from common.messages import LinksMeasured, PlanReply, Probe, ProfileReply
from common.plan import Plan
from services.coordinator import prepare_steps as steps
from services.coordinator.claims import claim_problem
from services.coordinator.core import Beats, Log, ProbeAnswer, Reply
from services.coordinator.job_state import Cancelled, Record, Send
from services.coordinator.membership import Members, dead
from services.coordinator.prepare_state import (
    Challenge,
    ClusterBaseRead,
    Command,
    Event,
    LinkAsked,
    NoteWaiting,
    Out,
    Prep,
    PrepLimits,
    ProfilesRead,
    Services,
    fail,
)

__all__ = ["apply", "replan", "start", "with_plan"]


def start(
    job: JobSpec,
    layers: int,
    limits: PrepLimits,
    now: float,
    members: Members,
    services: Mapping[str, float],
    next_challenge: int = -1,
) -> Out:
    """A job's start: wait for its vetted devices (`_workers`), then profile, measure, plan."""
    prep = Prep(
        job=job,
        layers=layers,
        limits=limits,
        replan=False,
        phase="workers",
        deadline=now + limits.join_timeout_s,
        members=dict(members),
        services=dict(services),
        next_challenge=next_challenge,
    )
    return _workers(prep, now)


def with_plan(
    job: JobSpec, layers: int, limits: PrepLimits, plan: Plan, now: float, members: Members
) -> Out:
    """A job given its plan (or resuming a stored one): check and store it, await its devices."""
    prep = Prep(job=job, layers=layers, limits=limits, replan=False, members=dict(members))
    return steps.with_plan(prep, plan, now)


def replan(
    job: JobSpec,
    layers: int,
    limits: PrepLimits,
    devices: Members,
    now: float,
    members: Members,
    services: Mapping[str, float],
    proven: frozenset[DeviceId] = frozenset(),
    refused: Mapping[DeviceId, str] | None = None,
    next_challenge: int = -1,
    current: Plan | None = None,
    slowdowns: Mapping[DeviceId, float] | None = None,
) -> Out:
    """A running job's re-plan on `devices`: vet them, profile, measure and plan again.

    With `current`, the planner also predicts the running plan's round on the
    new cluster (`Prep.current_s`); `slowdowns` multiply each device's profiled
    times by what was measured since.
    """
    prep = Prep(
        job=job,
        layers=layers,
        limits=limits,
        replan=True,
        phase="vetting",
        deadline=now + limits.probe_timeout_s,
        members=dict(members),
        services=dict(services),
        chosen=dict(devices),
        proven=proven,
        refused=dict(refused or {}),
        next_challenge=next_challenge,
        current=current,
        slowdowns=dict(slowdowns or {}),
    )
    if job.global_batch is None:
        return fail(prep, "global_batch: required when the planner makes the plan", config=True)
    prep, cmds = _challenge(prep, prep.chosen, now, again=True)
    prep, more = _vetting(prep, now)
    return prep, [*cmds, *more]


def apply(prep: Prep, event: Event, now: float) -> Out:
    """The preparation after `event` at time `now`, and what the shell must do about it."""
    if prep.ended:
        return prep, []
    if isinstance(event, Cancelled):
        return replace(prep, phase="cancelled", outcome=event.reason), [
            Log("info", "job cancel noted", {"reason": event.reason})
        ]
    if isinstance(event, Beats):
        prep = replace(prep, members=dict(event.members))
    elif isinstance(event, Services):
        prep = replace(prep, services=dict(event.known))
    elif isinstance(event, ProbeAnswer):
        return _answered(prep, event, now)
    elif isinstance(event, Reply):
        return _reply(prep, event, now)
    elif isinstance(event, ProfilesRead):
        if prep.phase != "profiling" or prep.reading is None:
            return prep, []
        return steps.profiles_read(prep, dict(event.found), now)
    elif isinstance(event, ClusterBaseRead):
        if prep.phase != "links" or prep.pairs or prep.measuring is not None:
            return prep, []
        return steps.base_read(replace(prep, base=event.base), now)
    elif isinstance(event, LinkAsked):
        if prep.phase != "links":
            return prep, []
        return steps.link_asked(prep, event.prober, event.request, now)
    return _waited(prep, now)


def _waited(prep: Prep, now: float) -> Out:
    """Heartbeats, services or time changed: the phase's wait looks again."""
    if prep.phase == "workers":
        return _workers(prep, now)
    if prep.phase == "vetting":
        return _vetting(prep, now)
    if prep.phase == "profiling":
        return steps.profiler_waited(prep, now)
    if prep.phase == "links":
        return steps.link_timed_out(prep, now)
    if prep.phase == "planning":
        return steps.planner_waited(prep, now)
    return steps.devices_heard(prep, now)


def _reply(prep: Prep, event: Reply, now: float) -> Out:
    msg = event.msg
    if isinstance(msg, ProfileReply) and prep.phase == "profiling":
        return steps.profile_answered(prep, event.device, msg, now)
    if isinstance(msg, LinksMeasured) and prep.phase == "links":
        return steps.link_answered(prep, event.device, msg, now)
    if isinstance(msg, PlanReply) and prep.phase == "planning":
        return steps.plan_answered(prep, event.device, msg, now)
    return prep, []


# --- vetting ----------------------------------------------------------------------


def _alive(prep: Prep, now: float) -> Members:
    lim = prep.limits
    gone = set(dead(prep.members, now, lim.heartbeat_s, lim.heartbeat_misses))
    return {d: m for d, m in prep.members.items() if d not in gone}


def _refuse(prep: Prep, device: DeviceId, why: str, cmds: list[Command]) -> Prep:
    """Leave `device` out for `why`, logged once per reason."""
    if prep.refused.get(device) == why:
        return prep
    cmds.append(Log("warning", "device left out of the plan", {"device": device, "reason": why}))
    return replace(prep, refused={**prep.refused, device: why})


def _challenge(prep: Prep, candidates: Members, now: float, again: bool) -> Out:
    """Leave out those whose claims lie; challenge the others not proven yet.

    A device whose challenge went unanswered is challenged again only with
    `again` (while the wait still needs devices), so a silent one delays a
    wait that has enough by one probe timeout at most.
    """
    cmds: list[Command] = []
    timeout = prep.limits.probe_timeout_s
    for d in sorted(candidates):
        if d in prep.proven:
            continue
        why = claim_problem(candidates[d].info)
        if why is not None:
            prep = _refuse(prep, d, why, cmds)
            continue
        sent = prep.challenges.get(d)
        if sent is not None and now - sent.sent_at <= timeout:
            continue  # still awaited
        if sent is not None or (d in prep.refused and not again):
            continue
        nonce = prep.next_challenge
        prep = replace(
            prep,
            challenges={**prep.challenges, d: Challenge(nonce, now)},
            next_challenge=nonce - 1,
        )
        cmds.append(Send(d, Probe(nonce=nonce)))
    return prep, cmds


def _expire(prep: Prep, now: float) -> Out:
    """Challenges unanswered for the probe timeout: their devices are left out."""
    timeout = prep.limits.probe_timeout_s
    late = sorted(d for d, c in prep.challenges.items() if now - c.sent_at > timeout)
    cmds: list[Command] = []
    if late:
        prep = replace(prep, challenges={d: c for d, c in prep.challenges.items() if d not in late})
        for d in late:
            prep = _refuse(prep, d, f"it did not answer a challenge within {timeout:g} s", cmds)
    return prep, cmds


def _answered(prep: Prep, event: ProbeAnswer, now: float) -> Out:
    """An answer to a device's open challenge proves it; any other changes nothing."""
    sent = prep.challenges.get(event.device)
    if sent is None or sent.nonce != event.nonce:
        why = {"device": event.device, "nonce": event.nonce}
        return prep, [Log("debug", "ignored a probe answer nobody waits for", why)]
    prep = replace(
        prep,
        proven=prep.proven | {event.device},
        challenges={d: c for d, c in prep.challenges.items() if d != event.device},
    )
    return _waited(prep, now)


def _workers(prep: Prep, now: float) -> Out:
    """Wait for the job's workers to be vetted; then profile them.

    With `min_workers`, until that many are. Without, the job fits the cluster
    it is run on: it starts on the vetted devices present (at least one) once
    they stayed the same for `settle_s`, so workers started together are not
    left behind. Each change of the vetted devices is logged and written into
    the job's hash (`NoteWaiting`), where `status` and `train` show the wait.
    """
    need = prep.job.min_workers
    alive = _alive(prep, now)
    prep, cmds = _expire(prep, now)
    vetted = tuple(sorted(d for d in alive if d in prep.proven))
    prep, more = _challenge(prep, alive, now, again=len(vetted) < (need or 1))
    cmds += more
    if vetted != prep.waiting_logged:
        prep = replace(prep, waiting_logged=vetted, vetted_since=now)
        have = f"{len(vetted)}" if need is None else f"{len(vetted)}/{need}"
        cmds.append(Log("info", "waiting for workers", {"vetted": have, "workers": list(vetted)}))
        cmds.append(NoteWaiting(vetted, need))
    outstanding = any(d in prep.challenges for d in alive)
    late = now > prep.deadline
    if need is None:
        settled = now - prep.vetted_since >= prep.limits.settle_s
        enough = bool(vetted) and (settled or late)
    else:
        enough = len(vetted) >= need
    if enough and not outstanding:
        prep = replace(prep, chosen={d: alive[d] for d in vetted})
        cmds += [NoteWaiting(None), Record("profiling", {"workers": list(vetted)})]
        if prep.job.global_batch is None:
            why = "global_batch: required when the planner makes the plan"
            return fail(prep, why, config=True, out=cmds)
        prep, more = steps.begin_profiling(prep, now)
        return prep, [*cmds, *more]
    if late:
        return fail(prep, _short(prep, list(vetted), need), out=[*cmds, NoteWaiting(None)])
    return prep, cmds


def _short(prep: Prep, vetted: list[DeviceId], need: int | None) -> str:
    """Why the wait for workers failed: how many it had, which, and who was left out why."""
    left = {d: why for d, why in prep.refused.items() if d not in vetted}
    within = f"within {prep.limits.join_timeout_s:g} s"
    if need is None:
        return f"no worker joined and was vetted {within} (left out: {left or 'none'})"
    return (
        f"min_workers: {need} workers wanted, {len(vetted)} joined and vetted {within} "
        f"({vetted}; left out: {left or 'none'})"
    )


def _vetting(prep: Prep, now: float) -> Out:
    """A re-plan's devices: once every challenge is answered or timed out, profile the vetted."""
    prep, cmds = _expire(prep, now)
    if any(d in prep.challenges for d in prep.chosen):
        return prep, cmds
    chosen = {d: m for d, m in prep.chosen.items() if d in prep.proven}
    prep, more = steps.begin_profiling(replace(prep, chosen=chosen), now)
    return prep, [*cmds, *more]
