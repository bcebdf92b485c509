"""The cluster's decisions as a pure function: `apply(state, event, now) -> (state, commands)`.

Who is in the cluster (heartbeats, probe answers, hellos, expiry) and what
people ask (submit, serve, cancel, drain, infer) is decided here, one event at
a time, against the caller's clock; the shell (`cluster_shell`) carries the
commands out (replies, Redis writes, a job's check) and feeds each effect's
answer back as an event. The membership rules are `membership`'s: a heartbeat
is written to Redis at once for a new device, then at most once a second; a new
device beyond the cap of unassigned devices is dropped; a device silent for the
expiry time is forgotten, never one of the running job's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from common.ids import DeviceId
from common.lifecycle import ACTIVE
from common.messages import JobReply
from common.serving_messages import InferReply, Refusal
from services.coordinator.checked import CheckedJob, id_taken
from services.coordinator.cluster_state import (
    CancelIn,
    CheckJob,
    CheckServe,
    ClusterState,
    Command,
    DeviceUnrecorded,
    DrainIn,
    Event,
    ForgetDevices,
    HeartbeatIn,
    HelloIn,
    InferIn,
    JobChecked,
    JobLookedUp,
    JobRefused,
    JobRegistered,
    Log,
    LookUpJob,
    ProbeAnswerIn,
    RegisterJob,
    RegisterServe,
    Reply,
    ServeChecked,
    ServeIn,
    SubmitIn,
    Sweep,
    WriteDevice,
    WriteState,
)
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.membership import Verdict, admit, expired, forget, on_probe_reply
from services.coordinator.versions import forget_versions, note_version

__all__ = ["apply", "never_ran"]

Out = tuple[ClusterState, list[Command]]

_NEVER_RAN = frozenset({"failed", "cancelled", "recorded"})
"""What an id may hold and be replaced by a new submission, if it committed no round."""


def apply(state: ClusterState, event: Event, now: float) -> Out:
    """The state after `event` at time `now` (monotonic seconds), and what to do about it."""
    if isinstance(event, HeartbeatIn):
        return _heartbeat(state, event, now)
    if isinstance(event, ProbeAnswerIn):
        return _probe_answer(state, event, now)
    if isinstance(event, HelloIn):
        return _hello(state, event, now)
    if isinstance(event, Sweep):
        return _sweep(state, now)
    if isinstance(event, DeviceUnrecorded):
        return _count(state, "unrecorded"), []
    if isinstance(event, SubmitIn | JobChecked | ServeIn | ServeChecked):
        return _submission(state, event)
    if isinstance(event, JobRegistered):
        return _queue(state, event)
    if isinstance(event, JobRefused):
        return state, [_refuse(event.peer, event.job_id, event.error)]
    if isinstance(event, CancelIn):
        return _cancel(state, event)
    if isinstance(event, JobLookedUp):
        error = f"job {event.job_id} is not queued or running ({event.state})"
        return state, [_refuse(event.peer, event.job_id, error)]
    if isinstance(event, DrainIn):
        return _drain(state, event)
    return _infer(state, event, now)


def _count(state: ClusterState, what: Verdict | str, by: int = 1) -> ClusterState:
    return replace(state, counts={**state.counts, what: state.counts[what] + by})


def _refuse(peer: DeviceId, jid: str, error: str) -> Reply:
    return Reply(peer, JobReply(job_id=jid, ok=False, error=error))


# --- membership ----------------------------------------------------------------------


def _heartbeat(state: ClusterState, event: HeartbeatIn, now: float) -> Out:
    """Remember a heartbeat; write it at once for a new device, else at most once a second.

    A new id beyond the cap of unassigned devices is dropped; the first such
    drop is logged with its sender, later ones only counted.
    """
    hb, rules = event.hb, state.limits.rules
    members, verdict = admit(state.members, hb, now, rules, state.keep)
    counts = {**state.counts, verdict: state.counts[verdict] + 1}
    if verdict is Verdict.DROPPED:
        state = replace(state, counts=counts)
        if counts[verdict] > 1:
            return state, []
        why = "dropped heartbeat of a new device: too many unassigned devices"
        fields = {"peer": hb.device, "expected": f"at most {rules.max_unassigned}"}
        return state, [Log("warning", why, fields)]
    out: list[Command] = []
    if verdict is Verdict.JOINED:
        fields = {"worker": hb.device, "data": hb.data_addr, "version": hb.version}
        out.append(Log("info", "worker joined", fields))
    mine = state.limits.version
    versions, warn = note_version(state.versions, hb.device, hb.version, mine)
    if warn:
        fields = {"worker": hb.device, "worker_version": hb.version, "coordinator_version": mine}
        out.append(Log("warning", "worker runs another release than the coordinator", fields))
    if verdict is not Verdict.LIMITED:
        out.append(WriteDevice(hb, state.limits.record_ttl_s))
    return replace(state, members=members, versions=versions, counts=counts), out


def _probe_answer(state: ClusterState, event: ProbeAnswerIn, now: float) -> Out:
    """A suspect answered a probe no wait is judging: clear it, whatever its heartbeats."""
    members, probes, counted = on_probe_reply(
        state.members, state.probes, event.device, event.nonce, now
    )
    if counted:
        log = Log("info", "suspect answered the probe", {"device": event.device})
    else:  # late (the device was declared dead meanwhile) or stale
        fields = {"device": event.device, "nonce": event.nonce}
        log = Log("info", "ignored a probe answer nobody waits for", fields)
    return replace(state, members=members, probes=probes), [log]


def _hello(state: ClusterState, event: HelloIn, now: float) -> Out:
    """A service announced itself: it may be asked for plans or profiles."""
    out: list[Command] = []
    if event.service not in state.services:
        out.append(Log("info", "service joined", {"service": event.service, "peer": event.peer}))
    return replace(state, services={**state.services, event.service: now}), out


def _sweep(state: ClusterState, now: float) -> Out:
    """Forget devices not heard from for the expiry time (memory and their Redis key).

    Looks a few times a second at most; logs the heartbeat counters when they
    changed, so a flood shows in the log without a line per message. The
    running job's devices are never forgotten: it must see them dead, not absent.
    """
    if now < state.next_sweep:
        return state, []
    state = replace(state, next_sweep=now + state.limits.sweep_every_s)
    out: list[Command] = []
    gone = expired(state.members, now, state.limits.rules.expiry_s, state.keep)
    if gone:
        state = replace(
            state,
            members=forget(state.members, gone),
            versions=forget_versions(state.versions, gone),
        )
        state = _count(state, "expired", len(gone))
        out.append(ForgetDevices(tuple(gone)))
        out.append(Log("info", "forgot silent devices", {"count": len(gone), "first": gone[0]}))
    if state.counts != state.logged_counts:
        counts = {str(getattr(k, "value", k)): v for k, v in state.counts.items()}
        out.append(Log("info", "heartbeat counts", {**counts, "known": len(state.members)}))
        state = replace(state, logged_counts=dict(state.counts))
    return state, out


# --- people's requests ---------------------------------------------------------------


def _submission(state: ClusterState, event: SubmitIn | JobChecked | ServeIn | ServeChecked) -> Out:
    """A submission's steps: checked (an effect), then refused or registered (an effect).

    An id that is active or queued is refused; so is one that holds an earlier
    run, unless the submitter said to replace it or that run never ran a
    round (`never_ran`).
    """
    if isinstance(event, SubmitIn):
        return state, [CheckJob(event.peer, event.job, event.replace)]
    if isinstance(event, ServeIn):
        return state, [CheckServe(event.peer, event.spec)]
    if isinstance(event, ServeChecked):
        sid = event.spec.serve_id
        if event.state in ACTIVE or state.queued(sid):
            error = f"serve_id: job {sid} is already {event.state or 'queued'}"
            return state, [_refuse(event.peer, sid, error)]
        return state, [RegisterServe(event.peer, event.spec)]
    jid = event.checked.job_id
    if event.state in ACTIVE or state.queued(jid):
        error = f"job_id: job {jid} is already {event.state or 'queued'}"
        return state, [_refuse(event.peer, jid, error)]
    if event.held and not event.replace:
        if not never_ran(event):
            error = id_taken(jid, event.held, "submit with --replace")
            return state, [_refuse(event.peer, jid, error)]
        log = Log("info", "job replaces an earlier run that committed no round", {"job": jid})
        return state, [log, RegisterJob(event.peer, event.checked, forget_old=True)]
    return state, [RegisterJob(event.peer, event.checked, forget_old=event.replace)]


def never_ran(event: JobChecked) -> bool:
    """The id's earlier run failed or was cancelled before it committed a round.

    Such a run has no checkpoint or metrics worth keeping (a wait for workers
    that timed out, a bad spec the coordinator refused late), so submitting
    the same job again replaces it rather than making the person pick a new id
    or say `--replace`. A run with committed rounds is kept: its checkpoints.
    """
    return event.held in _NEVER_RAN and event.committed == 0


def _queue(state: ClusterState, event: JobRegistered) -> Out:
    """A registered job joins the queue; its submitter hears so."""
    job, jid = event.job, event.job.job_id
    what = "job submitted" if isinstance(job, CheckedJob) else "serving job submitted"
    state = replace(state, queue=deque([*state.queue, job]))
    reply = Reply(event.peer, JobReply(job_id=jid, ok=True))
    return state, [Log("info", what, {"job": jid, "by": event.peer}), reply]


def _cancel(state: ClusterState, event: CancelIn) -> Out:
    """Cancel a queued job at once (recorded cancelled); note a cancel of the running one.

    The running job takes its cancel at its next step; a cancel of a federated
    job stops the piece under way too.
    """
    jid, running, federated = event.job_id, state.running, state.federated
    out: list[Command] = []
    if state.queued(jid):
        state = replace(state, queue=deque(q for q in state.queue if q.job_id != jid))
        out.append(WriteState(jid, "cancelled", {"reason": event.reason}))
    elif jid in (running, federated):
        cancelled = {**state.cancelled, jid: event.reason}
        if jid == federated and running:  # the piece under way stops too
            cancelled[running] = event.reason
        state = replace(state, cancelled=cancelled)
    else:
        return state, [LookUpJob(event.peer, jid)]
    out.append(Log("info", "job cancel requested", {"job": jid, "by": event.peer}))
    out.append(Reply(event.peer, JobReply(job_id=jid, ok=True)))
    return state, out


def _drain(state: ClusterState, event: DrainIn) -> Out:
    """Note a drain for the running job, if the device is one of its plan's."""
    running, assigned = state.running, state.assigned
    jid = running or ""
    if not running or event.target not in assigned:
        error = f"device {event.target!r} runs no part of a job here"
        if running:
            error += f" (job {jid} runs on {sorted(assigned)})"
        return state, [_refuse(event.peer, jid, error)]
    state = replace(state, drains={**state.drains, event.target: event.reason})
    log = Log("info", "drain requested", {"device": event.target, "by": event.peer})
    return state, [log, Reply(event.peer, JobReply(job_id=jid, ok=True))]


def _infer(state: ClusterState, event: InferIn, now: float) -> Out:
    """Queue a request for the running serving job; refuse it at once if it cannot wait."""
    msg = event.msg
    req = PendingRequest(event.peer, msg, now)
    refusal: Refusal = "no_job"
    if state.running != msg.serve_id:
        error = f"no serving job {msg.serve_id} is running here (running: {state.running})"
    else:
        queue = state.infer_queue.copied()
        why = queue.offer(req.owner, req)
        if why is None:
            return replace(state, infer_queue=queue), []
        error, refusal = f"{why} (serving job {msg.serve_id})", "busy"
    reply = InferReply(serve_id=msg.serve_id, request=0, ok=False, error=error, refusal=refusal)
    return state, [Reply(event.peer, reply)]
