"""The coordinator: the cluster, the job queue, and the I/O a running job's core needs.

One thread, one ROUTER (`control`): `pump()` takes whatever arrived (the cluster's
core takes heartbeats, hellos and people's requests, answered at once; everything
else waits in the inbox of `waits`). A running job (`jobs.JobRun`) reads what
arrived as events (`Waits.events`) and feeds them to its pure core
(`driver.apply`), which decides every step, including when a worker that reports
an error, is lost (its heartbeats stopped and it did not answer a probe) or hung
(it heartbeats but makes no progress for longer than the watchdog) fails or
recovers the job. `gather` waits for one step's replies outside a job by the
same rules (`core.apply`).

The pieces live in their own modules: `control` (the socket and who may send
what), `cluster_shell` (devices, services and people's requests, decided by
the pure `cluster` core), `writes` (Redis through an outage), `waits` (the
waits outside a job's core), `job_records` (a job's record in Redis); this
class wires them together and runs jobs one after another (`serve`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from common.errors import AsteroidError
from common.ids import DeviceId
from common.job import JobSpec
from common.locate import location_of
from common.logging import get_logger
from common.messages import (
    CancelJob,
    DrainDevice,
    Heartbeat,
    LinksMeasured,
    LocateRedis,
    Message,
    ProbeReply,
    ReplicaSaved,
    ServiceHello,
    Shutdown,
    SubmitJob,
)
from common.plan import Plan
from common.records.counters import raise_fence
from common.records.jobs import read_job, write_job_state
from common.secrets import mask_text
from common.serving_messages import InferRequest, ServeModel, ServeSpec
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator import job_records
from services.coordinator.active import A, Active, Crashed, Run, job_of
from services.coordinator.checks import CheckedJob, check_data, check_job
from services.coordinator.cluster_shell import Cluster, StateField
from services.coordinator.cluster_state import HeartbeatIn, HelloIn, ProbeAnswerIn, Queued, Sweep
from services.coordinator.control import PUMP_MAX_MESSAGES, ControlSocket, role_refusal
from services.coordinator.fair_queue import FairQueue
from services.coordinator.federated import FederatedRun
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.jobs import JobRun
from services.coordinator.membership import Members, Probes, Verdict
from services.coordinator.model_probe import probe_limits
from services.coordinator.outcomes import JobCancelled, JobFailed, JobSummary
from services.coordinator.serving import ServeRun
from services.coordinator.waits import Waits
from services.coordinator.writes import Writes

__all__ = [
    "PUMP_MAX_MESSAGES",
    "Coordinator",
    "JobCancelled",
    "JobFailed",
    "JobSummary",
    "role_refusal",
]

log = get_logger(__name__)
ACTIVE_POLL_S = 0.05
"""Longest the loop waits for a message while a job runs: its cores' clocks tick at least
this often (a step's deadline, a probe's timeout, a request's wait_s are checked per tick)."""
IDLE_POLL_S = 0.2
"""Longest the loop waits for a message between jobs."""


class Coordinator:
    """Drives jobs over a ROUTER socket; state and checkpoints go to Redis."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.control = ControlSocket(settings)
        self.endpoint = self.control.endpoint
        self.store = Store(settings.redis_url, settings.cluster)
        self.writes = Writes(self.store, settings.redis_outage_s, idle=self._idle)
        self.cluster = Cluster(settings, self.store, self.writes, self.control.send)
        """The cluster's core (members, services, the queue, people's requests) and its shell."""
        self.waits = Waits(settings, self.store, self.control, self.cluster, self.writes, self.pump)
        self.active: Active | None = None
        """The running job's run, which the loop steps (`_loop`); None between jobs."""
        self.stopping: str | None = None
        """Why the coordinator stops (a signal's name), once `stop` was called."""
        self.links_pending: set[tuple[DeviceId, int]] = set()
        """Link measurements asked (worker, nonce) and not answered: only their answers count."""
        self._next_link_nonce = 1
        # what a job's shell and the tests use, under the names they always had
        self.send = self.control.send
        self.durable = self.writes.durable
        self.write_soon = self.writes.write_soon
        self.check_cancelled = self.waits.check_cancelled
        self.wait_for_devices = self.waits.wait_for_devices
        self.alive = self.waits.alive
        self.cluster_base = self.waits.cluster_base
        self.events = self.waits.events
        self.carry_out = self.waits.carry_out
        self.gather = self.waits.gather
        self.request_plan = self.waits.request_plan
        self.inbox, self.replica_news = self.waits.inbox, self.waits.replica_news
        self.timeouts = self.waits.timeouts
        self.routes = self.control.routes

    # --- state the runs and the tests read and set: the cluster core's -------------

    members: StateField[Members] = StateField()
    """Devices heard from."""
    probes: StateField[Probes] = StateField()
    """Probes sent to suspects and not answered yet."""
    running: StateField[str | None] = StateField()
    """The job running now, if any."""
    federated: StateField[str | None] = StateField()
    """The federated job whose pieces run now, if any."""
    assigned: StateField[frozenset[DeviceId]] = StateField()
    """Devices the running job's plan names."""
    services: StateField[dict[str, float]] = StateField()
    """Services heard from, and when they last said hello (monotonic seconds)."""
    queue: StateField[deque[Queued]] = StateField()
    """Jobs waiting to run, in arrival order (the loop takes the next from it)."""
    infer_queue: StateField[FairQueue[PendingRequest]] = StateField()
    """Inference requests for the running serving job (its run takes them from it)."""
    cancelled: StateField[dict[str, str]] = StateField()
    """Jobs under way someone cancelled, and why (the job takes it at its next step)."""
    drains: StateField[dict[DeviceId, str]] = StateField()
    """Devices of the running job to drain, and why (the job takes them)."""
    heartbeat_counts: StateField[dict[Verdict | str, int]] = StateField("counts")
    """Heartbeats by what became of them, devices forgotten, device writes missed."""

    @property
    def collecting(self) -> bool:
        """Whether a wait or a running job reads the inbox (probe answers go there too)."""
        return self.waits.collecting

    @collecting.setter
    def collecting(self, on: bool) -> None:
        self.waits.collecting = on

    @property
    def bad_messages(self) -> int:
        """Messages dropped as malformed or outside their sender's rights."""
        return self.control.bad_messages

    @property
    def fence(self) -> int:
        """The fencing epoch of this coordinator (`raise_fence`); 0 until raised."""
        return self.control.fence

    # --- the socket -----------------------------------------------------------------

    def _idle(self, seconds: float) -> None:
        """Serve the socket for `seconds` while a Redis write waits out an outage.

        A cancel of the running job, or the coordinator's stop, ends the wait
        (JobCancelled): the job is recorded cancelled once Redis is back.
        """
        self.pump(seconds)
        if self.running and self.stopping is not None:
            raise JobCancelled("the coordinator was stopped")
        if self.running:
            self.check_cancelled(self.running)

    def raise_fence(self) -> int:
        """Take the next fencing epoch from Redis: workers then refuse older coordinators.

        Raised once at every start, so a coordinator that was replaced (restarted
        elsewhere, or thought dead) can no longer steer the cluster's workers.
        """
        self.control.fence = self.durable("raising the fence", lambda: raise_fence(self.store))
        log.info("coordinator fence raised", fence=self.fence)
        return self.fence

    def pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for messages and handle those waiting, within bounds.

        Bounded as `ControlSocket.receive` is, so a flood cannot keep a caller
        from its deadlines. Writes what an outage held back and forgets expired
        devices on the way out.
        """
        for peer, msg in self.control.receive(timeout_s):
            self._dispatch(peer, msg)
        now = time.monotonic()
        self.writes.flush(now)
        self.cluster.feed(Sweep(), now)

    def _dispatch(self, peer: DeviceId, msg: Message) -> None:
        """Hand an admitted message to whoever takes it; replies go to the inbox."""
        if isinstance(msg, Heartbeat):
            self.cluster.feed(HeartbeatIn(msg), time.monotonic())
        elif isinstance(msg, LocateRedis):  # no secret in the answer: any key may ask
            self.send(peer, location_of(self.settings.redis_url, self.settings.cluster, msg.nonce))
        elif isinstance(msg, ProbeReply):
            if self.collecting:  # a wait or a job judges it, in order with the replies
                self.inbox.append((msg.device, msg))
            else:
                self.cluster.feed(ProbeAnswerIn(msg.device, msg.nonce), time.monotonic())
        elif isinstance(msg, ReplicaSaved):
            self.replica_news.append(msg)  # the running job checks it against its plan
        elif isinstance(msg, ServiceHello):
            self.cluster.feed(HelloIn(msg.service, peer), time.monotonic())
        elif isinstance(msg, SubmitJob | CancelJob | DrainDevice | ServeModel | InferRequest):
            self.cluster.request(peer, msg, time.monotonic())
        elif isinstance(msg, LinksMeasured):
            self._links_measured(msg)
        else:
            self.inbox.append((peer, msg))

    def _links_measured(self, msg: LinksMeasured) -> None:
        """Keep a link measurement's answer only if it was asked for (and not yet answered)."""
        if (msg.device, msg.nonce) in self.links_pending:
            self.links_pending.discard((msg.device, msg.nonce))
            self.inbox.append((msg.device, msg))
            return
        self.control.bad_messages += 1
        log.warning(
            "dropped a link measurement nobody asked for (or one answered late)",
            peer=msg.device,
            nonce=msg.nonce,
        )

    def link_nonce(self, device: DeviceId) -> int:
        """A fresh nonce for a MeasureLinks to `device`, whose answer is now awaited."""
        nonce, self._next_link_nonce = self._next_link_nonce, self._next_link_nonce + 1
        self.links_pending.add((device, nonce))
        return nonce

    # --- jobs -------------------------------------------------------------------

    def write_state(self, jid: str, state: str, **extra: Any) -> None:
        """Write a job's state: its hash and its events stream."""
        write_job_state(self.store, jid, state, **extra)

    def register(self, checked: CheckedJob, forget_old: bool = False) -> None:
        """Record the job as submitted; with `forget_old`, delete an earlier run of this id."""
        job_records.register(self.store, checked, forget_old)

    def run_job(
        self, job: JobSpec, plan: Plan | None = None, resume: bool = False, replace: bool = False
    ) -> JobSummary:
        """Run `job` to its last round (with `plan`, or profiled and planned); raises.

        With `resume`, go on from the last round an earlier coordinator committed,
        on its plan, where the workers still hold it (a restarted coordinator loses
        nothing), else from the job's newest committed checkpoint (possibly written
        under another plan): workers are re-assigned, not restarted. A job
        id that already has state is refused unless `resume` (keep it) or `replace`
        (delete it first) says what to do with it: starting a job never deletes
        another run's checkpoints by itself.
        """
        allowed = self.settings.model_modules
        # on resume an unchanged, checkpointed spec skips the model build (seconds of torch
        # imports in a child while this socket, and the workers coming back, wait unread)
        layers = (
            self.durable(
                f"reading job {job.job_id}", partial(job_records.checked_layers, self.store, job)
            )
            if resume
            else None
        )
        checked = (
            check_job(job, allowed, probe_limits(self.settings))
            if layers is None
            else check_data(job, allowed, layers)
        )
        committed = 0

        def admit_job() -> None:
            nonlocal committed
            if resume:
                job_records.check_resumable(self.store, job.job_id, checked.rounds)
                # the rounds an earlier coordinator committed: its workers may still hold them
                record = read_job(self.store, job.job_id)
                committed = 0 if record is None else record.round or 0
            else:
                job_records.check_fresh(self.store, job.job_id, replace, "--replace")
            job_records.register(self.store, checked, forget_old=replace and not resume)

        self.durable(f"registering job {job.job_id}", admit_job)
        return self._run(checked, plan, resume, committed)

    def _run(
        self, checked: CheckedJob, plan: Plan | None, resume: bool, committed: int
    ) -> JobSummary:
        """Run a registered job in the one loop; its summary, or what ended it is raised."""
        self.active = self._started(checked, plan, resume, committed)
        ended = self._loop(until=checked.job_id)
        if ended is None:  # stopped: the job was recorded cancelled
            raise JobCancelled("the coordinator was stopped")
        if isinstance(ended, ServeRun):  # unreachable: a checked job is a training job
            raise JobFailed(f"job {checked.job_id} is a serving job")
        return ended.result()

    def serve(self, stop_after: str | None = None) -> JobSummary | None:
        """Run submitted jobs one after another until stopped (`stop`).

        With `stop_after`, return once that job has ended (its summary, or None
        if it did not finish).
        """
        ended = self._loop(until=stop_after)
        if ended is None or isinstance(ended, ServeRun):
            return None
        try:
            return ended.result()
        except AsteroidError:
            return None

    def stop(self, why: str) -> None:
        """Stop the coordinator: the loop ends the running job (recorded cancelled) and returns.

        Called from a signal handler (`common.bootstrap.Stop.on_stop`): it only
        notes the stop, which the loop takes at its next turn.
        """
        self.stopping = why

    def _loop(self, until: str | None = None) -> Active | None:
        """The coordinator's one loop: serve the socket and step the running job.

        Each turn reads what arrived (`events`: the registry and people's
        requests are served as it is read) and feeds it to the running job, whose
        core decides and whose shell carries the decisions out; a job that ended
        is finished and the next queued one started. Returns the run of job
        `until` once it ended, or None when stopped.
        """
        while True:
            if self.stopping is not None:
                if self.active is not None:
                    self._stop_active(self.stopping)
                return None
            if self.active is None:
                self.active = self._next_queued()
            active = self.active
            poll = ACTIVE_POLL_S if active is not None else IDLE_POLL_S
            for event in self.events(poll):
                if active is None or active.ended or self.stopping is not None:
                    continue
                active = self.active = self._guard(active, partial(active.feed, event))
            if active is not None and active.ended:
                self.active = None
                self._report(active)
                if until is not None and job_of(active) == until:
                    return active

    def _started(
        self, checked: CheckedJob, plan: Plan | None, resume: bool, committed: int
    ) -> Run | Crashed:
        """A registered training job's run, begun: as a home of a federation if it says so."""
        if checked.spec.federation is not None:
            federated = FederatedRun(self, checked)
            return self._guard(federated, partial(federated.begin, plan))
        run = JobRun(self, checked)
        return self._guard(run, partial(run.begin, plan, resume, committed))

    def _next_queued(self) -> Active | None:
        """The next queued job, begun; None when the queue is empty."""
        if not self.queue:
            return None
        job = self.queue.popleft()
        if isinstance(job, ServeSpec):
            serving = ServeRun(self, job)
            return self._guard(serving, serving.begin)
        return self._started(job, None, False, 0)

    def _guard(self, active: A, step: Callable[[], None]) -> A | Crashed:
        """Take one step of `active`; an error nobody foresaw ends that job, not the service.

        The job is then recorded failed, the coordinator's job slot freed and the
        run replaced by its `Crashed` end, which raises the error as its result.
        """
        try:
            step()
            return active
        except Exception as exc:
            jid = job_of(active)
            log.exception("job crashed", job=jid)
            error = f"job {jid} crashed in the coordinator: {mask_text(repr(exc))}"
            self.write_soon(
                f"job {jid} failed",
                partial(write_job_state, self.store, jid, "failed", error=error),
            )
            self.running, self.federated, self.collecting = None, None, False
            self.assigned = frozenset()
            return Crashed(jid, JobFailed(error))

    def _stop_active(self, why: str) -> None:
        """End the running job at once because the coordinator stops."""
        active, self.active = self.active, None
        if active is not None and not active.ended:
            log.info("stopping the running job", job=job_of(active), signal=why)
            self._guard(active, partial(active.stop, "the coordinator was stopped"))

    def _report(self, active: Active) -> None:
        """Log how a job ended (its record says so already)."""
        if isinstance(active, ServeRun):
            return
        try:
            active.result()
        except AsteroidError as exc:
            log.error("job ended", job=job_of(active), error=str(exc))

    def shutdown_workers(self, reason: str) -> None:
        """Tell every known worker to exit."""
        for d in self.members:
            self.send(d, Shutdown(reason=reason))
        self.pump(0.2)

    def close(self) -> None:
        """Release sockets and the Redis connection."""
        self.control.close()
        self.store.close()
