"""People's requests (through the CLI), answered at once: submit, cancel, drain, serve, infer.

A request is checked and either queued (a job, a serving job, an inference
request for the running serving job) or noted for the running job (a cancel, a
drain), and its sender gets a JobReply (InferReply) saying so or why not. Nothing
here waits: the job itself takes a cancel or a drain at its next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from common.errors import ConfigError
from common.ids import DeviceId
from common.job import JobSpec
from common.lifecycle import ACTIVE
from common.logging import get_logger
from common.messages import CancelJob, DrainDevice, JobReply, Message, SubmitJob
from common.records.documents import put_jobspec
from common.records.jobs import index_job, job_state, write_job
from common.secrets import mask_text
from common.serving_messages import InferReply, InferRequest, ServeModel, ServeSpec
from common.settings import CoordinatorSettings
from common.store import OUTAGE, REFUSED, Store
from services.coordinator import job_records
from services.coordinator.checks import CheckedJob, check_job
from services.coordinator.infer_requests import PendingRequest, infer_queue
from services.coordinator.model_probe import probe_limits
from services.coordinator.writes import Writes

__all__ = ["ClientRequest", "Clients", "Slot"]

log = get_logger(__name__)
ClientRequest = SubmitJob | CancelJob | DrainDevice | ServeModel | InferRequest
"""What a person may ask the coordinator."""


@dataclass
class Slot:
    """The job running now (one at a time), the federated job it is a piece of, its devices."""

    running: str | None = None
    federated: str | None = None
    """A federated job being run, whose local pieces are `running` in turn."""
    assigned: frozenset[DeviceId] = field(default_factory=frozenset)
    """Devices the running job's plan names: never forgotten nor capped while it runs."""

    def keep(self) -> frozenset[DeviceId]:
        """Devices exempt from expiry and the cap: the running job's, none between jobs."""
        return self.assigned if self.running else frozenset()


class Clients:
    """The queue of jobs and inference requests, and the cancels and drains not yet taken."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: Store,
        writes: Writes,
        slot: Slot,
        send: Callable[[DeviceId, Message], None],
    ) -> None:
        self.settings, self.store, self.writes, self.slot = settings, store, writes, slot
        self.send = send
        self.queue: deque[CheckedJob | ServeSpec] = deque()
        """Jobs waiting to run, training (checked) and serving, in arrival order."""
        self.infer_queue = infer_queue()
        """Inference requests for the running serving job, waiting their turn."""
        self.cancelled: dict[str, str] = {}
        """Jobs under way someone cancelled, and why; the job takes it at its next step."""
        self.drains: dict[DeviceId, str] = {}
        """Devices of the running job to drain, and why (at most the job's own devices)."""

    def handle(self, peer: DeviceId, msg: ClientRequest) -> None:
        """Answer a person's request with a JobReply (an InferReply only when refused)."""
        if isinstance(msg, SubmitJob):
            self._on_submit(peer, msg)
        elif isinstance(msg, CancelJob):
            self._on_cancel(peer, msg)
        elif isinstance(msg, DrainDevice):
            self._on_drain(peer, msg)
        elif isinstance(msg, ServeModel):
            self._on_serve(peer, msg)
        else:
            self._on_infer(peer, msg)

    def submit(self, job: JobSpec, replace: bool = False) -> None:
        """Check `job` and queue it; ConfigError says what is wrong and nothing starts."""
        checked = check_job(job, self.settings.model_modules, probe_limits(self.settings))
        state = job_state(self.store, job.job_id)
        if state in ACTIVE or any(q.job_id == job.job_id for q in self.queue):
            raise ConfigError(f"job_id: job {job.job_id} is already {state or 'queued'}")
        job_records.check_fresh(self.store, job.job_id, replace, "submit with --replace")
        job_records.register(self.store, checked, forget_old=replace)
        self.queue.append(checked)

    def _on_submit(self, peer: DeviceId, msg: SubmitJob) -> None:
        jid = msg.job.job_id
        try:
            self.submit(msg.job, msg.replace)
        except ConfigError as exc:
            self.send(peer, JobReply(job_id=jid, ok=False, error=str(exc)))
            return
        except OUTAGE as exc:
            error = (
                f"Redis at {self.store.where} is unreachable ({mask_text(str(exc))}): nothing "
                f"was queued; submit job {jid} again once it is back"
            )
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        except Exception as exc:  # a job must not take the coordinator down; say what broke
            log.exception("job check failed", job=jid, by=peer)
            error = f"job {jid} from {peer} cannot be checked: {exc!r}"
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        log.info("job submitted", job=jid, by=peer)
        self.send(peer, JobReply(job_id=jid, ok=True))

    def _on_drain(self, peer: DeviceId, msg: DrainDevice) -> None:
        """Queue a drain for the running job, if the device is one of its plan's."""
        running, assigned = self.slot.running, self.slot.assigned
        jid = running or ""
        if not running or msg.target not in assigned:
            error = f"device {msg.target!r} runs no part of a job here"
            if running:
                error += f" (job {jid} runs on {sorted(assigned)})"
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        self.drains[msg.target] = msg.reason
        log.info("drain requested", device=msg.target, by=peer)
        self.send(peer, JobReply(job_id=jid, ok=True))

    def _on_serve(self, peer: DeviceId, msg: ServeModel) -> None:
        """Queue a serving job, recorded like a training job (`kind: serve`)."""
        jid = msg.spec.serve_id
        store = self.store
        try:
            state = job_state(store, jid)
            if state in ACTIVE or any(q.job_id == jid for q in self.queue):
                raise ConfigError(f"serve_id: job {jid} is already {state or 'queued'}")
            put_jobspec(store, jid, msg.spec.model_dump(mode="json"))
            write_job(store, jid, state="submitted", submitted=time.time(), kind="serve")
            index_job(store, jid)
        except ConfigError as exc:
            self.send(peer, JobReply(job_id=jid, ok=False, error=str(exc)))
            return
        except OUTAGE as exc:
            error = f"Redis at {store.where} is unreachable ({mask_text(str(exc))})"
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        except REFUSED as exc:
            error = str(store.refusal(exc, f"recording serving job {jid}"))
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        self.queue.append(msg.spec)
        log.info("serving job submitted", job=jid, by=peer)
        self.send(peer, JobReply(job_id=jid, ok=True))

    def _on_infer(self, peer: DeviceId, msg: InferRequest) -> None:
        """Queue a request for the running serving job; refuse it at once if it cannot wait."""
        req = PendingRequest(peer, msg, time.monotonic())
        running = self.slot.running
        if running != msg.serve_id:
            error = f"no serving job {msg.serve_id} is running here (running: {running})"
        elif (why := self.infer_queue.offer(req.owner, req)) is not None:
            error = f"{why} (serving job {msg.serve_id})"
        else:
            return
        self.send(peer, InferReply(serve_id=msg.serve_id, request=0, ok=False, error=error))

    def _on_cancel(self, peer: DeviceId, msg: CancelJob) -> None:
        jid = msg.job_id  # matched the job-id pattern when the message was decoded
        running, federated = self.slot.running, self.slot.federated
        if any(q.job_id == jid for q in self.queue):
            self.queue = deque(q for q in self.queue if q.job_id != jid)
            self.writes.write_soon(
                f"job {jid} cancelled",
                partial(job_records.write_state, self.store, jid, "cancelled", reason=msg.reason),
            )
        elif jid in (running, federated):
            self.cancelled[jid] = msg.reason
            if jid == federated and running:  # the piece under way stops too
                self.cancelled[running] = msg.reason
        else:
            try:
                state = job_state(self.store, jid) or "unknown"
            except OUTAGE:
                state = "unknown while Redis is unreachable"
            error = f"job {jid} is not queued or running ({state})"
            self.send(peer, JobReply(job_id=jid, ok=False, error=error))
            return
        log.info("job cancel requested", job=jid, by=peer)
        self.send(peer, JobReply(job_id=jid, ok=True))
