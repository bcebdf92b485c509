"""The coordinator: registry, job driver, round commits, checkpoints.

One thread, one ROUTER: `pump()` takes whatever arrived (heartbeats update the
membership, everything else waits in the inbox) and the job driver gathers
the replies it needs with explicit timeouts, failing the job with a message
that names the worker when one reports an error or stops heartbeating.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from common.checkpoint import commit_checkpoint, latest_round, save_stage
from common.codec import Limits, recv_message, send_message
from common.errors import AsteroidError, PlanError, ProtocolError
from common.ids import DeviceId
from common.job import JobSpec
from common.logging import bind_global, get_logger
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    Heartbeat,
    Message,
    PlanReply,
    PlanRequest,
    RoundDone,
    RunRound,
    SaveCheckpoint,
    ServiceHello,
    Shutdown,
    WorkerError,
)
from common.plan import Plan
from common.settings import CoordinatorSettings
from common.sockets import bind_router
from common.store import Store
from common.zoo import build_model
from services.coordinator.membership import Members, dead, on_heartbeat

__all__ = ["Coordinator", "JobFailed", "JobSummary"]

log = get_logger(__name__)
NAME = "coordinator"
PLANNER = "planner"


class JobFailed(AsteroidError):
    """The job cannot continue; the message says which worker and why."""


@dataclass
class JobSummary:
    """What a finished job reports."""

    job_id: str
    rounds: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    max_alive: dict[str, int] = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)


class Coordinator:
    """Drives jobs over a ROUTER socket; state and checkpoints go to Redis."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.limits = Limits(settings.max_header_bytes, settings.max_tensor_bytes)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock, self.endpoint = bind_router(self.ctx, settings.bind, self.limits)
        self.store = Store(settings.redis_url, settings.cluster)
        self.members: Members = {}
        self.inbox: deque[tuple[DeviceId, Message]] = deque()
        self.bad_messages = 0
        self.services: dict[str, float] = {}

    # --- transport --------------------------------------------------------------

    def send(self, device: DeviceId, msg: Message) -> None:
        """Send a control message to a worker."""
        send_message(self.sock, msg, NAME, route=device.encode())

    def pump(self, timeout_s: float) -> None:
        """Process everything that arrives within `timeout_s` (at least one poll)."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            try:
                peer, env = recv_message(self.sock, self.limits, routed=True)
            except ProtocolError as exc:
                self.bad_messages += 1
                log.warning("dropped bad control message", peer=exc.sender, reason=exc.reason)
                continue
            claimed = getattr(env.msg, "device", peer)
            if claimed != peer:
                self.bad_messages += 1
                log.warning(
                    "dropped message whose device differs from its sender",
                    peer=peer,
                    claimed=claimed,
                    type=env.msg.type,
                )
            elif isinstance(env.msg, Heartbeat):
                self._heartbeat(env.msg)
            elif isinstance(env.msg, ServiceHello):
                if env.msg.service not in self.services:
                    log.info("service joined", service=env.msg.service, peer=peer)
                self.services[env.msg.service] = time.monotonic()
            else:
                self.inbox.append((DeviceId(peer), env.msg))
            if time.monotonic() >= deadline:
                break

    def _heartbeat(self, hb: Heartbeat) -> None:
        if hb.device not in self.members:
            log.info("worker joined", worker=hb.device, data=hb.data_addr)
        self.members = on_heartbeat(self.members, hb, time.monotonic())
        self.store.set_fields(
            {**hb.model_dump(mode="json"), "seen": time.time()}, "device", hb.device
        )

    def wait_for_devices(self, devices: list[DeviceId], timeout_s: float) -> None:
        """Block until every device in `devices` has sent a heartbeat."""
        deadline = time.monotonic() + timeout_s
        while missing := [d for d in devices if d not in self.members]:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"workers {missing} did not join within {timeout_s:.0f} s "
                    f"(joined: {sorted(self.members)})"
                )
            self.pump(0.1)

    def gather(
        self,
        kind: type[Message],
        devices: list[DeviceId],
        epoch: int,
        round_no: int,
        timeout_s: float,
    ) -> dict[DeviceId, Any]:
        """Wait for one `kind` reply of (epoch, round) from each of `devices`."""
        want = set(devices)
        got: dict[DeviceId, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(want):
            self.pump(0.05)
            for _ in range(len(self.inbox)):
                peer, msg = self.inbox.popleft()
                if isinstance(msg, WorkerError) and msg.epoch == epoch and peer in want:
                    raise JobFailed(f"worker {peer} failed in round {msg.round}: {msg.error}")
                if (
                    isinstance(msg, kind)
                    and peer in want
                    and getattr(msg, "epoch", None) == epoch
                    and getattr(msg, "round", None) == round_no
                ):
                    got[peer] = msg
                else:
                    log.debug("ignored stale reply", peer=peer, type=msg.type)
            now = time.monotonic()
            gone = [
                d
                for d in dead(
                    self.members, now, self.settings.heartbeat_s, self.settings.heartbeat_misses
                )
                if d in want
            ]
            if gone:
                raise JobFailed(
                    f"workers {gone} stopped heartbeating while the coordinator waited for "
                    f"{kind.__name__} of round {round_no}"
                )
            if now > deadline:
                raise JobFailed(
                    f"no {kind.__name__} of round {round_no} from {sorted(want - set(got))} "
                    f"within {timeout_s:.0f} s"
                )
        return got

    def request_plan(self, req: PlanRequest, timeout_s: float) -> Plan:
        """Ask the planner service for a plan (it lands in Redis) and load it."""
        deadline = time.monotonic() + timeout_s
        while PLANNER not in self.services:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"no planner service joined within {timeout_s:.0f} s (start asteroid-planner "
                    f"with --coordinator {self.endpoint})"
                )
            self.pump(0.1)
        self.send(DeviceId(PLANNER), req)
        while True:
            for _ in range(len(self.inbox)):
                peer, msg = self.inbox.popleft()
                if isinstance(msg, PlanReply) and msg.job_id == req.job_id:
                    if not msg.ok:
                        raise PlanError(f"planner {req.planner!r} failed: {msg.error}")
                    data = self.store.get_json("plan", req.job_id)
                    return Plan.model_validate(data)
                self.inbox.append((peer, msg))
            if time.monotonic() > deadline:
                raise JobFailed(f"the planner did not answer within {timeout_s:.0f} s")
            self.pump(0.1)

    # --- jobs -------------------------------------------------------------------

    def run_job(self, job: JobSpec, plan: Plan, resume: bool = False) -> JobSummary:
        """Run `job` with `plan` to its last round; raises JobFailed.

        With `resume`, start from the job's newest committed checkpoint (possibly
        written under another plan): workers are re-assigned, not restarted.
        """
        jid = job.job_id
        bind_global(job=jid)
        zoo = build_model(job.model, job.seed)
        plan.validate_for(len(zoo.layers))
        self.store.put_json(plan.model_dump(mode="json"), "plan", jid)
        self._job_state(jid, "submitted")
        try:
            return self._drive(job, plan, zoo.full(), resume)
        except AsteroidError as exc:
            self._job_state(jid, "failed", error=str(exc))
            raise

    def _job_state(self, jid: str, state: str, **extra: Any) -> None:
        self.store.set_fields({"state": state, "updated": time.time(), **extra}, "job", jid)
        self.store.append("events", jid, {"event": state, **extra})
        log.info("job state", state=state, **extra)

    def _drive(self, job: JobSpec, plan: Plan, model: Any, resume: bool) -> JobSummary:
        jid, devices = job.job_id, plan.devices
        s = self.settings
        self.wait_for_devices(devices, s.join_timeout_s)
        start = latest_round(self.store, jid) if resume else None
        if start is None:
            start = 0
            save_stage(self.store, jid, 0, model, None, 0)
            commit_checkpoint(self.store, jid, 0, len(model))
        elif start >= job.total_rounds():
            raise JobFailed(
                f"job {jid} already has a checkpoint of round {start} >= {job.total_rounds()}"
            )
        epoch = self._assign_all(job, plan, start)
        self._job_state(jid, "running", epoch=epoch, round=start)
        total = job.total_rounds()
        summary = JobSummary(job_id=jid, rounds=total)
        every = job.checkpoint_every
        for r in range(start, total):
            bind_global(round=r)
            self._round(job, plan, epoch, r, summary)
            if r + 1 == total or (every and (r + 1) % every == 0):
                self._checkpoint(jid, plan, epoch, r + 1, len(model))
                summary.checkpoints.append(r + 1)
        self._job_state(jid, "finished", round=total)
        return summary

    def _assign_all(self, job: JobSpec, plan: Plan, start: int) -> int:
        """Give every device its stage under a new plan epoch; returns the epoch."""
        s = self.settings
        epoch = int(self.store.r.incr(self.store.key("epoch")))
        peers = {str(d): self.members[d].info.data_addr for d in plan.devices}
        for d in plan.devices:
            msg = Assign(
                epoch=epoch,
                job=job,
                plan=plan,
                stage=plan.stage_of(d),
                peers=peers,
                from_round=start,
                store_url=s.redis_url,
                cluster=s.cluster,
            )
            self.send(d, msg)
        self.gather(Assigned, plan.devices, epoch, start, s.round_timeout_s)
        return epoch

    def _round(self, job: JobSpec, plan: Plan, epoch: int, r: int, summary: JobSummary) -> None:
        """Run round `r` on every device and commit it."""
        t0 = time.perf_counter()
        for d in plan.devices:
            self.send(d, RunRound(epoch=epoch, round=r))
        done = self.gather(RoundDone, plan.devices, epoch, r, self.settings.round_timeout_s)
        elapsed = time.perf_counter() - t0
        last = [a.device for a in plan.stages[-1].devices]
        loss = sum(done[d].loss_sum for d in last)
        acc = sum(done[d].correct for d in last) / plan.global_batch
        self._commit_round(job.job_id, r, epoch, loss, acc, elapsed, plan, done)
        summary.losses.append(loss)
        summary.accuracies.append(acc)
        summary.round_s.append(elapsed)
        for d, msg in done.items():
            summary.max_alive[d] = max(summary.max_alive.get(d, 0), msg.max_alive)

    def _checkpoint(self, jid: str, plan: Plan, epoch: int, round_no: int, layers: int) -> None:
        """Have each stage's leader write its layers, then commit checkpoint `round_no`."""
        leaders = [st.devices[0].device for st in plan.stages]
        for d in leaders:
            self.send(d, SaveCheckpoint(epoch=epoch, round=round_no))
        self.gather(CheckpointSaved, leaders, epoch, round_no, self.settings.round_timeout_s)
        commit_checkpoint(self.store, jid, round_no, layers)
        self.store.append("events", jid, {"event": "checkpoint", "round": round_no})

    def _commit_round(
        self,
        jid: str,
        r: int,
        epoch: int,
        loss: float,
        acc: float,
        elapsed: float,
        plan: Plan,
        done: dict[DeviceId, RoundDone],
    ) -> None:
        """Record round `r` as committed: weights now belong to round r+1."""
        self.store.set_fields({"round": r + 1, "epoch": epoch, "updated": time.time()}, "job", jid)
        self.store.append(
            "metrics",
            jid,
            {
                "round": r,
                "loss": loss,
                "accuracy": acc,
                "round_s": elapsed,
                "samples_per_s": plan.global_batch / elapsed,
                "devices": {
                    d: {"stage": m.stage, "max_alive": m.max_alive, **m.timings.model_dump()}
                    for d, m in done.items()
                },
            },
        )
        log.info(
            "round committed",
            loss=round(loss, 5),
            accuracy=round(acc, 3),
            round_s=round(elapsed, 3),
        )

    def shutdown_workers(self, reason: str) -> None:
        """Tell every known worker to exit."""
        for d in self.members:
            self.send(d, Shutdown(reason=reason))
        self.pump(0.2)

    def close(self) -> None:
        """Release sockets and the Redis connection."""
        self.sock.close(0)
        self.ctx.term()
        self.store.close()
